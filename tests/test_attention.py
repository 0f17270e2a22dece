import dataclasses

import pytest
import torch

from conftest import FAST

from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import attention

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

# head_dim 16 (64 / 4 heads), 2 kv heads (GQA): the S x S term dominates at these lengths. On the
# CPU: which backends run and what they save is the CPU's (tests/test_cuda_paths.py has CUDA's).
SIZES = {**FAST, "batch_size": 2, "seq_len": 64, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2,
         "device": "cpu"}
RUNS = ["naive", "sdpa", "math", "flash"]


def by(rows, variant, metric, seq_len=None):
    hits = [r for r in rows if r["variant"] == variant and r["metric"] == metric
            and (seq_len is None or r["params"]["seq_len"] == seq_len)]
    assert len(hits) == 1, (variant, metric, hits)
    return hits[0]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return run_experiment("attention", preset="tiny", overrides=SIZES, sweep={"seq_len": [64, 128]},
                          progress=False, runs_dir=str(tmp_path_factory.mktemp("runs"))).rows


def _cfg(**kw):
    return resolve(attention.Config, "tiny", {**SIZES, **kw}, experiment="attention")


def test_every_variant_that_runs_matches_naive_output_and_gradients(rows):
    for variant in RUNS:
        assert {r["status"] for r in rows if r["variant"] == variant} == {"ok"}
        for metric in ("out_max_rel_diff", "grad_max_rel_diff"):
            assert by(rows, variant, metric, 128)["value"] <= attention.TOLERANCE["float32"]
        assert by(rows, variant, "fwd_ms", 64)["value"] > 0


def test_saved_bytes_are_quadratic_for_naive_and_linear_for_fused(rows):
    saved = {(v, s): by(rows, v, "activation_bytes", s)
             for v in ("naive", "sdpa", "flash") for s in (64, 128)}
    for row in saved.values():
        assert row["value"] == row["predicted"]  # measured from storage, equal to the formula
    b, h, kv, d = 2, 4, 2, 16
    for s in (64, 128):
        assert saved["naive", s]["value"] == 4 * (3 * b * h * s * d + b * h * s * s)
        assert saved["flash", s]["value"] == 4 * ((2 * h + 2 * kv) * b * s * d + b * h * s)
    assert saved["sdpa", 128]["value"] == 2 * saved["sdpa", 64]["value"]  # linear: doubles
    assert saved["naive", 128]["value"] > 3 * saved["naive", 64]["value"]  # quadratic term rules
    ratio = {s: saved["naive", s]["value"] / saved["sdpa", s]["value"] for s in (64, 128)}
    assert ratio[128] > 1.5 * ratio[64]  # the gap grows with seq_len
    assert by(rows, "math", "activation_bytes", 128)["value"] > saved["naive", 128]["value"] / 2


def test_flops_counted_equal_the_formula(rows):
    b, h, d = 2, 4, 16
    for s in (64, 128):
        unit = b * h * s * s * d
        for variant, total in (("naive", 12), ("math", 12), ("sdpa", 14), ("flash", 14)):
            row = by(rows, variant, "flops", s)
            assert row["value"] == row["predicted"] == total * unit


def test_gpu_only_backends_and_flex_are_skipped_on_this_cpu_with_reasons(rows):
    for variant in ("efficient", "cudnn"):
        skipped = [r for r in rows if r["variant"] == variant]
        assert [r["status"] for r in skipped] == ["skipped"] * 2 and "CPU" in skipped[0]["message"]
    flex = [r for r in rows if r["variant"] == "flex_sliding"]
    assert {r["status"] for r in flex} == {"skipped"} and "window > 0" in flex[0]["message"]
    windowed = dataclasses.replace(_cfg(window=16), variant="flex_sliding")
    assert "backward on CPU" in attention.skip_reason(windowed)


def test_a_sliding_window_is_applied_by_every_variant_alike():
    rows = run_experiment("attention", preset="tiny", variants=["sdpa", "flash"],
                          overrides={**SIZES, "window": 16}, progress=False).rows
    assert {r["status"] for r in rows} == {"ok"}
    assert by(rows, "sdpa", "out_max_rel_diff")["value"] <= attention.TOLERANCE["float32"]
    allowed = attention.allowed_keys(6, 2, "cpu")
    assert allowed.sum(dim=1).tolist() == [1, 2, 2, 2, 2, 2] and not allowed.triu(1).any()
    # the window really changes the answer: it is not full causal attention
    q, k, v, _ = attention.make_inputs(_cfg())
    full = attention.sdpa_attention(q, k, v, None)
    assert not torch.allclose(full, attention.sdpa_attention(q, k, v, attention.allowed_keys(64, 16, "cpu")))


def test_long_sequences_are_allowed_and_bad_values_refused():
    assert _cfg(seq_len=4096).seq_len == 4096  # beyond the tiny preset's 2048 context
    with pytest.raises(ConfigError, match="window=64 must be shorter than seq_len=64"):
        attention.validate(_cfg(window=64))
    with pytest.raises(ConfigError, match="valid: naive, sdpa"):
        run_experiment("attention", variants=["flashy"], overrides=SIZES)
    with pytest.raises(ConfigError, match="window=-1 is out of range"):
        _cfg(window=-1)


def test_a_variant_that_differs_from_naive_is_an_error(monkeypatch):
    monkeypatch.setitem(attention.TOLERANCE, "float32", 0.0)
    rows = run_experiment("attention", preset="tiny", variants=["flash"], overrides=SIZES,
                          progress=False).rows
    flash = [r for r in rows if r["variant"] == "flash"]
    assert {r["status"] for r in flash} == {"error"} and "differs from naive" in flash[0]["message"]


def test_saved_tensor_hooks_count_what_the_fused_formula_predicts():
    """The measure flex_sliding reports (its higher-order op escapes the harness's meters)."""
    cfg = dataclasses.replace(_cfg(), variant="sdpa")
    q, k, v, _ = attention.make_inputs(cfg)
    saved = attention.saved_for_backward_bytes(
        lambda: attention.sdpa_attention(q.clone(), k.clone(), v.clone(), None).grad_fn)
    assert saved == attention.saved_bytes(cfg)


def test_bf16_matches_naive_within_its_tolerance():
    rows = run_experiment("attention", preset="tiny", variants=["flash"], progress=False,
                          overrides={**SIZES, "seq_len": 32, "dtype": "bfloat16"}).rows
    assert {r["status"] for r in rows} == {"ok"}
    assert 0 < by(rows, "flash", "grad_max_rel_diff")["value"] <= attention.TOLERANCE["bfloat16"]
