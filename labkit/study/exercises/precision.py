"""Exercises on mixed precision: bf16 weights, the model states of a mixed-precision recipe,
fp16's range at both ends, the FLOPs of a step. Every answer here is a closed form, the same on
every device.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

import math

from labkit import planner
from labkit.study.exercises.core import MiB, TOPICS, Exercise, Rows, Setup, mib, model_words, show
from labkit.study.exercises.formulas import FP16_MAX, fp16_demo, fp16_round
from labkit.study.exercises.inference import measured_is
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
        "bf16_param_bytes", TOPICS[1], "mp",
        answer=lambda s: planner.param_bytes(s.cfg().model, "bfloat16") / MiB,
        evidence=lambda r, s: {"fp32": mib(r.get("fp32", "param_bytes")),
                               "bf16": mib(r.get("bf16_weights", "param_bytes")),
                               "optim": mib(r.get("bf16_weights", "optimizer_bytes"))},
        level=1, mistake=lambda s: 6 * psi(s) / MiB,
        supports=lambda r, s: within(bytes_per_param(r, "bf16_weights", "param_bytes", s), 2, 0.001,
                                     "bf16 weight bytes per parameter"),
        unit="MiB", rel_tol=0.02, details=model_words)


def mixed_state_bytes() -> Exercise:
    return Exercise(
        "mixed_state_bytes", TOPICS[1], "mp",
        answer=lambda s: sum(planner.zero_model_state_bytes(
            psi(s), stage=0, dp=1, precision="bf16_weights", optimizer="adamw")) / MiB,
        evidence=lambda r, s: {"bf16": mib(r.get("bf16_weights", "param_bytes")),
                               "optim": mib(r.get("bf16_weights", "optimizer_bytes")),
                               "fp32": show(16 * psi(s) / MiB, "MiB")},
        level=2, mistake=lambda s: 8 * psi(s) / MiB,
        supports=state_supports, unit="MiB", rel_tol=0.02, details=model_words)


def fp16_underflow() -> Exercise:
    return Exercise(
        "fp16_underflow", TOPICS[1], "mp",
        answer=lambda s: fp16_round(1e-8),
        evidence=lambda r, s: {**{k: f"{v:.3g}" for k, v in fp16_demo().items()},
                               "scale": show(r.get("fp16", "loss_scale"))},
        level=1, mistake=lambda s: 1e-8,
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
        "fp16_range", TOPICS[1], "mp",
        answer=lambda s: range_answer(total),
        evidence=lambda r, s: {"fp16": show(fp16_demo()["square_fp16"]), "bf16": show(bf16_square_sum()),
                               "scale": show(r.get("fp16", "loss_scale"))},
        level=1, choices=RANGE_CHOICES, mistake=lambda s: RANGE_CHOICES[2],
        supports=range_supports,
        words={"square_a": SQUARES[0], "square_b": SQUARES[1], "total": total, "fp16_max": FP16_MAX})


def train_flops() -> Exercise:
    return Exercise(
        "train_flops", TOPICS[1], "mp",
        answer=lambda s: s.expected("fp32")["flops"] / 1e6,
        evidence=lambda r, s: {"flops": show(r.get("fp32", "flops") / 1e6, "MFLOP"),
                               "tflops": show(r.get("fp32", "tflops"), "TFLOP/s")},
        level=2, mistake=lambda s: 6 * psi(s) * s.cfg().batch_size * s.cfg().seq_len / 1e6,
        supports=lambda r, s: within(r.get("fp32", "flops"), s.expected("fp32")["flops"], 0.01,
                                     "FlopCounterMode's count"),
        unit="MFLOP", rel_tol=0.10, details=model_words)


def fp8_copies(s: Setup, granularity: str = "rowwise") -> int:
    """The converted weights' float8 copies: 1 byte per weight, a 4-byte fp32 scale per row
    (rowwise) or per tensor (tensorwise) (`planner.float8_cast_bytes`)."""
    cfg = s.cfg("fp8_rowwise")
    return planner.float8_cast_bytes(cfg.model, tokens=cfg.batch_size * cfg.seq_len,
                                     granularity=granularity)["weight"]


def fp8_words(s: Setup) -> str:
    shapes = planner.float8_shapes(s.cfg("fp8_rowwise").model)
    return ("The fp8 linears of the run's model, (outputs x inputs): "
            + ", ".join(f"{n} x {k}" for n, k in shapes)
            + " (the output head stays in high precision).")


def fp8_weight_bytes() -> Exercise:
    return Exercise(
        "fp8_rowwise_weight_bytes", TOPICS[1], "fp8", answer=fp8_copies, details=fp8_words,
        evidence=lambda r, s: {"measured": show(r.get("fp8_rowwise", "fp8_weight_bytes"), "bytes")},
        level=1, mistake=lambda s: fp8_copies(s, "tensorwise"), unit="bytes", rel_tol=0.001,
        supports=lambda r, s: measured_is("fp8_rowwise", "fp8_weight_bytes", fp8_copies(s), r))


def build_exercises() -> list[Exercise]:
    return [bf16_param_bytes(), mixed_state_bytes(), fp16_underflow(), fp16_range(), train_flops(),
            fp8_weight_bytes()]
