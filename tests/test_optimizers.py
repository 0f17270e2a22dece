"""AdamW with 8- and 4-bit moments (labkit.blocks.optimizers, torchao): the states' bytes and the
eager update's temporaries byte for byte against the planner, each moment within its map's
rounding of fp32 AdamW's, the recipe's `optimizer=` against plain fp32 AdamW, and the
combinations it refuses."""
import dataclasses
from pathlib import Path

import pytest
import torch

from labkit import planner
from labkit.blocks import optimizers
from labkit.blocks.recipe import Recipe, compose, planned_memory, refusal
from labkit.config import MODELS, ConfigError, resolve
from labkit.measure.memory import LiveTensorTracker, storage_bytes
from labkit.harness.timeline import compare_timelines
from labkit.planner.precision import EAGER_FP32_BYTES, EAGER_QUANTIZED_BYTES, QUANTIZED_MIN
from labkit.study.quiz import load_bank
from labkit.techniques import recipe as recipe_experiment

from conftest import needs

pytestmark = needs("torchao")
LOW_BIT = ("adamw8bit", "adamw4bit")
# quantized (16x256, 64x100: whole blocks, >= 4096 elements) and not (15x256: 3840 elements)
SHAPES = [(16, 256), (64, 100), (15, 256)]


def small(**overrides):
    """The tiny preset at one layer and 16 tokens: the embedding and head still 4096 x 256."""
    return resolve(recipe_experiment.Config, "tiny", {"device": "cpu", "nproc": 1, "num_layers": 1,
                                                     "seq_len": 16, **overrides}, experiment="recipe")


def one_parameter(shape, optimizer, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(*shape, generator=gen))
    p.grad = torch.randn(*shape, generator=gen)
    build = torch.optim.AdamW if optimizer == "adamw" else (
        lambda params, lr: optimizers.low_bit_adamw(params, lr, optimizer=optimizer, compiled=False))
    return p, build([p], lr=1e-3)


@pytest.mark.parametrize("optimizer", LOW_BIT)
@pytest.mark.parametrize("shape", SHAPES)
def test_the_eager_update_holds_the_planners_temporaries_byte_for_byte(shape, optimizer):
    p, opt = one_parameter(shape, optimizer)
    opt.step()  # the states are made in the first step
    tracker = LiveTensorTracker()
    with tracker:
        opt.step()
    n = p.numel()
    assert tracker.peak_bytes == planner.low_bit_update_bytes([n], optimizer, "eager")
    # a quantized moment's codes and scales are counted, not its wrapper's fp32-sized placeholder
    per_element = EAGER_QUANTIZED_BYTES if n >= 4096 else EAGER_FP32_BYTES
    assert tracker.peak_bytes >= per_element * n
    assert planner.low_bit_update_bytes([n], optimizer, "compiled") == 0


@pytest.mark.parametrize("optimizer", LOW_BIT)
def test_each_moment_is_fp32_adamws_within_half_a_step_of_its_map(optimizer):
    p, opt = one_parameter((64, 256), optimizer)
    ref, ref_opt = one_parameter((64, 256), "adamw")
    for _ in range(3):
        opt.step(), ref_opt.step()
    for name in ("exp_avg", "exp_avg_sq"):
        state, exact = opt.state[p][name], ref_opt.state[ref][name]
        assert state.codes.dtype == torch.uint8
        block = optimizers_block(optimizer)
        gap = state.qmap.diff().max()  # the map's largest step between neighbouring values
        bound = (state.scale.repeat_interleave(block) * gap / 2).view_as(exact)
        # each of its 3 quantizations rounds by at most half a step; the updates carry it on
        error = (state.dequantize() - exact).abs()
        assert bool((error <= 3 * bound + 1e-12).all())
        assert error.max() > 0  # quantized: not fp32 moments


def optimizers_block(optimizer):
    return planner.LOW_BIT[optimizer].block


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", LOW_BIT)
def test_the_recipes_states_and_step_peak_are_the_planners(optimizer):
    cfg, recipe = small(), Recipe(optimizer=optimizer)
    trainer = compose(cfg, recipe, lr=1e-3)
    trainer.step()
    tracker = LiveTensorTracker()
    with tracker:
        trainer.step()
    plan = planned_memory(cfg, recipe)
    states = [t for t in trainer.optimizer_tensors() if t.dim() > 0]  # less the 0-dim step counters
    assert storage_bytes(states) == plan.optimizer_bytes
    fp32 = planner.optimizer_bytes_per_param("fp32", "adamw") * planner.num_params(cfg.model)
    # notebook 26: "about a quarter" (8 bits) and "an eighth" (4 bits) of AdamW's where tensors are large
    low, high = {"adamw8bit": (0.2, 0.3), "adamw4bit": (0.1, 0.17)}[optimizer]
    assert low * fp32 < plan.optimizer_bytes < high * fp32
    assert plan.peak_phase == "step"  # the embedding's eager update outgrows the backward here
    assert tracker.peak_bytes == plan.total_bytes - plan.param_bytes - plan.optimizer_bytes
    # compiled on a GPU: one fused kernel per tensor, no whole-tensor temporaries
    on_gpu = planned_memory(dataclasses.replace(cfg, device="cuda"), recipe)
    assert on_gpu.phase_bytes["step"] == plan.phase_bytes["step"] - planner.low_bit_update_bytes(
        list(planner.stage_tensors(cfg.model)), optimizer, "eager")


@pytest.mark.slow
def test_the_loss_curve_follows_fp32_adamws_and_4_bits_strays_further():
    cfg, curves = small(vocab_size=512), {}  # every matrix still quantized (512 x 256 and up)
    for optimizer in ("adamw", *LOW_BIT):
        trainer = compose(cfg, Recipe(optimizer=optimizer), lr=1e-3)
        curves[optimizer] = [trainer.step() for _ in range(10)]
        assert type(trainer.optimizer).__name__ == {"adamw": "AdamW", "adamw8bit": "EagerAdamW8bit",
                                                    "adamw4bit": "EagerAdamW4bit"}[optimizer]
    deviation = {o: max(abs(a - b) / b for a, b in zip(curves[o], curves["adamw"])) for o in LOW_BIT}
    assert 0 < deviation["adamw8bit"] < optimizers.TOLERANCE["adamw8bit"]
    assert deviation["adamw4bit"] > deviation["adamw8bit"]


def test_the_planners_low_bit_states_follow_torchaos_rule():
    # 4096 x 256: 8-bit codes, a scale per 256, a 256-value map, for each of the two moments
    assert planner.low_bit_state_bytes([4096 * 256], "adamw8bit") == 2 * (4096 * 256 + 4 * 4096 + 1024)
    assert planner.low_bit_state_bytes([4096 * 256], "adamw4bit") == 2 * (2048 * 256 + 4 * 8192 + 64)
    assert planner.low_bit_state_bytes([3840, 4100], "adamw8bit") == 8 * (3840 + 4100)  # fp32 moments
    with pytest.raises(ConfigError, match="depend on each tensor"):
        planner.optimizer_bytes_per_param("fp32", "adamw8bit")
    m = small().model
    with pytest.raises(ConfigError, match="zero_stage 0"):
        planner.training_memory(m, optimizer="adamw8bit", zero_stage=1, gpus=2, device="cpu")
    with pytest.raises(ConfigError, match="model's shape"):
        planner.training_memory(num_params=10**6, optimizer="adamw8bit", device="cpu")
    with pytest.raises(ConfigError, match="master copies"):
        planner.training_memory(m, optimizer="adamw8bit", precision="bf16_weights", device="cpu")


@pytest.mark.parametrize("recipe, world, words", [
    (Recipe(optimizer="adamw8bit", precision="bf16_weights"), 1, "master copies"),
    (Recipe(optimizer="adamw4bit", zero_stage=1), 2, "ZeroRedundancyOptimizer"),
    (Recipe(optimizer="adamw8bit", offload="optimizer"), 1, "host AdamW"),
    (Recipe(optimizer="adam8bit"), 1, "adamw8bit"),
])
def test_a_second_optimizer_or_an_unknown_one_is_refused(recipe, world, words):
    why = refusal(recipe, "cuda", world, launched=True)
    assert why is not None and words in why
    assert refusal(Recipe(optimizer=recipe.optimizer), "cuda", 1, launched=True) is None \
        or recipe.optimizer not in optimizers.OPTIMIZERS


@pytest.mark.slow
def test_the_timeline_draws_the_8_bit_states_and_the_eager_updates_peak_as_predicted():
    frame = compare_timelines(small(), [Recipe(), Recipe(optimizer="adamw8bit")])
    peaks = frame.groupby("recipe").agg(measured=("total_bytes", "max"), predicted=("predicted_peak_bytes", "first"))
    states = frame.groupby(["recipe", "category"])["bytes"].max()
    plan = planned_memory(small(), Recipe(optimizer="adamw8bit"))
    counters = 4 * len(planner.stage_tensors(small().model))  # one 0-dim fp32 step per tensor
    assert states["optimizer=adamw8bit", "optimizer_state"] == plan.optimizer_bytes + counters
    assert states["optimizer=adamw8bit", "optimizer_state"] < states["plain", "optimizer_state"] / 3
    for recipe in ("plain", "optimizer=adamw8bit"):  # the batch's token ids and step counters apart
        assert abs(peaks.measured[recipe] - peaks.predicted[recipe]) < 4096


def test_notebook_26s_figures_are_the_planners():
    text = (Path(__file__).resolve().parents[1] / "notebooks/text/26_recipe.md").read_text()
    q = planner.LOW_BIT["adamw8bit"]
    for claim in (f"every tensor of {QUANTIZED_MIN} elements or more", f"an fp32 scale per {q.block}",
                  f"{EAGER_QUANTIZED_BYTES} bytes per element of the largest tensor"):
        assert claim in text


def test_the_quiz_figures_are_the_planners():
    text = {q.id: q.question + q.explanation + " ".join(q.choices) for q in load_bank()
            if q.id.startswith("optim-")}
    assert sorted(text) == [f"optim-0{i}" for i in range(1, 6)]
    sizes = planner.stage_tensors(MODELS["llama-2-7b"])
    assert f"{sum(sizes):,} parameters" in text["optim-01"] and f"{min(sizes):,} elements" in text["optim-01"]
    for optimizer_bytes in (planner.low_bit_state_bytes(sizes, "adamw8bit"), 8 * sum(sizes)):
        assert f"{optimizer_bytes / 2**30:.2f} GiB" in text["optim-01"]
    a = 8 * 256  # rank 8 on width 256
    assert f"{planner.low_bit_state_bytes([a], 'adamw8bit'):,} bytes" in text["optim-02"]
    tiny = resolve(recipe_experiment.Config, "tiny", {"device": "cpu"}, experiment="recipe").model
    assert max(planner.stage_tensors(tiny)) == tiny.vocab_size * tiny.hidden_size == 4096 * 256
    assert f"{EAGER_QUANTIZED_BYTES} bytes per element" in text["optim-03"]
    assert f"within {optimizers.TOLERANCE['adamw8bit']:.0%}" in text["optim-04"]


def test_optim_05s_figure_is_the_planners():
    text = next(q.question + q.explanation for q in load_bank() if q.id == "optim-05")
    sizes = planner.stage_tensors(MODELS["llama-2-7b"])
    assert f"{planner.low_bit_state_bytes(sizes, 'adamw4bit') / 2**30:.2f} GiB" in text
    assert planner.LOW_BIT["adamw4bit"].block == 128 and planner.LOW_BIT["adamw4bit"].map_size == 16


def test_the_8_bit_drills_answers_by_hand():
    from labkit.study import exercises
    from labkit.study.exercises.core import Setup

    s = Setup(exercises.RUNS["chunked"], "cpu")
    m = s.cfg("composed", optimizer="adamw8bit").model  # one layer: what the details list
    d, f, V = m.hidden_size, m.ffn_size, m.vocab_size
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    sizes = [V * d, d, d, q * d, kv * d, kv * d, q * d, f * d, f * d, d * f, d, V * d]
    assert sorted(sizes) == sorted(planner.stage_tensors(m))
    by_hand = sum(2 * (n + 4 * n // 256 + 4 * 256) if n >= 4096 and n % 256 == 0 else 8 * n for n in sizes)
    assert exercises.reference_answer("adamw8bit_state_bytes", "cpu") == by_hand
    psi = sum(sizes)
    peak = 4 * psi + 4 * psi + by_hand + 53 * V * d + 4 * V * d // 256 + 8
    assert exercises.reference_answer("adamw8bit_step_peak", "cpu") == peak
