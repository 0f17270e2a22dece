"""Tensor parallelism on 2 CPU ranks (gloo): one launch, asserted on every rank's rows: every
variant as it is, then with rank 1's row-parallel partial products doubled before they are summed
(fault=corrupt_reduction)."""
import re

import pytest
import torch
import torch.distributed as dist

from conftest import FAULTS, TINY_DIST, fault_fixtures
from labkit import planner
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import tensor_parallel as tp

pytestmark = pytest.mark.multiprocess  # this module starts ranks (6-12 s a launch)

N = 2
VARIANTS = ("single", "tp", "tp_sp")
CPU = {**TINY_DIST, "device": "cpu"}  # two gloo ranks, whatever GPUs the machine has
needs_nccl = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs CUDA (>= 1 GPU) with NCCL; CPU ranks use gloo")


run, rows, corrupted = fault_fixtures("tensor_parallel", CPU)


def cfg(**overrides):
    return resolve(tp.Config, "tiny", {**CPU, "nproc": N, **overrides}, experiment="tensor_parallel")


def value(rows, variant, metric, rank):
    hits = [r for r in rows if (r["variant"], r["metric"], r["rank"]) == (variant, metric, rank)]
    assert len(hits) == 1, (variant, metric, rank, hits)
    return hits[0]


def test_every_variant_ran_on_every_rank(rows):
    assert all(r["status"] == "ok" for r in rows), [r["message"] for r in rows if r["status"] != "ok"]
    assert {(r["variant"], r["rank"]) for r in rows} == {(v, k) for v in VARIANTS for k in range(N)}


def test_outputs_and_gradients_equal_the_single_process_model(rows):
    for variant in ("tp", "tp_sp"):
        for rank in range(N):
            assert value(rows, variant, "logits_max_abs_diff", rank)["value"] <= 1e-5
            assert value(rows, variant, "grad_max_rel_diff", rank)["value"] <= 1e-5
            assert value(rows, variant, "loss_abs_diff", rank)["value"] <= 1e-5


def test_a_corrupted_reduction_fails_both_variants_on_every_rank(corrupted):
    for rank in range(N):
        assert {r["status"] for r in corrupted if r["variant"] == "single" and r["rank"] == rank} == {"ok"}
        for variant in ("tp", "tp_sp"):
            mine = [r for r in corrupted if r["variant"] == variant and r["rank"] == rank]
            assert {r["status"] for r in mine} == {"error"}, variant
            assert all(re.match(r"does not match single: (rank 0: )?gradients max relative .+, logits_max_abs_diff ", r["message"])
                       for r in mine), mine[0]["message"]
            assert value(corrupted, variant, "logits_max_abs_diff", rank)["value"] > 1e-3
            assert value(corrupted, variant, "grad_max_rel_diff", rank)["value"] > 1e-3


@needs_nccl
def test_nccl_ranks_match_the_single_model_and_flag_a_corrupted_reduction(tmp_path):
    n = 2 if torch.cuda.device_count() >= 2 else 1  # the tiny preset's 2 kv heads: degree 1 or 2
    overrides = {**TINY_DIST, "device": "cuda", "nproc": n, "fault_rank": n - 1}
    rows = run_experiment("tensor_parallel", preset="tiny", overrides=overrides, sweep=FAULTS,
                          runs_dir=str(tmp_path), progress=False).rows
    for r in rows:
        fine = r["params"]["fault"] == "none" or r["variant"] == tp.REFERENCE
        assert r["status"] == ("ok" if fine else "error"), (r["variant"], r["params"]["fault"], r["message"])


def test_param_bytes_are_the_local_shards_of_megatrons_split(rows):
    m = cfg().model
    for variant, n in (("single", 1), ("tp", N), ("tp_sp", N)):
        want = 4 * planner.stage_params(m, tp=n).total
        for rank in range(N):
            row = value(rows, variant, "param_bytes", rank)
            assert row["value"] == row["predicted"] == want
            # gradients laid out as their parameters (the embedding's comes out whole otherwise)
            assert value(rows, variant, "grad_bytes", rank)["value"] == want
    single = value(rows, "single", "param_bytes", 0)["value"]
    norms = 4 * (2 * m.num_layers + 1) * m.hidden_size  # replicated: the only bytes not halved
    assert value(rows, "tp", "param_bytes", 0)["value"] == (single - norms) / N + norms


def test_collectives_per_step_follow_megatrons_count(rows):
    L = TINY_DIST["num_layers"]
    want = {"tp": {"all_reduce": 4 * L + 2, "all_gather": 1, "reduce_scatter": 0},
            "tp_sp": {"all_reduce": 2 * L + 1, "all_gather": 4 * L + 3, "reduce_scatter": 4 * L + 2},
            "single": {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}}
    for variant, counts in want.items():
        for rank in range(N):
            for op, count in counts.items():
                row = value(rows, variant, f"{op}_count", rank)
                assert row["value"] == row["predicted"] == count, (variant, op)
            for metric in ("comm_bytes", "comm_bus_bytes"):
                row = value(rows, variant, metric, rank)
                assert row["value"] == pytest.approx(row["predicted"], rel=1e-12)
    m = cfg().model
    bsh = 4 * TINY_DIST["batch_size"] * TINY_DIST["seq_len"] * m.hidden_size
    bsv = bsh // m.hidden_size * m.vocab_size
    assert value(rows, "tp", "comm_bytes", 0)["value"] == (4 * L + 2) * bsh + bsv
    # sequence parallelism moves the same bytes per link, but for the norm weights' gradients
    norms = 4 * (2 * L + 1) * m.hidden_size
    tp_bus, sp_bus = (value(rows, v, "comm_bus_bytes", 0)["value"] for v in ("tp", "tp_sp"))
    assert sp_bus - tp_bus == pytest.approx(2 * norms * (N - 1) / N)


def test_tp_degree_must_divide_the_heads():
    with pytest.raises(ConfigError, match="valid degrees: \\[1, 2\\]"):
        run_experiment("tensor_parallel", preset="tiny", overrides={**TINY_DIST, "nproc": 4},
                       progress=False)  # the tiny preset has 2 kv heads: refused before launching
    with pytest.raises(ConfigError, match="tied"):
        tp.validate(cfg(tie_embeddings=True))
    tp.validate(cfg(nproc=4, num_kv_heads=4))


def test_sequence_parallel_needs_whole_pieces_of_the_sequence():
    assert tp.skip_reason(cfg(variant="tp_sp", seq_len=15)).startswith("sequence parallel splits")
    assert tp.skip_reason(cfg(variant="tp", seq_len=15)) is None



def test_activation_bytes_follow_the_planner_and_sequence_parallel_shards_the_block_norms(rows):
    """single and tp keep exactly the planner's activations. tp_sp keeps each block norm's saved
    tensors for seq_len / n tokens (the planner's saving: 2 norms a layer), and at most the final
    norm's saving more, which the planner leaves out (DTensor keeps tensors there that autograd
    did not save)."""
    layers = cfg().model.num_layers
    for rank in range(N):
        for v in ("single", "tp"):
            row = value(rows, v, "activation_bytes", rank)
            assert row["value"] == row["predicted"] > 0
        tp_row, sp_row = (value(rows, v, "activation_bytes", rank) for v in ("tp", "tp_sp"))
        per_norm = (tp_row["predicted"] - sp_row["predicted"]) / (2 * layers)
        assert per_norm > 0
        assert 2 * layers * per_norm <= tp_row["value"] - sp_row["value"] <= (2 * layers + 1) * per_norm
