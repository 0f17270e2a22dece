"""Exercises on mixed precision: bf16 weights, the model states of a mixed-precision recipe,
fp16's range at both ends, the FLOPs of a step. Every answer here is a closed form, the same on
every device."""
from __future__ import annotations

import math

from labkit import planner
from labkit.study.exercises.core import MiB, TOPICS, Exercise, Rows, Setup, mib, model_words, show
from labkit.study.exercises.formulas import FP16_MAX, fp16_demo, fp16_round
from labkit.study.exercises.memory import psi, within

BF16_MAX = (2 - 2.0**-7) * 2.0**127  # fp32's exponent range, 8 significant bits: ~3.39e38
SQUARES = (300.0, 250.0)  # logits squared and summed in the forward-overflow exercise
RANGE_CHOICES = ("inf in fp16, finite in bf16", "finite in both", "inf in both",
                 "finite in fp16, inf in bf16")


def bytes_per_param(r: Rows, variant: str, metric: str, s: Setup) -> float | None:
    value = r.get(variant, metric)
    return None if value is None else value / psi(s)


def state_supports(r: Rows, s: Setup) -> str | None:
    """bf16_weights measured 2 bytes of weights and 12 of optimizer state (master + m + v) per param."""
    return (within(bytes_per_param(r, "bf16_weights", "param_bytes", s), 2, 0.001,
                   "bf16 weight bytes per parameter")
            or within(bytes_per_param(r, "bf16_weights", "optimizer_bytes", s), 12, 0.001,
                      "optimizer bytes per parameter (fp32 master + two moments)"))


def bf16_param_bytes() -> Exercise:
    return Exercise(
        "bf16_param_bytes", TOPICS[1], "Weights in bf16",
        "You keep the tiny model's weights in bf16 (bf16_weights: the optimizer holds an fp32 master "
        "copy of them separately).", "How many MiB do the bf16 weights themselves take?", "mp",
        answer=lambda s: planner.param_bytes(s.cfg().model, "bfloat16") / MiB,
        evidence=lambda r, s: {"fp32": mib(r.get("fp32", "param_bytes")),
                               "bf16": mib(r.get("bf16_weights", "param_bytes")),
                               "optim": mib(r.get("bf16_weights", "optimizer_bytes"))},
        why="2 bytes per parameter: {answer}. Measured: {bf16} in bf16 against {fp32} in fp32; the "
            "optimizer grew to {optim} because it keeps the fp32 master weights (4 more bytes/param).",
        level=1, hint="Parameters x bytes per bf16 value; the master copy belongs to the optimizer.",
        mistake=lambda s: 6 * psi(s) / MiB,
        mistake_why="the fp32 master copy (4 bytes/param) is the optimizer's state, not the weights "
                    "the model computes with.",
        supports=lambda r, s: within(bytes_per_param(r, "bf16_weights", "param_bytes", s), 2, 0.001,
                                     "bf16 weight bytes per parameter"),
        unit="MiB", rel_tol=0.02, details=model_words)


def mixed_state_bytes() -> Exercise:
    return Exercise(
        "mixed_state_bytes", TOPICS[1], "The model states of mixed precision",
        "bf16_weights again: the weights and their gradients are bf16; the optimizer keeps an fp32 "
        "master copy of the weights and AdamW's two fp32 moments (m and v).",
        "How many MiB do the model states (weights + gradients + optimizer states) take?", "mp",
        answer=lambda s: sum(planner.zero_model_state_bytes(
            psi(s), stage=0, dp=1, precision="bf16_weights", optimizer="adamw")) / MiB,
        evidence=lambda r, s: {"bf16": mib(r.get("bf16_weights", "param_bytes")),
                               "optim": mib(r.get("bf16_weights", "optimizer_bytes")),
                               "fp32": show(16 * psi(s) / MiB, "MiB")},
        why="(2 + 2 + 4 + 4 + 4) bytes per parameter = 16, ZeRO's 2Ψ + 2Ψ + KΨ with K = 12: {answer}, "
            "exactly what fp32 AdamW takes ({fp32}). Mixed precision saves compute and activation "
            "memory, not model states. Measured: weights {bf16}, optimizer (master + m + v) {optim}.",
        level=2, hint="Bytes per parameter for each of the five things kept, then times the "
                      "parameters.",
        mistake=lambda s: 8 * psi(s) / MiB,
        mistake_why="16-bit training does not halve the model states: the fp32 master copy and "
                    "moments (12 bytes/param) dominate them.",
        supports=state_supports, unit="MiB", rel_tol=0.02, details=model_words)


def fp16_underflow() -> Exercise:
    return Exercise(
        "fp16_underflow", TOPICS[1], "A small gradient in fp16",
        "Without loss scaling, a gradient of 1e-8 is stored in fp16. fp16 has 5 exponent and 10 "
        "mantissa bits; below 2^-14 it has subnormals, evenly spaced 2^-24 (about 5.96e-8) apart. "
        "The conversion rounds to nearest (ties to even).",
        "What value does fp16 store (a number)?", "mp",
        answer=lambda s: fp16_round(1e-8),
        evidence=lambda r, s: {**{k: f"{v:.3g}" for k, v in fp16_demo().items()},
                               "scale": show(r.get("fp16", "loss_scale"))},
        why="fp16's smallest positive value is 2^-24 = 5.96e-8; 1e-8 is below half of it "
            "(2^-25 = 2.98e-8), so round-to-nearest gives {answer}. torch: {grad_fp16}. With the loss "
            "scaled by 65536 first the gradient survives ({grad_scaled} after unscaling); the fp16 "
            "run here used a scale of {scale} (GradScaler).",
        level=1, hint="Find the two fp16 values next to 1e-8 and which one is nearer.",
        mistake=lambda s: 1e-8,
        mistake_why="fp16 cannot hold 1e-8: the nearest fp16 values are 0 and 2^-24 = 5.96e-8, and "
                    "0 is nearer.",
        supports=underflow_supports, abs_tol=1e-12)


def underflow_supports(r: Rows, s: Setup) -> str | None:
    demo, scale = fp16_demo(), r.get("fp16", "loss_scale")
    if demo["grad_fp16"] != 0.0 or abs(demo["grad_scaled"] - 1e-8) > 0.01e-8:
        return f"torch stored {demo['grad_fp16']} (scaled: {demo['grad_scaled']})"
    return None if scale is not None and scale > 1 else f"the fp16 run's loss scale is {scale!r}"


def range_answer(x: float) -> str:
    """Which 16-bit formats overflow to inf on `x` (closed forms, round to nearest)."""
    fp16_inf, bf16_inf = math.isinf(fp16_round(x)), abs(x) > BF16_MAX
    return {(True, False): RANGE_CHOICES[0], (False, False): RANGE_CHOICES[1],
            (True, True): RANGE_CHOICES[2], (False, True): RANGE_CHOICES[3]}[(fp16_inf, bf16_inf)]


def bf16_square_sum() -> float:
    import torch

    logits = torch.tensor(SQUARES, dtype=torch.bfloat16)
    return (logits * logits).sum().item()


def range_supports(r: Rows, s: Setup) -> str | None:
    fp16, bf16 = fp16_demo()["square_fp16"], bf16_square_sum()
    if math.isinf(fp16) and math.isfinite(bf16):
        return None
    return f"torch gave {fp16} in fp16 and {bf16} in bf16"


def fp16_range() -> Exercise:
    total = sum(x * x for x in SQUARES)
    return Exercise(
        "fp16_range", TOPICS[1], "fp16's range in the forward",
        f"Under 16-bit autocast a forward squares two logits, {SQUARES[0]:g} and {SQUARES[1]:g}, and "
        f"sums them ({SQUARES[0]:g}^2 + {SQUARES[1]:g}^2 = {total:,.0f}) in the 16-bit format. fp16 has "
        f"5 exponent bits (largest finite value {FP16_MAX:g}; round-to-nearest sends anything from "
        "65520 up to inf); "
        "bf16 has fp32's 8 exponent bits (largest about 3.39e38) but only 8 significant bits.",
        "What comes out in each format?", "mp",
        answer=lambda s: range_answer(total),
        evidence=lambda r, s: {"fp16": show(fp16_demo()["square_fp16"]), "bf16": show(bf16_square_sum()),
                               "scale": show(r.get("fp16", "loss_scale"))},
        why=f"{total:,.0f} > {FP16_MAX:g}, so fp16 overflows to inf, while bf16's range reaches "
            "3.4e38: {answer}. torch: {fp16} in fp16, {bf16} in bf16 (rounded to 8 significant "
            "bits). A GradScaler (here scale {scale}) protects the backward's small gradients, not "
            "the forward's overflow: that needs bf16, or keeping such sums in fp32.",
        level=1, hint="Compare the sum with each format's largest finite value.",
        choices=RANGE_CHOICES, mistake=lambda s: RANGE_CHOICES[2],
        mistake_why="fewer mantissa bits is not a smaller range: bf16 keeps fp32's 8 exponent bits.",
        feedback={RANGE_CHOICES[0]: "right: fp16 tops out at 65504; bf16 has fp32's range and only "
                                    "loses precision (the sum rounds to 8 significant bits).",
                  RANGE_CHOICES[1]: "fp16's largest finite value is 65504; the sum is above it.",
                  RANGE_CHOICES[2]: "bf16 has fp32's 8 exponent bits: it reaches about 3.4e38.",
                  RANGE_CHOICES[3]: "it is the other way round: bf16 has the wider range, fp16 the "
                                    "finer precision."},
        supports=range_supports)


def train_flops() -> Exercise:
    return Exercise(
        "train_flops", TOPICS[1], "FLOPs of a training step",
        "The tiny model (2 layers) trains on 1 x 8 tokens in fp32. Count as FlopCounterMode does: a "
        "(m x k) @ (k x n) matmul is 2mkn and its backward twice that; the embedding is a lookup (no "
        "FLOPs); SDPA's forward is 4 x b x s^2 x h per layer (the full score matrix) and its "
        "backward 2.5x that (it recomputes the scores).",
        "How many MFLOP does one training step (forward + backward) take?", "mp",
        answer=lambda s: s.expected("fp32")["flops"] / 1e6,
        evidence=lambda r, s: {"flops": show(r.get("fp32", "flops") / 1e6, "MFLOP"),
                               "tflops": show(r.get("fp32", "tflops"), "TFLOP/s")},
        why="6 x (matmul parameters: all but the embedding table) x tokens, plus attention's "
            "3.5 x 4 x b x s^2 x h = 14 x b x s^2 x h per layer: {answer}. FlopCounterMode counted "
            "{flops}; the step ran at {tflops} here.",
        level=2, hint="6 FLOPs per matmul parameter per token (forward 2, backward 4), then "
                      "attention's score terms.",
        mistake=lambda s: 6 * psi(s) * s.cfg().batch_size * s.cfg().seq_len / 1e6,
        mistake_why="the embedding table is looked up, not multiplied: its parameters cost no "
                    "FLOPs (the untied head's do).",
        supports=lambda r, s: within(r.get("fp32", "flops"), s.expected("fp32")["flops"], 0.01,
                                     "FlopCounterMode's count"),
        unit="MFLOP", rel_tol=0.10, details=model_words)


def build_exercises() -> list[Exercise]:
    return [bf16_param_bytes(), mixed_state_bytes(), fp16_underflow(), fp16_range(), train_flops()]
