"""Context parallelism on two gloo ranks: ring attention (contiguous and zig-zag) and Ulysses
against one process, bytes sent and saved per rank against the planner, and a ring bug caught.

One launch serves every test that reads rows: every variant as it is, then with the ring's
log-sum-exp rescaling skipped and with the causal mask across blocks dropped (`ring_bug`)."""
import dataclasses

import pytest
import torch
import torch.distributed as dist

from conftest import FAST, launch_fixtures
from conftest import one_row as get
from labkit import planner
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import context_parallel as cp

pytestmark = pytest.mark.multiprocess  # this module starts ranks

RAN = ("single", "ring", "ring_zigzag", "ulysses")  # torch_cp needs NCCL
RANKS = (0, 1)
# 16 tokens (4 zig-zag pieces of 4 on 2 ranks), 4 q heads reading 2 kv heads (GQA), 2 sequences
CPU = {**FAST, "device": "cpu", "nproc": 2, "timed_steps": 1, "batch_size": 2, "seq_len": 16,
       "num_kv_heads": 2, "timeout_s": 60}
BUGS = {"ring_bug": ["none", "no_rescale", "no_block_mask"]}
needs_nccl = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()
                                     and torch.cuda.device_count() >= 2),
                                reason="needs 2 GPUs with NCCL; CPU ranks use gloo")


def config(variant="single", **overrides):
    return resolve(cp.Config, "tiny", {**CPU, "variant": variant, **overrides},
                   experiment="context_parallel")


run, rows = launch_fixtures("context_parallel", CPU, BUGS, {"ring_bug": "none"})



def test_every_variant_matches_one_process_on_every_rank(rows):
    for rank in RANKS:
        skipped = get(rows, "torch_cp", None, rank)
        assert skipped["status"] == "skipped" and skipped["message"].startswith("needs NCCL ranks")
        for v in RAN:
            assert {r["status"] for r in rows if r["variant"] == v and r["rank"] == rank} == {"ok"}, v
            # this rank's tokens of the output and of dq, dk, dv against single's
            assert get(rows, v, "out_max_rel_diff", rank)["value"] <= cp.TOLERANCE
            assert get(rows, v, "grad_max_rel_diff", rank)["value"] <= cp.TOLERANCE


def test_bytes_sent_equal_the_formula_exactly(rows):
    cfg = config()
    block = 2 * 2 * 8 * cfg.model.head_dim * 4  # B x KV x S/n x D fp32: one k or v block
    for rank in RANKS:
        for v in ("ring", "ring_zigzag"):  # 2 x (3n - 2) blocks: k, v forward and backward, dk, dv
            for metric in ("comm_bytes", "comm_bus_bytes", "send_count", "recv_count"):
                row = get(rows, v, metric, rank)
                assert row["value"] == row["predicted"], (v, metric, rank)
            assert get(rows, v, "comm_bytes", rank)["value"] == 8 * block
            assert get(rows, v, "send_count", rank)["value"] == 8
        for metric in ("comm_bytes", "comm_bus_bytes", "all_to_all_count"):
            row = get(rows, "ulysses", metric, rank)
            assert row["value"] == row["predicted"], (metric, rank)
        # 8 all-to-alls of the whole shard (q, out: 2 x block; k, v: block); half leaves the rank
        assert get(rows, "ulysses", "comm_bytes", rank)["value"] == 2 * (2 * 2 * block + 2 * block)
        assert get(rows, "ulysses", "comm_bus_bytes", rank)["value"] == 6 * block
        assert get(rows, "single", "comm_bytes", rank)["value"] == 0


def test_each_rank_saves_half_of_one_process_exactly(rows):
    for rank in RANKS:
        whole = get(rows, "single", "activation_bytes", rank)
        assert whole["value"] == whole["predicted"]
        for v in RAN[1:]:
            row = get(rows, v, "activation_bytes", rank)
            assert row["value"] == row["predicted"] == whole["value"] / 2, v


def test_causal_work_is_unbalanced_on_contiguous_blocks_and_even_on_zigzag(rows):
    pairs = {v: [get(rows, v, "attended_pairs", r) for r in RANKS] for v in ("ring", "ring_zigzag")}
    for v, got in pairs.items():
        assert [r["value"] for r in got] == [r["predicted"] for r in got], v
        assert sum(r["value"] for r in got) == 16 * 17 / 2  # the causal mask's S(S+1)/2, all ranks
    assert [r["value"] for r in pairs["ring"]] == [36, 100]  # rank 1: rank 0's block + its triangle
    assert [r["value"] for r in pairs["ring_zigzag"]] == [68, 68]
    for rank in RANKS:
        assert get(rows, "ring", "idle_fraction", rank)["predicted"] == [0.5, 0.0][rank]
        assert 0 <= get(rows, "ring", "idle_fraction", rank)["value"] < 1


@pytest.mark.parametrize("bug", ["no_rescale", "no_block_mask"])
def test_a_ring_bug_fails_the_check(run, bug):
    # no_rescale: partial softmaxes summed without their log-sum-exp weights; no_block_mask: later
    # key blocks attended. Either breaks the ring on some rank; every rank reports the failure.
    rows = [r for r in run if r["params"]["ring_bug"] == bug]
    for rank in RANKS:
        for v in ("ring", "ring_zigzag"):
            mine = [r for r in rows if r["variant"] == v and r["rank"] == rank]
            assert {r["status"] for r in mine} == {"error"}, (v, bug)
            assert mine[0]["message"].startswith("does not match single: ")
        for v in ("single", "ulysses"):
            assert {r["status"] for r in rows if r["variant"] == v and r["rank"] == rank} == {"ok"}
    worst = max(r["value"] for r in rows if r["variant"] == "ring" and r["metric"] == "out_max_rel_diff")
    assert worst > 0.01


def test_ulysses_refuses_heads_that_do_not_divide_by_the_ranks():
    assert cp.skip_reason(config("ulysses")) is None
    reason = cp.skip_reason(config("ulysses", nproc=4))  # 2 kv heads over 4 ranks
    assert reason == ("ulysses splits heads over the ranks: num_heads=4 and num_kv_heads=2 must "
                      "both be multiples of nproc=4")
    assert cp.skip_reason(config("ring", nproc=4)) is None  # the ring splits tokens, not heads


def test_zigzag_needs_two_blocks_per_rank_and_gpu_variant_is_skipped_on_cpu():
    assert cp.skip_reason(config("ring_zigzag", seq_len=18)) == ("zig-zag splits seq_len=18 into 2 x 2 "
                                                                 "blocks: use a multiple of 4")
    assert cp.skip_reason(config("ring", seq_len=18)) is None
    assert cp.skip_reason(config("torch_cp")).startswith("needs NCCL ranks")
    assert cp.skip_reason(dataclasses.replace(config("torch_cp"), device="cuda:0")) is None


def test_validate_refuses_other_dtypes_and_uneven_shards():
    with pytest.raises(ConfigError, match="float32"):
        cp.validate(config(dtype="bfloat16"))
    with pytest.raises(ConfigError, match="seq_len=15 does not split into 2 equal blocks"):
        cp.validate(config(seq_len=15))


def test_ulysses_bytes_stay_flat_as_sequence_and_ranks_grow_while_the_ring_grows():
    shape = {"batch": 1, "heads": 8, "kv_heads": 8, "head_dim": 64}
    per_rank = 1024
    ulysses = [planner.ulysses_all_to_all_bytes(**shape, seq_len=per_rank * n, n=n) for n in (2, 4, 8)]
    ring = [planner.ring_sent_bytes(batch=1, kv_heads=8, head_dim=64, seq_len=per_rank * n, n=n)
            for n in (2, 4, 8)]
    assert len(set(ulysses)) == 1  # S per all-to-all: one shard, whatever n
    assert ring == [ring[0] * (3 * n - 2) // 4 for n in (2, 4, 8)]  # 2(3n-2) blocks of fixed size
    # the sequence fixed instead, Ulysses' bytes per rank shrink as n grows
    fixed = [planner.ulysses_sent_bytes(**shape, seq_len=4096, n=n) for n in (2, 4)]
    assert fixed[1] < fixed[0]


def test_causal_formulas_sum_to_the_mask():
    for n, split in ((2, "contiguous"), (4, "contiguous"), (4, "zigzag")):
        assert sum(planner.causal_pairs(64, n, split)) == 64 * 65 // 2
    assert planner.causal_imbalance(64, 4, "zigzag") == 1.0
    assert planner.causal_imbalance(64, 4) == pytest.approx((7 * 16 + 1) / 65)
    assert planner.causal_idle_fraction(64, 4) == [0.75, 0.5, 0.25, 0.0]


@needs_nccl
def test_nccl_ranks_match_one_process_with_torch_context_parallel(tmp_path):
    n = 2
    overrides = {**CPU, "device": "cuda", "nproc": n, "seq_len": 256}
    rows = run_experiment("context_parallel", preset="tiny", overrides=overrides,
                          runs_dir=str(tmp_path), progress=False).rows
    for r in rows:
        assert r["status"] == "ok", (r["variant"], r["metric"], r["message"])
