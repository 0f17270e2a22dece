import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import FAST, by

from labkit import hardware
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import fused_kernel

# 64 rows of 96 (not a power of two: the kernel's row is padded to 128 and masked)
SIZES = {**FAST, "rows": 64, "hidden_size": 96}


def run_python(code: str, **env: str) -> str:
    """`code` in a fresh interpreter (env set before anything is imported); its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env={**os.environ, **env}, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """One run with eager and compiled (compiled once: its cold start is the slow part here)."""
    return run_experiment("fused_kernel", preset="tiny", overrides={**SIZES, "device": "cpu"},
                          progress=False, runs_dir=str(tmp_path_factory.mktemp("runs"))).rows


KERNEL_CHECK = """
    import json, torch
    from labkit.blocks.kernels.rmsnorm import fused_add_rmsnorm
    from labkit.techniques.fused_kernel import add_rmsnorm
    from labkit.blocks.model import RMSNorm

    out = []
    for dtype in (torch.float32, torch.float16):
        for shape in ((3, 96), (5, 256), (4, 1000), (2, 3, 48)):
            g = torch.Generator().manual_seed(0)
            x, r = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
            norm = RMSNorm(shape[-1], 1e-5).requires_grad_(False)
            norm.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=g))
            norm = norm.to(dtype)
            y, h = fused_add_rmsnorm(x, r, norm.weight, norm.eps)
            y_ref, h_ref = add_rmsnorm(x, r, norm)
            out.append({"dtype": str(dtype), "shape": list(shape), "shape_ok": y.shape == x.shape,
                        "h_exact": torch.equal(h, h_ref),
                        "y_rel": ((y.float() - y_ref.float()).abs().max()
                                  / y_ref.float().abs().max()).item()})
    errors = []
    bad = [(torch.ones(2, 8), torch.ones(2, 9), torch.ones(8)),
           (torch.ones(2, 8), torch.ones(2, 8), torch.ones(9)),
           (torch.ones(2, 8), torch.ones(2, 8).half(), torch.ones(8))]
    for args in bad:
        try:
            fused_add_rmsnorm(*args, 1e-5)
        except ValueError as e:
            errors.append(str(e))
    print(json.dumps({"cases": out, "errors": errors}))
"""


@pytest.mark.slow
def test_triton_kernel_matches_eager_under_the_interpreter_in_fp32_and_fp16():
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    result = json.loads(run_python(KERNEL_CHECK, TRITON_INTERPRET="1"))
    assert len(result["cases"]) == 8
    for case in result["cases"]:
        assert case["shape_ok"] and case["h_exact"], case  # h is x + residual, rounded once
        tolerance = 1e-6 if case["dtype"] == "torch.float32" else 2e-3
        assert case["y_rel"] <= tolerance, case
    assert len(result["errors"]) == 3  # each bad input refused with a ValueError


@pytest.mark.slow  # a cold torch.compile build
def test_eager_and_compiled_run_on_the_cpu_and_triton_is_skipped_with_its_reason(rows):
    assert {r["status"] for r in rows if r["variant"] in ("eager", "compiled")} == {"ok"}
    assert by(rows, "compiled", "max_rel_error")["value"] <= fused_kernel.TOLERANCE["float32"]
    assert by(rows, "eager", "max_abs_error")["value"] == 0.0
    assert by(rows, "compiled", "compile_s")["value"] > 0
    triton = [r for r in rows if r["variant"] == "triton"]
    assert len(triton) == 1 and triton[0]["status"] == "skipped"
    assert "CUDA GPU" in triton[0]["message"] or "not installed" in triton[0]["message"]


@pytest.mark.slow  # the same cold build (the rows fixture)
def test_gbps_counts_the_fused_floor_the_tensors_hold(rows):
    moved = (4 * 64 * 96 + 96) * 4  # read x, residual, weight; write y, h (fp32)
    cfg = resolve(fused_kernel.Config, "tiny", {**SIZES, "device": "cpu"}, experiment="fused_kernel")
    assert fused_kernel.bytes_moved(cfg) == moved
    x, residual, norm = fused_kernel.make_inputs(cfg)
    y, h = fused_kernel.add_rmsnorm(x, residual, norm)
    assert sum(t.nbytes for t in (x, residual, norm.weight, y, h)) == moved  # what one call touches
    bandwidth = hardware.ceilings("cpu", num_threads=cfg.num_threads).bandwidth_gbps
    amounts = fused_kernel.build(cfg).per_second  # per step; the harness divides by its time
    assert amounts["gbps"] == moved / 1e9
    assert amounts["peak_bandwidth_pct"] == pytest.approx(100 * moved / (bandwidth * 1e9))
    for variant in ("eager", "compiled"):
        gbps = by(rows, variant, "gbps")
        assert gbps["predicted"] == bandwidth  # the ceiling
        assert by(rows, variant, "step_ms")["predicted"] == pytest.approx(1e3 * moved / (bandwidth * 1e9))
        # both rates over the same step time: their ratio is the ceiling's, whatever the time
        assert gbps["value"] / by(rows, variant, "peak_bandwidth_pct")["value"] == pytest.approx(bandwidth / 100)


def test_rows_zero_is_the_batch_and_bad_settings_are_refused():
    cfg = resolve(fused_kernel.Config, "tiny", {"device": "cpu"}, experiment="fused_kernel")
    assert fused_kernel.num_rows(cfg) == 4096  # the tiny preset's rows: past the CPU's caches
    cfg = resolve(fused_kernel.Config, "tiny", {"device": "cpu", "rows": 0}, experiment="fused_kernel")
    assert fused_kernel.num_rows(cfg) == cfg.batch_size * cfg.seq_len
    with pytest.raises(ConfigError, match="valid: up to 16384"):
        run_experiment("fused_kernel", overrides={"device": "cpu", "hidden_size": 32768,
                                                  "num_heads": 4, "num_kv_heads": 2})
    with pytest.raises(ConfigError, match="valid: eager, compiled, triton"):
        run_experiment("fused_kernel", variants=["fused"], overrides={"device": "cpu"})


@pytest.mark.slow
def test_labkit_runs_without_triton_and_says_why_the_kernel_is_skipped():
    out = run_python("""
        import sys
        sys.modules["triton"] = None  # as if not installed: `import triton` raises ImportError
        from labkit.harness.experiment import run_experiment
        rows = run_experiment("fused_kernel", variants=["triton"], progress=False,
                              overrides={"device": "cpu", "rows": 8, "hidden_size": 32,
                                         "min_run_time_s": 0.0, "min_repeats": 1}).rows
        print({r["variant"]: (r["status"], r["message"]) for r in rows if r["variant"] == "triton"})
    """)
    assert "skipped" in out and "not installed" in out
