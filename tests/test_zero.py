"""ZeRO stages on two gloo ranks: what each rank keeps, against plain DDP and the planner.

One launch of the experiment (about 15 s here) serves every test that reads rows: every variant
as it is, then with rank 1's part of the gradient reduction doubled (fault=corrupt_reduction)."""
import dataclasses
import re

import pytest
import torch
import torch.distributed as dist

from conftest import FAULTS, TINY_DIST, TINY_SHAPE, fault_fixtures
from conftest import one_row as get
from labkit import planner
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.blocks.model import build_model
from labkit.techniques import zero

pytestmark = pytest.mark.multiprocess  # this module starts ranks (6-12 s a launch)

RAN = ("ddp", "zero1", "zero2", "zero3")  # zero3_offload needs a GPU
RANKS = (0, 1)
# two gloo ranks, whatever GPUs the machine has; the preset's shape, whose DDP peak is the step's
CPU = {**TINY_DIST, **TINY_SHAPE, "device": "cpu"}
needs_nccl = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs CUDA (>= 1 GPU) with NCCL; CPU ranks use gloo")


def config(variant="ddp", **overrides):
    return resolve(zero.Config, "tiny", {**CPU, "variant": variant, "nproc": 2, **overrides},
                   experiment="zero")


run, rows, corrupted = fault_fixtures("zero", CPU)



def value(rows, variant, metric, rank):
    return get(rows, variant, metric, rank)["value"]


def num_tensors():
    """Parameter tensors of the tiny model: AdamW keeps one 4-byte step counter for each."""
    return len(list(build_model(config().model, device="meta").parameters()))


def test_every_rank_reports_every_variant(rows):
    assert {r["rank"] for r in rows} == set(RANKS)
    for rank in RANKS:
        skipped = get(rows, "zero3_offload", None, rank)
        assert skipped["status"] == "skipped" and skipped["message"].startswith("needs a GPU: ")
        for v in RAN:
            assert {r["status"] for r in rows if r["variant"] == v and r["rank"] == rank} == {"ok"}
            assert value(rows, v, "step_ms", rank) > 0
            assert value(rows, v, "peak_mem_bytes", rank) > 0


def test_every_stage_trains_exactly_as_ddp(rows):
    # Same weights and losses after two steps: gradients are halved sums in the same order and
    # AdamW is elementwise, so sharding the states changes nothing (here: bitwise).
    for rank in RANKS:
        for v in RAN:
            assert value(rows, v, "grad_max_rel_diff", rank) <= zero.TOLERANCE["cpu"]
            assert value(rows, v, "weight_max_rel_diff", rank) <= zero.TOLERANCE["cpu"]
            assert value(rows, v, "loss_rel_diff", rank) <= zero.TOLERANCE["cpu"]
            assert value(rows, v, "loss", rank) == pytest.approx(value(rows, "ddp", "loss", rank),
                                                                 rel=zero.TOLERANCE["cpu"])
    # each rank trains on its own half of the batch
    assert value(rows, "ddp", "loss", 0) != value(rows, "ddp", "loss", 1)


def test_a_corrupted_reduction_fails_every_stage_on_every_rank(corrupted):
    # zero1: rank 1's DDP buckets doubled before the all-reduce; zero2, zero3: its reduce-scatter
    # shard doubled after it. The reference, plain DDP, is left alone.
    for rank in RANKS:
        assert {r["status"] for r in corrupted if r["variant"] == "ddp" and r["rank"] == rank} == {"ok"}
        for v in RAN[1:]:
            mine = [r for r in corrupted if r["variant"] == v and r["rank"] == rank]
            assert {r["status"] for r in mine} == {"error"}, v
            assert all(re.match(r"does not match ddp: (rank 0: )?gradients max relative", r["message"])
                       for r in mine), mine[0]["message"]
            assert value(corrupted, v, "grad_max_rel_diff", rank) > 0.1, v


@needs_nccl
def test_nccl_ranks_train_as_ddp_and_flag_a_corrupted_reduction(tmp_path):
    n = torch.cuda.device_count()
    overrides = {**TINY_DIST, "device": "cuda", "nproc": n, "fault_rank": n - 1}
    rows = run_experiment("zero", preset="tiny", overrides=overrides, sweep=FAULTS,
                          runs_dir=str(tmp_path), progress=False).rows
    for r in rows:  # zero3_offload runs too: the GPU is there
        fine = r["params"]["fault"] == "none" or r["variant"] == zero.REFERENCE
        assert r["status"] == ("ok" if fine else "error"), (r["variant"], r["params"]["fault"], r["message"])


def test_sharding_halves_what_each_rank_keeps(rows):
    for rank in RANKS:
        def ratio(v, metric):
            return value(rows, v, metric, rank) / value(rows, "ddp", metric, rank)

        assert ratio("zero3", "param_bytes") == pytest.approx(0.5, rel=0.01)
        assert ratio("zero1", "optimizer_bytes") == pytest.approx(0.5, rel=0.10)  # whole tensors
        assert ratio("zero1", "param_bytes") == ratio("zero1", "grad_bytes") == 1.0
        assert ratio("zero2", "grad_bytes") == pytest.approx(0.5, rel=0.01)
        # FSDP2 reshards parameters after the backward even without resharding after forward
        assert ratio("zero2", "param_bytes") == pytest.approx(0.5, rel=0.01)


def test_model_states_equal_the_planner(rows):
    # Every dimension of the tiny model is even: the shards are exactly 1/2, no padding.
    counters = 4 * num_tensors()
    for rank in RANKS:
        for v in RAN:
            for metric in ("param_bytes", "grad_bytes"):
                row = get(rows, v, metric, rank)
                assert row["value"] == row["predicted"], (v, metric, rank)
        for v in ("ddp", "zero2", "zero3"):  # + one step counter per (sharded) tensor
            row = get(rows, v, "optimizer_bytes", rank)
            assert row["value"] == row["predicted"] + counters, (v, rank)
        row = get(rows, "zero1", "optimizer_bytes", rank)  # whole tensors: near an even split
        assert row["value"] == pytest.approx(row["predicted"], rel=0.10)


def test_ddp_peak_is_the_planners_stage_0_where_the_optimizer_step_sets_it(rows):
    # At these sizes the optimizer step sets the peak (the planner holds DDP's buckets through
    # the backward too: zero.DDP_PEAK). zero1's peak is not held to it: its for-loop AdamW makes
    # temporaries of whole tensors, which the planner shards. FSDP2's are the planner's FSDP2
    # terms; at these sizes the backward sets them, over the prediction by part of FSDP2's
    # reduce-scatter buffers (zero.FSDP2_PEAK): within 5%.
    cfg = config()
    plan = planner.training_memory(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                   precision="fp32", optimizer="adamw", gpus=2, device="cpu")
    assert plan.peak_phase == "step"
    for rank in RANKS:
        row = get(rows, "ddp", "peak_mem_bytes", rank)
        assert row["value"] == pytest.approx(row["predicted"], rel=0.01)
        for v in ("zero1", "zero2", "zero3"):
            assert value(rows, v, "peak_mem_bytes", rank) < row["value"]
        for v in ("zero2", "zero3"):
            fsdp2 = get(rows, v, "peak_mem_bytes", rank)
            assert fsdp2["predicted"] <= fsdp2["value"] <= 1.05 * fsdp2["predicted"], fsdp2


def test_offload_is_skipped_on_cpu_and_planned_on_gpus():
    assert zero.skip_reason(config("zero3_offload")).startswith("needs a GPU: ")
    assert zero.skip_reason(dataclasses.replace(config("zero3_offload"), device="cuda:0")) is None
    assert all(zero.skip_reason(config(v)) is None for v in RAN)


def test_expected_follows_what_each_variant_keeps_at_rest():
    psi = planner.num_params(config().model)
    for v, (param, grad, opt) in {"ddp": (1, 1, 1), "zero1": (1, 1, 2), "zero2": (2, 2, 2),
                                  "zero3": (2, 2, 2), "zero3_offload": (2, 2, 2)}.items():
        want = config(v)
        got = zero.expected(want)
        assert (got["param_bytes"], got["grad_bytes"], got["optimizer_bytes"]) == \
            (4 * psi / param, 4 * psi / grad, 8 * psi / opt), v
        assert ("peak_mem_bytes" in got) == (v != "zero3_offload")  # the planner has no offload


def test_training_is_fp32_only():
    with pytest.raises(ConfigError, match="float32"):
        zero.validate(config(dtype="bfloat16"))
