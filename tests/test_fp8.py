"""FP8 training numerics: exactly representable values survive the round trip, the scale maps
amax onto the format's largest value, rowwise scales beat one per tensor when a row is an
outlier, the emulated float8 linear computes on dequantized operands (e5m2 for the output
gradient in the tensorwise recipe) and equals torchao's own emulation bit for bit; the planner's
bytes; the experiment end to end; the GPU path skipped here with its reason; the quiz's and the
notebook's figures from labkit's own computation."""
import dataclasses
import math
import re
from pathlib import Path

import pytest
import torch

from conftest import needs

from labkit.blocks import fp8
from labkit.config import MODELS, ConfigError, resolve
from labkit.planner import float8 as fp8_plan
from labkit.techniques import fp8 as exp

ROOT = Path(__file__).resolve().parents[1]
FAST = {"min_run_time_s": 0.0, "warmup": 0}
SMALL = {**FAST, "num_layers": 2, "seq_len": 32, "device": "cpu"}
HAS_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def every_value(fmt):
    """Every finite value of the format, from its 256 codes."""
    values = torch.arange(256, dtype=torch.uint8).view(fp8.FORMATS[fmt]).float()
    return values[torch.isfinite(values)]


# --- the formats and the round trip --------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(fp8.FORMATS))
def test_the_formats_constants_are_torchs(fmt):
    dtype = fp8.FORMATS[fmt]
    values = every_value(fmt)
    assert fp8.max_value(fmt) == values.max() == torch.finfo(dtype).max
    assert fp8.smallest_subnormal(fmt) == values[values > 0].min()
    assert fp8.rounding_bound(fmt) == 2.0 ** -(1 + {"e4m3": 3, "e5m2": 2}[fmt])
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    assert torch.equal(fp8.to_fp32(codes).nan_to_num(7.0), codes.float().nan_to_num(7.0))  # the table is torch's cast


@pytest.mark.parametrize("fmt", list(fp8.FORMATS))
def test_exactly_representable_values_round_trip_exactly(fmt):
    x = every_value(fmt)  # amax = max: the scale is 1
    assert fp8.quantize(x, fmt).scale == 1.0
    assert torch.equal(fp8.round_trip(x, fmt), x)
    # times a power of two, with a power-of-two scale per row: still exact
    rows = torch.stack([x * 2.0 ** -5, x * 2.0 ** 3])
    assert torch.equal(fp8.round_trip(rows, fmt, -1, power_of_2=True), rows)
    stats = fp8.round_trip_stats(rows, fmt, -1, power_of_2=True)
    assert stats["rel_error"] == stats["max_rel_error"] == stats["underflow_fraction"] == 0.0


@pytest.mark.parametrize("fmt", list(fp8.FORMATS))
def test_the_scale_maps_amax_to_the_formats_largest_value(fmt):
    x = torch.randn(6, 40) * torch.logspace(-3, 2, 6)[:, None]
    q = fp8.quantize(x, fmt)
    assert q.scale == pytest.approx(fp8.max_value(fmt) / x.abs().max().item(), rel=1e-7)
    assert q.data.float().abs().max() == fp8.max_value(fmt)
    rows = fp8.quantize(x, fmt, -1)  # one scale per row: every row's amax lands on max
    assert rows.scale.shape == (6, 1)
    assert torch.equal(rows.data.float().abs().amax(dim=-1), torch.full((6,), fp8.max_value(fmt)))
    # a power-of-two scale is rounded down: the amax lands in (max / 2, max] before rounding, never past it
    pow2 = fp8.quantize(x, fmt, -1, power_of_2=True)
    assert torch.equal(torch.exp2(torch.log2(pow2.scale).round()), pow2.scale)
    top = pow2.data.float().abs().amax(dim=-1)
    assert (top <= fp8.max_value(fmt)).all() and (top >= fp8.max_value(fmt) / 2).all()  # rounded: [max/2, max]


@pytest.mark.parametrize("fmt", list(fp8.FORMATS))
def test_rounding_stays_within_half_an_ulp_and_its_rms_is_predicted(fmt):
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))
    stats = fp8.round_trip_stats(x, fmt)
    u = fp8.rounding_bound(fmt)
    assert stats["max_rel_error"] <= u / (1 + u) * (1 + 1e-6) and stats["max_rel_error"] > 0.9 * u / (1 + u)
    assert stats["rel_error"] == pytest.approx(fp8.rms_rounding_error(fmt), rel=0.15)
    assert stats["saturated_fraction"] == 0.0  # dynamic scaling: amax is the largest value


def test_a_stale_scale_saturates_and_a_small_value_underflows():
    x = torch.tensor([1.0, -0.5, 0.25, 1e-6])
    too_big = fp8.round_trip_stats(x, "e4m3", scale=torch.tensor(4 * 448.0))  # amax 4x too small
    assert too_big["saturated_fraction"] == pytest.approx(0.5)  # 1.0 and -0.5 clip at +-448
    assert fp8.quantize(x, "e4m3").data[3] == 0  # 1e-6 x 448 < 2^-10: below half the smallest subnormal
    assert fp8.round_trip_stats(x, "e4m3")["underflow_fraction"] == pytest.approx(0.25)
    assert fp8.round_trip_stats(x, "e5m2")["underflow_fraction"] == 0.0  # e5m2 reaches 2^-16


def test_rowwise_beats_tensorwise_on_a_tensor_with_an_outlier_row():
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(1))
    x[3] *= 1e4  # one outlier token
    ordinary = torch.ones(16, dtype=torch.bool)
    ordinary[3] = False
    errors = {}
    for gran in fp8.GRANULARITIES:
        back = fp8.round_trip(x, "e4m3", fp8.row_dim(gran), power_of_2=gran == "rowwise")
        errors[gran] = ((back - x).norm(dim=-1) / x.norm(dim=-1))[ordinary]
    # one scale for all pushes the ordinary rows 1e4 down, towards the subnormals; rowwise keeps
    # each row as if alone
    assert (errors["rowwise"] <= errors["tensorwise"]).all()
    assert errors["tensorwise"].mean() > 1.3 * errors["rowwise"].mean()
    under = {gran: fp8.round_trip_stats(x[ordinary], "e4m3", scale=fp8.quantize(x, "e4m3", fp8.row_dim(gran),
                                                                                   power_of_2=gran == "rowwise").scale[ordinary]
                                        if gran == "rowwise" else fp8.quantize(x, "e4m3").scale)["underflow_fraction"]
             for gran in fp8.GRANULARITIES}
    assert under["tensorwise"] > 0 and under["rowwise"] == 0
    alone = fp8.round_trip(x[ordinary], "e4m3", -1, power_of_2=True)
    assert torch.equal(fp8.round_trip(x, "e4m3", -1, power_of_2=True)[ordinary], alone)


# --- the emulated float8 linear ------------------------------------------------------------------

def test_the_emulated_forward_is_the_matmul_of_the_dequantized_operands():
    gen = torch.Generator().manual_seed(2)
    linear = torch.nn.Linear(32, 16, bias=True)
    x = torch.randn(2, 5, 32, generator=gen)
    for name, recipe in fp8.RECIPES.items():
        dim = fp8.row_dim(recipe.granularity)
        xq = fp8.quantize(x.reshape(-1, 32), "e4m3", dim, power_of_2=recipe.power_of_2).dequantize()
        wq = fp8.quantize(linear.weight, "e4m3", dim, power_of_2=recipe.power_of_2).dequantize()
        hand = (xq @ wq.T).reshape(2, 5, 16) + linear.bias
        got = fp8.EmulatedFloat8Linear(linear, recipe)(x)
        assert torch.equal(got, hand), name
        assert not torch.equal(got, linear(x))  # it did round


@pytest.mark.slow  # the process's first backward: 0.7 s of autograd's start-up
def test_the_backward_casts_the_output_gradient_to_e5m2_in_tensorwise_and_e4m3_in_rowwise():
    # W = I: the input's gradient is the output gradient as the cast left it. 0.3 of an amax of
    # 1.0: e5m2 (steps of 2^-2 in [16384, 32768) after x 57344) gives 16384 / 57344 = 0.2857;
    # e4m3 (x 448 = 134.4, steps of 8) gives 136 / 448 = 0.3036; rowwise's power-of-two scale 256
    # (x 256 = 76.8, steps of 8) gives 80 / 256 = 0.3125.
    linear = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(2))
    g = torch.tensor([[1.0, 0.3]])
    expect = {"tensorwise": 16384 / 57344, "rowwise": 80 / 256}
    for name, recipe in fp8.RECIPES.items():
        x = torch.ones(1, 2, requires_grad=True)
        fp8.EmulatedFloat8Linear(linear, recipe)(x).backward(g)
        assert x.grad[0, 1].item() == pytest.approx(expect[name], rel=1e-6), name
        assert x.grad[0, 1].item() != pytest.approx(136 / 448, rel=1e-3)  # what e4m3 tensorwise gives
    assert fp8.RECIPES["tensorwise"].formats["grad_output"] == "e5m2"


@pytest.mark.slow
@needs("torchao")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_emulation_equals_torchaos_float8_linear_in_emulate_mode_bit_for_bit(dtype):
    import copy

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    gen = torch.Generator().manual_seed(3)
    for recipe in fp8.RECIPES:
        mine = torch.nn.Linear(64, 48, bias=False).to(dtype)
        theirs = torch.nn.Sequential(copy.deepcopy(mine))
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        convert_to_float8_training(theirs, config=config)
        x = torch.randn(2, 8, 64, generator=gen).to(dtype)
        x[0, 3] *= 50  # an outlier row, so that rowwise and tensorwise differ
        g = torch.randn(2, 8, 48, generator=gen).to(dtype)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = theirs(xa), fp8.EmulatedFloat8Linear(mine, fp8.RECIPES[recipe])(xb)
        ya.backward(g)
        yb.backward(g)
        assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad), recipe
        assert torch.equal(theirs[0].weight.grad, mine.weight.grad), recipe


def test_apply_float8_converts_the_block_linears_that_fp8_matmuls_take():
    from labkit.blocks.model import build_model

    ref = MODELS["reference"]  # ffn 344: the MLP's linears are not multiples of 16
    model = build_model(ref, seed=0)
    names = fp8.apply_float8(model, "rowwise")
    assert len(names) == len(fp8_plan.float8_shapes(ref)) == 4 * ref.num_layers  # q, k, v, o
    assert all(isinstance(model.get_submodule(n), fp8.EmulatedFloat8Linear) for n in names)
    assert isinstance(model.lm_head, torch.nn.Linear)  # the head stays
    one_layer = dataclasses.replace(MODELS["tiny"], num_layers=1)
    assert len(fp8.apply_float8(build_model(one_layer, seed=0), "tensorwise")) == 7 == len(fp8_plan.float8_shapes(one_layer))


def test_the_planner_counts_the_fp8_copies_bytes():
    m = dataclasses.replace(MODELS["tiny"], num_layers=1)
    shapes = fp8_plan.float8_shapes(m)
    weights = [torch.zeros(n, k) for n, k in shapes]
    inputs = [torch.randn(24, k) for _, k in shapes]
    for gran, recipe in (("tensorwise", fp8.RECIPES["tensorwise"]), ("rowwise", fp8.RECIPES["rowwise"])):
        measured = [fp8.cast_bytes(w, x, recipe) for w, x in zip(weights, inputs)]
        planned = fp8_plan.float8_cast_bytes(m, tokens=24, granularity=gran)
        assert sum(c["weight"] for c in measured) == planned["weight"]
        assert sum(c["input"] for c in measured) == planned["input"]
    share = fp8_plan.float8_flop_share(m, batch=2, seq_len=32)
    assert 0 < share < 1
    assert fp8_plan.float8_speedup_bound(m, batch=2, seq_len=32, rate_ratio=2.0) == pytest.approx(1 / (1 - share / 2))


# --- the experiment ------------------------------------------------------------------------------

@pytest.mark.slow
def test_the_experiment_runs_end_to_end_and_each_variant_passes_its_check(tmp_path):
    from labkit.harness.experiment import run_experiment

    frame = run_experiment("fp8", preset="tiny", overrides=SMALL, runs_dir=str(tmp_path),
                           progress=False).frame()

    def row(variant, metric):
        rows = frame[(frame.variant == variant) & (frame.metric == metric)]
        assert len(rows) == 1, (variant, metric)
        return rows.iloc[0]

    assert set(frame.status) == {"ok", "skipped"}
    for fmt in fp8.FORMATS:
        assert row("high_precision", f"{fmt}_max_rel_error").value <= fp8.rounding_bound(fmt)
        assert row("high_precision", f"{fmt}_rel_error").value == pytest.approx(fp8.rms_rounding_error(fmt), rel=0.3)
    for variant in ("fp8_tensorwise", "fp8_rowwise"):
        assert 0 < row(variant, "grad_rel_diff").value <= row(variant, "grad_tolerance").value
        assert row(variant, "loss_rel_diff").value <= row(variant, "loss_tolerance").value
        assert row(variant, "saturated_fraction").value == 0.0
        assert row(variant, "emulated").value == 1.0
        for metric in ("fp8_weight_bytes", "fp8_input_bytes", "fp8_linears"):
            assert row(variant, metric).value == row(variant, metric).predicted, (variant, metric)
        skipped = row(variant, "speedup")  # the GPU-only part, skipped here with its reason
        assert skipped.status == "skipped" and "a CPU has no fp8 matmul" in skipped.message
    assert row("fp8_tensorwise", "grad_output_rel_error").predicted == fp8.rms_rounding_error("e5m2")
    assert row("fp8_rowwise", "grad_output_rel_error").predicted == fp8.rms_rounding_error("e4m3")
    assert row("fp8_rowwise", "fp8_input_bytes").value > row("fp8_tensorwise", "fp8_input_bytes").value  # a scale per token


def test_a_wrong_gradient_or_a_broken_cast_fails_the_check():
    cfg = resolve(exp.Config, "tiny", {**SMALL, "variant": "fp8_tensorwise"}, experiment="fp8")
    numerics = {"input_rel_error": 0.027, "weight_rel_error": 0.027, "grad_output_rel_error": 0.054,
                "max_rel_error": 0.11, "underflow_fraction": 0.0, "saturated_fraction": 0.0}
    grads = {"w": torch.ones(4, 4).numpy()}
    ref = {"losses": [2.0, 1.9], "loss": 2.0, "grads": grads, "numerics": {}}
    good = {"losses": [2.0001, 1.9001], "loss": 2.0001, "grads": {"w": grads["w"] * 1.01}, "numerics": numerics}
    assert exp.compare(ref, good, cfg).ok
    limit = exp.tolerances(cfg, numerics)["grad"]
    assert limit == pytest.approx(exp.GRAD_MARGIN * math.sqrt(2 * 2 + 1) * 0.054)
    wrong = {**good, "grads": {"w": grads["w"] * (1 + 2 * limit)}}
    assert not exp.compare(ref, wrong, cfg).ok and "gradients" in exp.compare(ref, wrong, cfg).message
    broken = {**good, "numerics": {**numerics, "max_rel_error": 0.2}}  # past e5m2's 2^-3
    assert "rounding bound" in exp.compare(ref, broken, cfg).message


def test_on_a_cpu_the_fp8_linears_are_emulated_and_say_why():
    cfg = resolve(exp.Config, "tiny", {**SMALL, "variant": "fp8_rowwise"}, experiment="fp8")
    assert exp.emulation_reason(cfg) == "a CPU has no fp8 matmul"
    assert exp.compute_dtype(cfg) == "float32"
    assert "speedup" not in exp.expected(cfg)  # no fp8 peak on a CPU: nothing to predict
    with pytest.raises(ConfigError, match="valid compute"):
        exp.validate(resolve(exp.Config, "tiny", {**SMALL, "dtype": "bfloat16"}, experiment="fp8"))


@pytest.mark.skipif(not HAS_FP8_GPU, reason="torchao's float8 linear needs CUDA with compute capability 8.9 or newer")
@needs("torchao")
def test_on_an_fp8_gpu_torchaos_float8_linear_runs_and_stays_near_the_emulation():
    cfg = resolve(exp.Config, "tiny", {**FAST, "num_layers": 2, "seq_len": 32, "device": "cuda",
                                       "variant": "fp8_tensorwise"}, experiment="fp8")
    assert exp.emulation_reason(cfg) is None and exp.compute_dtype(cfg) == "bfloat16"
    real, names = exp.fp8_step(cfg)
    emulated, _ = exp.fp8_step(dataclasses.replace(cfg, kernel="emulated"))
    assert type(real.model.get_submodule(names[0])).__name__ == "Float8Linear"
    a, b = real.forward().float().item(), emulated.forward().float().item()
    assert a == pytest.approx(b, rel=1e-2)  # fp8 tensor cores accumulate in another order


# --- the quiz's and the notebook's figures ------------------------------------------------------

def test_the_quiz_questions_state_labkits_figures():
    from labkit import hardware
    from labkit.study.quiz import load_bank

    bank = {q.id: q for q in load_bank() if q.id.startswith("fp8-")}
    assert sorted(bank) == [f"fp8-0{i}" for i in range(1, 5)]
    text = {k: q.question + q.explanation + "".join(q.choices) + "".join(q.feedback) for k, q in bank.items()}
    e4m3, e5m2 = (fp8.max_value(f) / fp8.smallest_subnormal(f) for f in ("e4m3", "e5m2"))
    assert f"{fp8.max_value('e5m2'):,.0f}" in text["fp8-01"] and f"{e4m3:,.0f}" in text["fp8-01"]
    assert f"{e5m2:,.0f}" in text["fp8-01"] and f"2^{math.log2(e4m3):.1f}" in text["fp8-01"]
    assert f"2^{math.log2(e5m2):.1f}" in text["fp8-01"] and f"{fp8.smallest_subnormal('e4m3')}" in text["fp8-01"]
    assert f"{fp8.rounding_bound('e4m3'):.2%}" in text["fp8-02"] and f"{fp8.rounding_bound('e5m2'):.1%}" in text["fp8-02"]
    u = fp8.rounding_bound("e4m3")
    assert f"{u / (1 + u):.2%}" in text["fp8-02"]
    q = fp8.quantize(torch.tensor([2.0, 4e-6]), "e4m3")
    assert f"= {q.scale.item():.0f}" in text["fp8-03"] and q.data[1] == 0
    assert f"{4e-6 * q.scale.item():.6f}" in text["fp8-03"] and f"{fp8.smallest_subnormal('e4m3') / 2}" in text["fp8-03"]
    h100 = hardware.gpu_spec("NVIDIA H100 80GB HBM3")["peak_tflops"]
    assert f"{h100['float8']:,}" in text["fp8-04"] and f"{h100['bfloat16']}" in text["fp8-04"]
    speedup = 7186 / 5760
    assert f"{speedup:.2f}x" in text["fp8-04"] and f"{2 * (1 - 1 / speedup):.2f}" in text["fp8-04"]


def test_the_notebooks_numbers_are_labkits():
    from labkit import hardware

    text = (ROOT / "notebooks" / "text" / "32_fp8.md").read_text()
    for fmt in fp8.FORMATS:
        assert f"{fp8.max_value(fmt):,.0f}" in text  # 448, 57,344
    assert f"2^-4 = {fp8.rounding_bound('e4m3'):.2%}" in text and f"2^-3 = {fp8.rounding_bound('e5m2'):.1%}" in text
    assert f"{fp8.rms_rounding_error('e4m3') / 2 ** -3:.3f} x 2^-m" in text
    assert "2^-9" in text and fp8.smallest_subnormal("e4m3") == 2 ** -9 and fp8.smallest_subnormal("e5m2") == 2 ** -16
    assert "compute capability {}.{} or newer".format(*exp.FP8_CAPABILITY) in text
    h100 = hardware.gpu_spec("NVIDIA H100 80GB HBM3")["peak_tflops"]
    assert "twice the tensor-core peak" in text and h100["float8"] == 2 * h100["bfloat16"]
    assert "a 4-byte scale" in text and fp8.SCALE_BYTES == fp8_plan.SCALE_BYTES == 4
    factor = re.search(r"multiplied by ([\d,]+)", text).group(1)
    assert float(factor.replace(",", "")) == exp.outlier_rows.__defaults__[0]
