"""What a claim is, and the figures the tables share: the published shapes labkit holds
(`labkit.config.MODELS`), the GPUs of `data/gpus.json`, and how a number is written."""
from __future__ import annotations

import math
from typing import Callable, NamedTuple

from labkit import hardware, planner
from labkit.config import MODELS

MIB, GIB = 2**20, 2**30
H100, H200, A100 = (hardware.gpu_spec(name) for name in ("H100 SXM5", "H200 SXM", "A100 SXM4 80GB"))
LLAMA2, LLAMA3, LLAMA70 = MODELS["llama-2-7b"], MODELS["llama-3-8b"], MODELS["llama-3-70b"]


class Claim(NamedTuple):
    text: str  # a question's id, or a notebook text's path from the repository root
    number: str  # the words as the text has them
    make: Callable[[], str]  # labkit's computation of those words


def sig(x: float, digits: int = 2) -> str:
    """`x` to `digits` significant digits, thousands separated: sig(239.3) == "240"."""
    places = digits - 1 - math.floor(math.log10(abs(x)))
    return f"{round(x, places):,.{max(places, 0)}f}"


def sci(x: float) -> str:
    """`x` in two significant digits of scientific notation, as the texts write it: "1.5e-3"."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def bf16_peak(spec: dict) -> float:
    """Dense bf16 TFLOP/s of a gpus.json row."""
    return spec["peak_tflops"]["bfloat16"]


def tbps(spec: dict) -> float:
    """Memory bandwidth of a gpus.json row in TB/s (10^12 bytes/s)."""
    return spec["bandwidth_gbps"] / 1000


def ridge(spec: dict) -> float:
    """FLOP per byte where the bf16 roof meets the bandwidth's (labkit.measure.roofline's ridge)."""
    return bf16_peak(spec) * 1e12 / (spec["bandwidth_gbps"] * 1e9)


def zero_gb(psi: float, stage: int, dp: int, precision: str = "bf16_weights", optimizer: str = "adam") -> float:
    """Model states per GPU in GB (10^9 bytes) under ZeRO `stage` (labkit.planner)."""
    return sum(planner.zero_model_state_bytes(int(psi), stage=stage, dp=dp, precision=precision,
                                              optimizer=optimizer)) / 1e9


def state_bytes(precision: str, optimizer: str = "adamw") -> tuple[int, int, int]:
    """(weight, gradient, optimizer) bytes per parameter of a precision recipe (labkit.planner)."""
    p = planner.PRECISION_BYTES[precision]
    return p.weight, p.grad, planner.optimizer_bytes_per_param(precision, optimizer)


def korthikanti_gb(**kw) -> float:
    """Korthikanti et al.'s activation bytes (labkit.planner), in GB."""
    return planner.korthikanti_activation_bytes(**kw) / 1e9
