"""Calibrated weight quantization (labkit.blocks.calibrated): GPTQ's error feedback, AWQ's and
SmoothQuant's folded scales, W8A8's matmul, and the weight_quant variants end to end."""
import dataclasses

import pytest
import torch

from conftest import FAST, by

from labkit.blocks import calibrated, quant
from labkit.blocks.model import build_model
from labkit.config import MODELS, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import weight_quant

SMALL = dataclasses.replace(MODELS["reference"], num_layers=2)
SIZES = {**FAST, "prompt_len": 4, "new_tokens": 4, "num_layers": 2, "device": "cpu",
         "calib_sequences": 2, "calib_len": 64}


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def correlated_inputs(m=512, k=128, seed=0):
    """(M, K) inputs with correlated channels and a few outliers: what makes calibration pay."""
    g = gen(seed)
    x = torch.randn(m, k, generator=g) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g))
    x[:, :4] *= 10  # outlier channels
    return x


def weight(n=48, k=128, seed=1):
    return torch.randn(n, k, generator=gen(seed)) * 0.02


def int4_error(w, values, x, group_size=64):
    return (x @ (w - quant.dequantize_int4(*values, group_size, torch.float32)).t()).norm().item()


def test_gptq_reconstruction_error_on_the_calibration_inputs_is_below_rtn():
    x, w = correlated_inputs(), weight()
    factor = calibrated.inverse_hessian_factor(2 * x.t() @ x / len(x))
    gptq = calibrated.gptq_int4(w, factor, 64, torch.bfloat16)
    rtn = quant.quantize_int4(w, 64, torch.bfloat16)
    assert int4_error(w, gptq, x) < 0.8 * int4_error(w, rtn, x)
    # without the error feedback (a diagonal factor: no column sees another's error) it is RTN
    plain = calibrated.gptq_int4(w, torch.diag(factor.diagonal()), 64, torch.bfloat16)
    assert int4_error(w, plain, x) == pytest.approx(int4_error(w, rtn, x), rel=1e-6)


def test_gptq_with_an_identity_hessian_is_rtn_exactly():
    w = weight(k=344)  # a shorter last group too
    factor = calibrated.inverse_hessian_factor(torch.eye(344))
    for a, b in zip(calibrated.gptq_int4(w, factor, 64, torch.bfloat16), quant.quantize_int4(w, 64, torch.bfloat16)):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_gptq_stores_rtns_format_and_both_kernel_layouts_agree():
    model = build_model(SMALL, seed=2)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 32), generator=gen())
    packed = calibrated.apply_calibrated(build_model(SMALL, seed=2), "gptq_int4", tokens)
    plain = calibrated.apply_calibrated(model, "gptq_int4", tokens, kernel="dequant")
    assert quant.kernel_paths(packed)["packed_layers"] > 0 and quant.kernel_paths(plain)["packed_layers"] == 0
    for name in quant.target_linears(plain):
        layer = plain.get_submodule(name)
        assert isinstance(layer, quant.Int4Linear)
        assert sum(t.numel() * t.element_size() for t in layer.stored()) == quant.weight_bytes(
            layer.out_features, layer.in_features, "int4", 64)
    with torch.inference_mode():
        torch.testing.assert_close(packed(tokens), plain(tokens), rtol=1e-4, atol=1e-4)


def test_awq_with_alpha_zero_is_rtn():
    w, x = weight(), correlated_inputs()
    stats = calibrated.Stats(x.t() @ x, x.abs().sum(0), x.abs().amax(0), len(x))
    s, alpha = calibrated.awq_scales([w], stats, 64, grid=1)  # the grid holds alpha = 0 alone
    assert alpha == 0.0 and torch.equal(s, torch.ones(128))
    assert torch.equal(calibrated.rtn_int4(w * s, 64) / s, calibrated.rtn_int4(w, 64))
    s, alpha = calibrated.awq_scales([w], stats, 64)
    assert alpha > 0 and calibrated.output_error([w], stats.hessian, s, 64) < \
        calibrated.output_error([w], stats.hessian, torch.ones(128), 64)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_folded_scales_leave_the_full_precision_output_unchanged(arch):
    cfg = dataclasses.replace(SMALL, arch=arch, num_heads=4, num_kv_heads=4)  # o folds into v too
    model = build_model(cfg, seed=3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=gen())
    with torch.inference_mode():
        before = model(tokens)
    folded = 0
    for prev, group in calibrated.scaling_groups(model):
        if prev is not None:
            k = model.get_submodule(group[0]).in_features
            calibrated.fold_scales(model, prev, group, torch.rand(k, generator=gen(k)) * 4 + 0.25)
            folded += 1
    assert folded == cfg.num_layers * (4 if arch == "llama" else 3)  # GPT-2: w2 behind a GELU
    with torch.inference_mode():
        torch.testing.assert_close(model(tokens), before, rtol=1e-4, atol=1e-4)


def test_smoothquant_scales_are_the_papers_and_output_preserving():
    w1, w2, x = weight(seed=1), weight(seed=2), correlated_inputs()
    stats = calibrated.Stats(x.t() @ x, x.abs().sum(0), x.abs().amax(0), len(x))
    s = calibrated.smooth_scales([w1, w2], stats)
    w_max = torch.cat([w1, w2]).abs().amax(0)
    torch.testing.assert_close(s, (x.abs().amax(0).sqrt() / w_max.sqrt()))  # a = 0.5
    for w in (w1, w2):  # (x / s) (w s)^T = x w^T before quantization
        torch.testing.assert_close((x / s) @ (w * s).t(), x @ w.t(), rtol=1e-5, atol=1e-5)
    # with outlier channels in x, W8A8 of the smoothed pair is closer to x w^T than without
    exact = x @ w1.t()
    plain = calibrated.W8A8Linear(w1, None, True)(x)
    smoothed = calibrated.W8A8Linear(w1 * s, None, True)(x / s)
    assert (smoothed - exact).norm() < 0.5 * (plain - exact).norm()


def test_w8a8_matmul_is_the_formula_on_both_paths():
    w, x = weight(n=96, k=256), torch.randn(5, 256, generator=gen(4))
    bias = torch.randn(96, generator=gen(5))
    qw, sw = quant.quantize_int8(w)
    sx = x.abs().amax(1) / 127
    qx = torch.round(x / sx[:, None]).clamp(-127, 127)
    expected = (qx.double() @ qw.double().t()) * sx.double()[:, None] * sw.double()[None, :] + bias.double()
    for packed in (True, False):
        layer = calibrated.W8A8Linear(w, bias, packed)
        torch.testing.assert_close(layer(x).double(), expected, rtol=1e-6, atol=1e-6)
        assert torch.equal(layer.weight_int8, qw)
    layer = calibrated.W8A8Linear(w, None, True)
    assert sum(t.numel() * t.element_size() for t in layer.stored()) == quant.weight_bytes(96, 256, "int8")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    variants = ["int8", "int4", "gptq_int4", "awq_int4", "w8a8", "smoothquant_w8a8"]
    return run_experiment("weight_quant", preset="tiny", overrides=SIZES, variants=variants, progress=False,
                          runs_dir=str(tmp_path_factory.mktemp("runs"))).rows


@pytest.mark.slow
def test_every_calibrated_variant_runs_checks_and_stores_rtns_bytes(rows):
    assert all(r["status"] in ("ok", "skipped") for r in rows)
    for variant, scheme in weight_quant.CALIBRATED.items():
        ok = [r for r in rows if r["variant"] == variant]
        assert ok and all(r["status"] == "ok" for r in ok if r["metric"] != "joules_per_token")
        stored = by(rows, variant, "weight_bytes")
        assert stored["value"] == stored["predicted"] == by(rows, "int8" if scheme == "int8" else "int4",
                                                            "weight_bytes")["value"]
        assert by(rows, variant, "logit_rel_error")["value"] <= weight_quant.LOGIT_TOLERANCE[variant]
        assert 0 < by(rows, variant, "calibration_s")["value"] < 60
        assert 0 <= by(rows, variant, "next_token_agreement")["value"] <= 1
    measured = {}
    for r in rows:
        if r["status"] == "ok":
            measured.setdefault(r["variant"], {})[r["metric"]] = r["value"]
    table = weight_quant.against_rtn(measured)
    assert [t["variant"] for t in table] == list(weight_quant.RTN_OF)
    assert all(t["weight_bytes"] == t["beside_weight_bytes"] for t in table)
    assert "seed" in by(rows, "gptq_int4", "calibration_s")["message"]


@pytest.mark.slow
def test_reference_goal_gptq_or_awq_at_most_half_of_rtns_perplexity_delta(tmp_path):
    """Issue 28's goal on the trained model, int4 group 64: ~15 s on one thread."""
    result = run_experiment("weight_quant", preset="reference",
                            overrides={"device": "cpu", "prompt_len": 4, "new_tokens": 4, "warmup": 0,
                                       "min_run_time_s": 0.0, "min_repeats": 1},
                            variants=["int4", "gptq_int4", "awq_int4"], progress=False, runs_dir=str(tmp_path))
    measured = {}
    for r in result.rows:
        if r["status"] == "ok":
            measured.setdefault(r["variant"], {})[r["metric"]] = r["value"]
    ratios = {t["variant"]: t["delta_ratio"] for t in weight_quant.against_rtn(measured)}
    assert measured["int4"]["perplexity_delta_pct"] > 0
    assert min(ratios["gptq_int4"], ratios["awq_int4"]) <= weight_quant.GOAL_DELTA_RATIO, ratios


def test_the_quiz_figures_are_labkits():
    from labkit.study.quiz import load_bank

    text = {q.id: q.question + q.explanation + " ".join(q.choices) for q in load_bank() if q.id.startswith("calib-")}
    assert sorted(text) == [f"calib-0{i}" for i in range(1, 5)]
    n = k = 4096
    assert f"{quant.weight_bytes(n, k, 'int4', 64):,}" in text["calib-01"]
    assert f"{n * k // 2:,}" in text["calib-01"] and f"{quant.weight_bytes(n, k, 'int4', 64) - n * k // 2:,}" in text["calib-01"]
    assert f"{quant.bits_per_weight(k, 'int4', 64)} bits per weight" in text["calib-01"]
    x = torch.zeros(1, 1) + 64.0
    stats = calibrated.Stats(x.t() @ x, x[0], x[0], 1)
    s = calibrated.smooth_scales([torch.full((1, 1), 0.25)], stats).item()
    assert calibrated.SMOOTH_ALPHA == 0.5 and f"s = {s:g}; {64 / s:g} and {0.25 * s:g}" in text["calib-04"]
