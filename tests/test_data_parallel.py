"""Data parallelism: DDP's averaged gradients equal one process's on the global batch, and the
bytes each rank hands to all-reduce follow the gradient bytes (x k without no_sync, / 2 in 16
bits, PowerSGD's P and Q). One launch (6-12 s here) is shared by every test that reads it."""
import math

import pytest

from conftest import TINY_DIST
from labkit.config import ConfigError, resolve
from labkit.experiment import run_experiment
from labkit.techniques import data_parallel as dp

# 1 MiB buckets: the tiny model's gradients (13.5 MiB) span several, so every hook sees many.
OVERRIDES = {**TINY_DIST, "steps": 2, "micro_batches": 2, "bucket_cap_mb": 1}
DDP_VARIANTS = [v for v in dp.VARIANTS if v != dp.REFERENCE]


def by(rows, variant, metric, rank=0):
    hits = [r for r in rows if r["variant"] == variant and r["metric"] == metric and r["rank"] == rank]
    assert len(hits) == 1, (variant, metric, rank, hits)
    return hits[0]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    result = run_experiment("data_parallel", preset="tiny", overrides=OVERRIDES,
                            runs_dir=str(tmp_path_factory.mktemp("runs")), progress=False)
    return result.rows


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


def test_communication_share_is_measured_for_every_ddp_variant(rows):
    for variant in DDP_VARIANTS:
        for rank in (0, 1):
            fraction = by(rows, variant, "comm_fraction", rank)["value"]
            assert fraction is not None and math.isfinite(fraction) and -1 < fraction < 1
    assert by(rows, "single", "comm_fraction")["value"] == 0


def test_sequences_per_forward_and_one_bucket_when_the_cap_holds_everything():
    shapes = {v: dp.piece_size(config(v)) for v in dp.VARIANTS}
    assert shapes["single"] == 2 * 2 * 2 and shapes["ddp"] == 2 * 2 and shapes["accumulate"] == 2
    assert dp.predicted_buckets(config(bucket_cap_mb=1000), dp.grad_shapes(config())) == 1


def test_only_float32_is_accepted():
    with pytest.raises(ConfigError, match="float32"):
        dp.validate(config(dtype="bf16"))

