import dataclasses

import pytest
import torch

from conftest import FAST

from labkit import hardware
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import matmul

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

SIZES = {**FAST, "size": 128}


def by(rows, variant, metric, alignment="aligned"):
    hits = [r for r in rows if r["variant"] == variant and r["metric"] == metric
            and r["params"]["alignment"] == alignment]
    assert len(hits) == 1, (variant, metric, hits)
    return hits[0]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return run_experiment("matmul", preset="tiny", overrides={**SIZES, "device": "cpu"},
                          sweep={"alignment": ["aligned", "off_by_one"]}, progress=False,
                          runs_dir=str(tmp_path_factory.mktemp("runs"))).rows


def _cfg(**kw):
    return resolve(matmul.Config, "tiny", {**SIZES, "device": "cpu", **kw}, experiment="matmul")


def test_flops_and_operand_bytes_follow_the_shape_and_dtype(rows):
    for alignment, d in (("aligned", 128), ("off_by_one", 127)):
        for variant, itemsize in (("fp32", 4), ("fp16", 2), ("bf16", 2)):
            flops = by(rows, variant, "flops", alignment)
            assert flops["value"] == flops["predicted"] == 2 * d**3
            operands = by(rows, variant, "input_bytes", alignment)
            assert operands["value"] == operands["predicted"] == 2 * d * d * itemsize


def test_every_dtype_matches_fp32_within_its_tolerance(rows):
    assert by(rows, "fp32", "rel_error")["value"] == 0.0
    for variant in ("fp16", "bf16"):
        error = by(rows, variant, "rel_error")["value"]
        assert 0 < error <= matmul.TOLERANCE[variant]
    assert by(rows, "bf16", "rel_error")["value"] > by(rows, "fp16", "rel_error")["value"]  # 8 vs 11 bits


def test_min_bytes_are_the_operands_and_output_the_step_touches():
    for variant in ("fp32", "bf16"):
        for alignment in ("aligned", "off_by_one"):
            cfg = _cfg(variant=variant, alignment=alignment)
            wl = matmul.build(cfg)
            operands = wl.tensors["input_bytes"]()
            out = wl.step()
            touched = sum(t.untyped_storage().nbytes() for t in (*operands, out))
            assert touched == matmul.min_bytes(cfg), (variant, alignment)


def test_no_measured_rate_is_above_the_ceiling(rows):
    """peak_flops_pct is the measured rate over the physical ceiling: over 100 means a wrong ceiling."""
    for variant in ("fp32", "fp16", "bf16"):
        for alignment in ("aligned", "off_by_one"):
            pct = by(rows, variant, "peak_flops_pct", alignment)["value"]
            assert 0 < pct <= 100, (variant, alignment, pct)


def _fake_ceilings(monkeypatch, peak_tflops, bandwidth_gbps):
    fake = hardware.Ceilings("cpu", "test cpu", {"float32": peak_tflops}, bandwidth_gbps, None,
                             "test", measured=False)
    monkeypatch.setattr(hardware, "ceilings", lambda *a, **k: fake)


@pytest.mark.parametrize("peak_tflops, bandwidth_gbps, bound_ms", [
    (1.0, 100.0, 2 * 128**3 / 1e12 * 1e3),  # compute-bound: 4.19 us of FLOPs vs 1.97 us of bytes
    (1.0, 10.0, 3 * 128 * 128 * 4 / 10e9 * 1e3),  # memory-bound: 19.7 us of bytes
    (1.0, None, 2 * 128**3 / 1e12 * 1e3),  # unknown bandwidth: the FLOPs alone
])
def test_predicted_step_is_the_roofline_bound(monkeypatch, peak_tflops, bandwidth_gbps, bound_ms):
    _fake_ceilings(monkeypatch, peak_tflops, bandwidth_gbps)
    predicted = matmul.expected(_cfg(variant="fp32"))
    assert predicted["step_ms"] == pytest.approx(bound_ms, rel=1e-12)
    assert predicted["tflops"] <= peak_tflops * (1 + 1e-12)


def test_tf32_and_fp8_are_skipped_on_the_cpu_with_the_reason(rows):
    for variant, needs in (("tf32", "8.0"), ("fp8", "8.9")):
        skipped = [r for r in rows if r["variant"] == variant]
        assert {r["status"] for r in skipped} == {"skipped"}
        assert needs in skipped[0]["message"] and "CPU" in skipped[0]["message"]


def test_skip_reasons_follow_the_compute_capability_and_fp8_needs_multiples_of_16(monkeypatch):
    cfg = dataclasses.replace(_cfg(), device="cuda")
    for cc, tf32, fp8 in (((7, 5), True, True), ((8, 0), False, True), ((9, 0), False, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=cc: cc)
        assert bool(matmul.skip_reason(dataclasses.replace(cfg, variant="tf32"))) == tf32
        assert bool(matmul.skip_reason(dataclasses.replace(cfg, variant="fp8"))) == fp8
    for alignment in ("mult8", "off_by_one"):
        reason = matmul.skip_reason(dataclasses.replace(cfg, variant="fp8", alignment=alignment))
        assert "multiple of 16" in reason


def test_alignment_takes_one_or_eight_off_each_dimension():
    assert matmul.dims(_cfg(m=256, n=384, k=128)) == (256, 384, 128)
    assert matmul.dims(_cfg(m=256, n=384, k=128, alignment="mult8")) == (248, 376, 120)
    assert matmul.dims(_cfg(alignment="off_by_one")) == (127, 127, 127)


def test_fp8_scaling_keeps_the_product_within_tolerance():
    """The fp8 recipe itself (per-tensor scales, B column-major), run by torch's CPU _scaled_mm."""
    a, b = matmul.make_inputs(_cfg())
    a8, b8, scale_a, scale_b = matmul.fp8_operands(a, b)
    assert a8.dtype == torch.float8_e4m3fn and a8.element_size() == 1 and b8.stride() == (1, 128)
    assert a8.float().abs().max().item() == matmul.FP8_MAX  # the largest value maps onto 448
    error = matmul.rel_error(a @ b, matmul.fp8_matmul(a8, b8, scale_a, scale_b))
    assert 0.01 < error <= matmul.TOLERANCE["fp8"]


def test_a_result_past_the_tolerance_is_an_error(monkeypatch):
    monkeypatch.setitem(matmul.TOLERANCE, "bf16", 0.0)
    rows = run_experiment("matmul", preset="tiny", variants=["bf16"], progress=False,
                          overrides={**SIZES, "device": "cpu"}).rows
    bf16 = [r for r in rows if r["variant"] == "bf16"]
    assert {r["status"] for r in bf16} == {"error"} and "tolerance" in bf16[0]["message"]


def test_bad_settings_are_refused_naming_the_valid_choices():
    with pytest.raises(ConfigError, match="multiple of 128"):
        matmul.validate(_cfg(size=100))
    with pytest.raises(ConfigError, match="valid: aligned, mult8, off_by_one"):
        _cfg(alignment="odd")
    with pytest.raises(ConfigError, match="dtype must be float32"):
        run_experiment("matmul", overrides={**SIZES, "device": "cpu", "dtype": "bf16"})
