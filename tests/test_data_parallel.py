"""Data parallelism: DDP's averaged gradients equal one process's on the global batch, and the
bytes each rank hands to all-reduce follow the gradient bytes (x k without no_sync, / 2 in 16
bits, PowerSGD's P and Q), and a corrupted reduction fails the check. One launch (6-12 s here)
is shared by every test that reads it: every variant as it is, then with rank 1's buckets doubled
before the all-reduce (fault=corrupt_reduction)."""
import re

import pytest
import torch
import torch.distributed as dist

from conftest import FAULTS, TINY_DIST, fault_fixtures
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import data_parallel as dp

pytestmark = pytest.mark.multiprocess  # this module starts ranks (6-12 s a launch)

# 1 MiB buckets: the tiny model's gradients (13.5 MiB) span several, so every hook sees many.
OVERRIDES = {**TINY_DIST, "device": "cpu", "steps": 2, "micro_batches": 2, "bucket_cap_mb": 1}
DDP_VARIANTS = [v for v in dp.VARIANTS if v != dp.REFERENCE]
CHECKED = [v for v in DDP_VARIANTS if dp.TOLERANCE.get(v, dp.FP32_TOLERANCE) is not None]
needs_nccl = pytest.mark.skipif(not (torch.cuda.is_available() and dist.is_nccl_available()),
                                reason="needs CUDA (>= 1 GPU) with NCCL; CPU ranks use gloo")


def by(rows, variant, metric, rank=0):
    hits = [r for r in rows if r["variant"] == variant and r["metric"] == metric and r["rank"] == rank]
    assert len(hits) == 1, (variant, metric, rank, hits)
    return hits[0]


run, rows, corrupted = fault_fixtures("data_parallel", OVERRIDES)


def config(variant="single", **overrides):
    return resolve(dp.Config, "tiny", {**OVERRIDES, "variant": variant, "nproc": 2, **overrides},
                   experiment="data_parallel")


def test_every_variant_runs_on_both_ranks_and_passes_its_check(rows):
    assert {(r["variant"], r["rank"]) for r in rows} == {(v, k) for v in dp.VARIANTS for k in (0, 1)}
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"][:2]


def test_ddp_and_accumulation_give_the_single_process_loss_and_gradients(rows):
    for variant in ("ddp", "accumulate", "accumulate_no_sync"):
        for rank in (0, 1):
            assert by(rows, variant, "grad_max_rel_diff", rank)["value"] <= dp.FP32_TOLERANCE
            # the loss after `steps` AdamW steps: still the reference's within fp32 noise
            assert abs(by(rows, variant, "loss_delta", rank)["value"]) < 1e-4


def test_comm_bytes_are_the_gradient_bytes_halved_by_16_bit_and_k_times_without_no_sync(rows):
    grad_bytes = by(rows, "ddp", "param_bytes")["value"]  # fp32 gradients: one per weight
    comm = {v: by(rows, v, "comm_bytes", rank)["value"] for v in dp.VARIANTS for rank in (0, 1)}
    assert comm["single"] == 0
    assert comm["ddp"] == grad_bytes == comm["accumulate_no_sync"]
    assert comm["accumulate"] == 2 * grad_bytes  # k = 2 all-reduces per step
    assert comm["fp16_compress"] == comm["bf16_compress"] == grad_bytes / 2
    for v in dp.VARIANTS:
        assert comm[v] == by(rows, v, "comm_bytes")["predicted"], v


def test_powersgd_sends_p_and_q_and_the_vectors_uncompressed():
    shapes = dp.grad_shapes(config("powersgd"))
    vectors = sum(s.numel() for s in shapes if len(s) == 1)  # norms: not worth compressing
    matrices = sum((s[0] + s[1]) * 1 for s in shapes if len(s) == 2)  # rank 1: P (n,1) + Q (m,1)
    assert dp.predicted_comm_numel(config("powersgd"), shapes) == vectors + matrices
    assert dp.predicted_comm_numel(config("accumulate"), shapes) == 2 * sum(s.numel() for s in shapes)


def test_powersgd_compresses_and_is_reported_as_lossy(rows):
    ddp_bytes, psgd_bytes = (by(rows, v, "comm_bytes")["value"] for v in ("ddp", "powersgd"))
    assert psgd_bytes < ddp_bytes / 20
    fp16, bf16, psgd = (by(rows, v, "grad_max_rel_diff")["value"] for v in
                        ("fp16_compress", "bf16_compress", "powersgd"))
    assert 0 < fp16 < bf16 < psgd  # 11, then 8 significant bits, then rank 1
    assert "lossy" in by(rows, "powersgd", "step_ms")["message"]


def test_buckets_follow_bucket_cap_mb(rows):
    for variant in DDP_VARIANTS:
        row = by(rows, variant, "num_buckets")
        assert row["value"] == row["predicted"], variant
        # PowerSGD on gloo runs in one bucket (its callbacks' all-reduces could fall out of order)
        assert row["value"] == 1 if variant == "powersgd" else row["value"] > 1, variant


def test_communication_share_is_the_synced_backward_less_the_local_one_over_the_step(rows):
    for variant in DDP_VARIANTS:
        for rank in (0, 1):
            ms = {m: by(rows, variant, m, rank)["value"]
                  for m in ("fwd_bwd_ms", "fwd_bwd_no_sync_ms", "synced_step_ms", "comm_ms")}
            # each repeat's synced forward and backward is part of its step: so are the medians
            assert 0 < ms["fwd_bwd_no_sync_ms"] and 0 < ms["fwd_bwd_ms"] <= ms["synced_step_ms"]
            assert ms["comm_ms"] == pytest.approx(ms["fwd_bwd_ms"] - ms["fwd_bwd_no_sync_ms"])
            fraction = by(rows, variant, "comm_fraction", rank)["value"]
            assert fraction == pytest.approx(ms["comm_ms"] / ms["synced_step_ms"]) and fraction < 1
    assert by(rows, "single", "comm_fraction")["value"] == by(rows, "single", "comm_ms")["value"] == 0


def test_a_corrupted_reduction_fails_every_checked_variant_on_every_rank(corrupted):
    for rank in (0, 1):
        assert {r["status"] for r in corrupted if r["variant"] == "single" and r["rank"] == rank} == {"ok"}
        for variant in CHECKED:
            mine = [r for r in corrupted if r["variant"] == variant and r["rank"] == rank]
            assert {r["status"] for r in mine} == {"error"}, variant
            # the first failing rank's reason, on every rank (distributed.agree)
            assert all(re.match(r"does not match single: (rank 0: )?gradients max relative .+, loss_rel_diff ",
                                r["message"]) for r in mine), mine[0]["message"]
            # (g0 + 2 g1) / 2 against (g0 + g1) / 2: far beyond any variant's tolerance
            assert by(corrupted, variant, "grad_max_rel_diff", rank)["value"] > 0.1, variant
        # PowerSGD is lossy and unchecked: its deltas are reported, the run goes on
        assert by(corrupted, "powersgd", "step_ms", rank)["status"] == "ok"


@needs_nccl
def test_nccl_ranks_match_one_process_and_flag_a_corrupted_reduction(tmp_path):
    n = torch.cuda.device_count()
    overrides = {**OVERRIDES, "device": "cuda", "nproc": n, "fault_rank": n - 1}
    rows = run_experiment("data_parallel", preset="tiny", overrides=overrides, sweep=FAULTS,
                          variants=["ddp", "accumulate_no_sync"], runs_dir=str(tmp_path),
                          progress=False).rows
    for r in rows:
        fine = r["params"]["fault"] == "none" or r["variant"] == dp.REFERENCE
        assert r["status"] == ("ok" if fine else "error"), (r["variant"], r["params"]["fault"], r["message"])


def test_sequences_per_forward_and_one_bucket_when_the_cap_holds_everything():
    shapes = {v: dp.piece_size(config(v)) for v in dp.VARIANTS}
    assert shapes["single"] == 2 * 2 * 2 and shapes["ddp"] == 2 * 2 and shapes["accumulate"] == 2
    assert dp.predicted_buckets(config(bucket_cap_mb=1000), dp.grad_shapes(config())) == 1


def test_only_float32_is_accepted():
    with pytest.raises(ConfigError, match="float32"):
        dp.validate(config(dtype="bf16"))

