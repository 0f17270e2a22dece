"""Compressed gradients on two gloo ranks: bytes sent against the formula, each format's gradient
and loss within its bound of fp32's, and a broken int8 hook caught.

One launch serves every test that reads rows: every variant, then int8 alone (beside its fp32
reference) with each bug of `compression.INT8_FAULTS` put in."""
import math

import numpy as np
import pytest
import torch

from conftest import TINY_DIST
from conftest import one_row as get
from labkit import planner
from labkit.blocks import compression
from labkit.blocks.model import build_model
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.planner import compression as formulas
from labkit.techniques import grad_compression as gc

pytestmark = pytest.mark.multiprocess  # this module starts ranks

RANKS = (0, 1)
OVERRIDES = {**TINY_DIST, "device": "cpu", "nproc": 2, "steps": 2, "timed_steps": 1, "vocab_size": 512,
             "hidden_size": 128, "ffn_size": 256, "num_layers": 1}
DDP = ("fp32", "bf16", "fp16", "int8", "powersgd")


def config(variant="fp32", **overrides):
    return resolve(gc.Config, "tiny", {**OVERRIDES, "variant": variant, **overrides},
                   experiment="grad_compression")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return run_experiment("grad_compression", preset="tiny", overrides=OVERRIDES,
                          sweep={"int8_fault": list(compression.INT8_FAULTS)},
                          runs_dir=str(tmp_path_factory.mktemp("runs")), progress=False).rows


@pytest.fixture(scope="module")
def rows(run):
    return [r for r in run if r["params"]["int8_fault"] == "none"]



def value(rows, variant, metric, rank=0):
    return get(rows, variant, metric, rank)["value"]


def test_every_variant_passes_its_check_on_every_rank(rows):
    for rank in RANKS:
        for v in gc.VARIANTS:
            mine = [r for r in rows if r["variant"] == v and r["rank"] == rank]
            assert mine and {r["status"] for r in mine} == {"ok"}, (v, mine[0]["message"])


def test_bytes_and_collectives_equal_the_formula(rows):
    # CommCounter's count of one step's collectives (PowerSGD's P and Q added from its state)
    # against planner.compression, exactly: Ψ elements at the format's bytes, int8's scales,
    # PowerSGD's (n + m) r, the ring's share.
    for rank in RANKS:
        for v in gc.VARIANTS:
            for metric in ("grad_comm_bytes", "grad_bus_bytes", "comm_bytes", "comm_bus_bytes",
                           "all_reduce_count", "reduce_scatter_count", "all_gather_count"):
                row = get(rows, v, metric, rank)
                assert row["value"] == pytest.approx(row["predicted"], rel=1e-12), (v, metric)
        for v in DDP[1:]:
            row = get(rows, v, "num_buckets", rank)
            assert row["value"] == row["predicted"], v


def test_compression_ratios_against_fp32(rows):
    psi = planner.num_params(config().model)
    buckets = value(rows, "int8", "num_buckets")
    assert value(rows, "fp32", "grad_comm_bytes") == 4 * psi
    for v in ("bf16", "fp16", "fsdp2_bf16_reduce"):
        assert value(rows, v, "compression_ratio") == 2.0
    assert value(rows, "fsdp2_fp32_reduce", "compression_ratio") == 1.0
    # int8: 4x less the scales' share, one fp32 per bucket: 4Ψ / (Ψ + 4B)
    assert value(rows, "int8", "compression_ratio") == 4 * psi / (psi + 4 * buckets)
    assert 3.99 < value(rows, "int8", "compression_ratio") < 4
    assert value(rows, "powersgd", "compression_ratio") > 50


def test_gradients_within_each_formats_bound(rows):
    for rank in RANKS:
        for v in ("fsdp2_fp32_reduce",):  # fp32 sums: bitwise on two ranks
            assert value(rows, v, "grad_rel_diff", rank) == 0.0
        for v in ("bf16", "fp16", "int8", "fsdp2_bf16_reduce", "powersgd"):
            rel, tol = value(rows, v, "grad_rel_diff", rank), value(rows, v, "grad_tolerance", rank)
            assert 0 < rel <= tol, v  # lossy: a delta, within its bound
        # fp16 keeps 3 more significand bits than bf16; int8 (63 levels a rank) fewer than both
        assert value(rows, "fp16", "grad_rel_diff") < value(rows, "bf16", "grad_rel_diff") \
            < value(rows, "int8", "grad_rel_diff")
        assert value(rows, "powersgd", "projection_residual", rank) <= gc.PROJECTION_TOLERANCE
        for v in DDP:
            assert value(rows, v, "replica_spread", rank) == 0.0  # every rank the same gradient


def test_loss_after_the_steps_within_tolerance(rows):
    for v in gc.VARIANTS:
        row = get(rows, v, "loss_delta")
        assert abs(row["value"]) <= value(rows, v, "loss_tolerance"), v
    assert value(rows, "fsdp2_fp32_reduce", "loss_delta") == 0.0


def test_a_broken_int8_hook_fails_the_check(run):
    # no_average: every rank agrees on a gradient N times too large (AdamW would barely notice:
    # the gradient check catches it); own_scale: each rank dequantizes with its own scale, and
    # the ranks' gradients, hence their weights, drift apart.
    want = {"no_average": "gradient", "own_scale": "ranks' gradients"}
    for fault, what in want.items():
        mine = [r for r in run if r["params"]["int8_fault"] == fault]
        assert {r["status"] for r in mine if r["variant"] == "fp32"} == {"ok"}
        skipped = {r["variant"] for r in mine if r["status"] == "skipped"}
        assert skipped == set(gc.VARIANTS) - {"fp32", "int8"}
        int8 = [r for r in mine if r["variant"] == "int8"]
        assert int8 and {r["status"] for r in int8} == {"error"}, fault
        # only the failing checks are named
        assert int8[0]["message"] == f"does not match fp32: {what}" or \
            int8[0]["message"].startswith(f"does not match fp32: {what} "), int8[0]["message"]
        assert int8[0]["message"].count("(<=") == 1, int8[0]["message"]
    assert value([r for r in run if r["params"]["int8_fault"] == "no_average"], "int8",
                 "grad_rel_diff") == pytest.approx(1.0, abs=0.1)  # the sum of 2: twice the mean
    assert value([r for r in run if r["params"]["int8_fault"] == "own_scale"], "int8",
                 "replica_spread") > 0


# --- no ranks ----------------------------------------------------------------------------------------

def test_int8_headroom_keeps_the_sum_of_n_ranks_in_range():
    assert [formulas.int8_levels(n) for n in (1, 2, 4, 8, 127)] == [127, 63, 31, 15, 1]
    with pytest.raises(ConfigError, match="overflows"):
        formulas.int8_levels(128)
    grads = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    absmax = grads.abs().max().reshape(1)
    qs = [compression.quantize(g, absmax, formulas.int8_levels(4))[0] for g in grads]
    assert max(int(q.abs().max()) for q in qs) == 31
    total = torch.stack([q.long() for q in qs]).sum(0)
    assert int(total.abs().max()) <= 127  # what an int8 all-reduce of 4 ranks holds


def test_quantization_error_at_most_half_a_step():
    g = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    q, scale = compression.quantize(g, g.abs().max().reshape(1), 63)
    err = (q.float() * scale - g).abs().max()
    assert err <= scale / 2 * (1 + 1e-6)


def test_powersgd_elements_by_hand():
    # (256, 256) at r=1: 512; (4096, 256): 4352; (256,) vectors and (688, 256) at r=4: 3776 < 176128/2
    got = formulas.powersgd_numel([(256, 256), (4096, 256), (256,), (688, 256)], 1)
    assert got == {"uncompressed": 256, "p": 256 + 4096 + 688, "q": 256 + 256 + 256}
    # compressed only where (n + m) r * 2 < n m: a (4, 4) at r = 1 sends 8, 8 * 2 = 16: as it is
    assert formulas.powersgd_numel([(4, 4)], 1) == {"uncompressed": 16, "p": 0, "q": 0}
    assert formulas.powersgd_bytes([(256, 256)], 2) == 4 * 1024


def test_ddp_buckets_close_at_the_cap():
    assert formulas.ddp_buckets([10, 20, 30, 40], cap_bytes=4 * 50) == [70, 30]
    assert formulas.ddp_buckets([10, 20], cap_bytes=4 * 1000) == [30]


def test_bus_bytes_and_rounding_bound():
    assert formulas.bus_bytes(100, 4) == 150 and formulas.bus_bytes(100, 4, "reduce_scatter") == 75
    assert formulas.rounding_tolerance("bf16", 2) == 3 * 2**-8
    assert formulas.grad_reduce_bytes(1000, "int8", num_buckets=3) == 1012


def test_expected_bytes_follow_the_format():
    psi = planner.num_params(config().model)
    shapes = [tuple(p.shape) for p in build_model(config().model, device="meta").parameters()]
    assert sum(math.prod(s) for s in shapes) == psi
    assert gc.expected(config("bf16"))["grad_comm_bytes"] == 2 * psi
    assert gc.expected(config("fsdp2_bf16_reduce"))["grad_bus_bytes"] == psi  # (2-1)/2 of 2Ψ
    assert gc.expected(config("powersgd"))["grad_comm_bytes"] == formulas.powersgd_bytes(shapes, 1)
    int8 = gc.expected(config("int8"))
    assert int8["grad_comm_bytes"] == psi + 4 * int8["num_buckets"]


def test_training_is_fp32_and_faults_run_int8_only():
    with pytest.raises(ConfigError, match="float32"):
        gc.validate(config(dtype="bfloat16"))
    assert gc.skip_reason(config("bf16", int8_fault="no_average")).startswith("int8_fault=")
    assert gc.skip_reason(config("int8", int8_fault="no_average")) is None
    assert np.isfinite(gc.expected(config("int8"))["compression_ratio"])
