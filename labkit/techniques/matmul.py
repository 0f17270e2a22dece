"""Matmul: one C = A @ B (A: m x k, B: k x n) in each dtype, and what the shape's alignment costs.

A GPU's headline TFLOP/s belong to its tensor cores, and only some dtypes reach them:
- `fp32` (the reference): plain fp32 on CUDA cores (a GPU) or the FMA vector units (a CPU).
- `tf32`: the same fp32 tensors, multiplied on tensor cores with a 10-bit mantissa (NVIDIA Ampere,
  compute capability 8.0, or newer): the inputs are rounded, the accumulation stays fp32.
- `fp16`, `bf16`: 16-bit inputs (half the bytes), fp32 accumulation on tensor cores; on a CPU
  only where it has the instructions (avx512_bf16/AMX for bf16, avx512_fp16/AMX for fp16),
  otherwise converted and many times slower than fp32.
- `fp8`: e4m3 inputs with one fp32 scale per tensor (`torch._scaled_mm`, compute capability 8.9
  or newer): the scale maps the tensor's largest value onto fp8's largest (448), so its 3-bit
  mantissa is spent where the values are.
`alignment`: tensor-core kernels move tiles whose sides are multiples of 8-128 elements;
`aligned` runs m, n, k as given (multiples of 128), `mult8` takes 8 off each (still a multiple
of 8), `off_by_one` takes 1 off each, so every tile has a ragged edge (and fp8 cannot run: it
needs multiples of 16).
A matmul does 2mnk FLOPs on (mk + kn) inputs and mn outputs, so its intensity grows with size:
large ones are compute-bound, predicted at 2mnk / peak; each variant's result is checked against
fp32's within the dtype's tolerance (`rel_error`, the relative Frobenius error).
The roof is an upper bound: a GPU's datasheet, or the CPU's physical ceiling (cores x FMA units
x lanes x 2 x clock, `hardware.cpu_peak`), so `peak_flops_pct` cannot pass 100 unless the roof is
wrong. The best `tflops` over a sweep of sizes (`labkit.views.roofline.calibrate`, or
`labkit run matmul --sweep size=...`) is the device's best measured rate, drawn below the roof.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from labkit import hardware
from labkit.config import ConfigError, RunConfig, knob
from labkit.blocks.transforms import tf32_matmuls
from labkit.workload import Comparison, Workload

VARIANTS = ("fp32", "tf32", "fp16", "bf16", "fp8")
REFERENCE = "fp32"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"size": 256},)

ALIGNMENTS = ("aligned", "mult8", "off_by_one")
OFFSET = {"aligned": 0, "mult8": 8, "off_by_one": 1}  # taken off each dimension
# The key of the dtype in `hardware.peak_tflops()` (and in data/gpus.json).
COMPUTE_DTYPE = {"fp32": "float32", "tf32": "tf32", "fp16": "float16", "bf16": "bfloat16",
                 "fp8": "float8"}
INPUT_DTYPE = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
               "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
OUTPUT_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 2}  # fp8 writes bf16
# Relative Frobenius error against fp32 that still counts as a match. The unit roundoff of the
# inputs sets it: 2^-11 (tf32, fp16), 2^-8 (bf16), 2^-4 (e4m3), with a margin of ~10x.
TOLERANCE = {"fp32": 0.0, "tf32": 5e-3, "fp16": 5e-3, "bf16": 3e-2, "fp8": 0.15}
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_SIZE = {"cpu": 512, "cuda": 8192}


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="input dtype (fp32 accumulation)")
    size: int = knob(0, min=0, help="m = n = k unless set apart; a multiple of 128 "
                                    "(0: 512 on a CPU, 8192 on a GPU)")
    m: int = knob(0, min=0, help="rows of A and C, a multiple of 128 (0: size)")
    n: int = knob(0, min=0, help="columns of B and C, a multiple of 128 (0: size)")
    k: int = knob(0, min=0, help="the reduced dimension, a multiple of 128 (0: size)")
    alignment: str = knob("aligned", choices=ALIGNMENTS,
                          help="aligned: as given; mult8: 8 off each; off_by_one: 1 off each")
    uses_seq_len = False


def given_dims(cfg: Config) -> tuple[int, int, int]:
    size = cfg.size or DEFAULT_SIZE[torch.device(cfg.device).type]
    return cfg.m or size, cfg.n or size, cfg.k or size


def dims(cfg: Config) -> tuple[int, int, int]:
    """(m, n, k) as run: the given ones less the alignment's offset."""
    return tuple(d - OFFSET[cfg.alignment] for d in given_dims(cfg))


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"matmul sets the dtype by variant; dtype must be float32 (got "
                          f"{cfg.dtype}); valid variants: {', '.join(VARIANTS)}")
    bad = {name: d for name, d in zip("mnk", given_dims(cfg)) if d % 128}
    if bad:
        name, d = next(iter(bad.items()))
        raise ConfigError(f"{name}={d} must be a multiple of 128 (alignment takes 1 or 8 off); "
                          "valid: 128, 256, 384, ...")


def skip_reason(cfg: Config) -> str | None:
    """Why this dtype cannot run on this device, or None."""
    gpu = cfg.device.startswith("cuda")
    cc = torch.cuda.get_device_capability(cfg.device) if gpu else None
    if cfg.variant == "tf32" and (not gpu or cc < (8, 0)):
        return ("TF32 is a mode of NVIDIA tensor cores (compute capability 8.0, Ampere, or "
                "newer); " + ("this device is a CPU" if not gpu else f"this GPU is {cc[0]}.{cc[1]}"))
    if cfg.variant == "bf16" and gpu and cc < (8, 0):
        return f"bf16 matmuls need compute capability 8.0 or newer; this GPU is {cc[0]}.{cc[1]}"
    if cfg.variant == "fp8":
        if not gpu or cc < (8, 9):
            return ("fp8 matmuls (torch._scaled_mm) need tensor cores of compute capability 8.9 "
                    "(Ada, Hopper) or newer; " + ("this device is a CPU" if not gpu else
                                                f"this GPU is {cc[0]}.{cc[1]}"))
        if any(d % 16 for d in dims(cfg)):
            return (f"torch._scaled_mm needs every dimension a multiple of 16; alignment="
                    f"{cfg.alignment} gives m, n, k = {dims(cfg)}")
    return None


def to_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / scale in float8_e4m3fn, scale): one fp32 scale per tensor, amax -> FP8_MAX."""
    scale = (x.abs().max().float() / FP8_MAX).clamp(min=1e-12)
    return (x / scale).to(torch.float8_e4m3fn), scale


def fp8_operands(a: torch.Tensor, b: torch.Tensor):
    """A row-major and B column-major in fp8 (the layout `_scaled_mm` takes), with their scales."""
    a8, scale_a = to_fp8(a)
    b8_t, scale_b = to_fp8(b.t().contiguous())  # (n, k) row-major = B (k, n) column-major
    return a8, b8_t.t(), scale_a, scale_b


def fp8_matmul(a8, b8, scale_a, scale_b) -> torch.Tensor:
    """(a8 * scale_a) @ (b8 * scale_b), accumulated in fp32, written in bf16."""
    return torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def make_inputs(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """A (m, k) and B (k, n) in fp32, N(0, 1), seeded (the same for every variant on a device)."""
    m, n, k = dims(cfg)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    return (torch.randn(m, k, generator=gen, device=cfg.device),
            torch.randn(k, n, generator=gen, device=cfg.device))


def build(cfg: Config) -> Workload:
    a, b = make_inputs(cfg)
    if cfg.variant == "fp8":
        operands = fp8_operands(a, b)

        def step() -> torch.Tensor:
            return fp8_matmul(*operands)
        inputs = operands[:2]
    else:
        inputs = (a.to(INPUT_DTYPE[cfg.variant]), b.to(INPUT_DTYPE[cfg.variant]))
        precision = tf32_matmuls if cfg.variant == "tf32" else contextlib.nullcontext

        def step() -> torch.Tensor:
            with precision():
                return torch.mm(*inputs)
    del a, b
    return Workload(step=step, check=lambda: {"out": step()},
                    tensors={"input_bytes": lambda: inputs},
                    per_second={"gbps": min_bytes(cfg) / 1e9},
                    notes=notes(cfg), compute_dtype=COMPUTE_DTYPE[cfg.variant])


def rel_error(reference: torch.Tensor, out: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F, in fp32."""
    ref = reference.float()
    return ((out.float() - ref).norm() / ref.norm()).item()


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    error = rel_error(reference["out"], outputs["out"])
    ok = error <= TOLERANCE[cfg.variant]
    message = "" if ok else (f"relative error {error:.2e} against fp32 is over the {cfg.variant} "
                             f"tolerance {TOLERANCE[cfg.variant]:.0e}")
    return Comparison({"rel_error": error}, ok, message)


def flops(cfg: Config) -> int:
    m, n, k = dims(cfg)
    return 2 * m * n * k


def min_bytes(cfg: Config) -> int:
    """Each input read once and the output written once: the least traffic a matmul needs."""
    m, n, k = dims(cfg)
    return (m * k + k * n) * INPUT_DTYPE[cfg.variant].itemsize + m * n * OUTPUT_BYTES[cfg.variant]


def expected(cfg: Config) -> dict[str, float]:
    """Roofline napkin math: the step takes the longer of its FLOPs at the dtype's peak and its
    least bytes at the device's bandwidth (for all but small matmuls, the FLOPs)."""
    m, n, k = dims(cfg)
    out = {"flops": flops(cfg), "input_bytes": (m * k + k * n) * INPUT_DTYPE[cfg.variant].itemsize,
           "rel_error": 0.0 if cfg.variant == REFERENCE else None}
    ceil = hardware.ceilings(cfg.device, num_threads=cfg.num_threads)
    peak = ceil.peak_tflops.get(COMPUTE_DTYPE[cfg.variant])
    if peak:
        seconds = flops(cfg) / (peak * 1e12)
        if ceil.bandwidth_gbps:
            seconds = max(seconds, min_bytes(cfg) / (ceil.bandwidth_gbps * 1e9))
        out.update(step_ms=seconds * 1e3, tflops=flops(cfg) / seconds / 1e12,
                   gbps=min_bytes(cfg) / seconds / 1e9)
    return {key: value for key, value in out.items() if value is not None}


def _calibration_note(cfg: Config) -> str:
    """The quick calibration's rate for this dtype as % of its roof (a CPU), or ""."""
    ceil = hardware.ceilings(cfg.device, num_threads=cfg.num_threads)
    key = COMPUTE_DTYPE[cfg.variant]
    measured, peak = ceil.calibrated_tflops.get(key), ceil.peak_tflops.get(key)
    if not (measured and peak):
        return ""
    return (f" This CPU's quick calibration reached {measured:.3g} TFLOP/s, "
            f"{hardware.percent(100 * measured / peak)} of the roof {peak:.3g}.")


def native_16bit(kind: str) -> bool:
    """Whether this CPU multiplies `kind` (fp16 or bf16) in hardware."""
    native = {"fp16": ("avx512_fp16", "amx_fp16"), "bf16": ("avx512_bf16", "amx_bf16")}[kind]
    return bool(set(native) & set(hardware.cpu_info().flags))


def notes(cfg: Config) -> dict[str, str]:
    """What to read in the numbers, for this variant and shape on this device."""
    gpu = cfg.device.startswith("cuda")
    out = {"tflops": "2mnk / step time; predicted: the dtype's roof (a datasheet on a GPU, the "
                     "physical ceiling on a CPU: an upper bound) unless the matmul is too small "
                     "to be compute-bound." + _calibration_note(cfg),
           "gbps": "the least traffic (inputs read once, output written once) / step time: the "
                   "matmul's point on the roofline; far below the bandwidth for a large matmul.",
           "rel_error": f"||C - C_fp32|| / ||C_fp32|| (tolerance {TOLERANCE[cfg.variant]:.0e})."}
    if cfg.variant in ("fp16", "bf16") and not gpu:
        cpu = hardware.cpu_info()
        out["step_ms"] = (
            f"{cfg.variant} on this CPU ({cpu.model}): native {cfg.variant} instructions, so it "
            "can beat fp32 (half the bytes, twice the lanes)." if native_16bit(cfg.variant) else
            f"no {cfg.variant} instructions on this CPU ({cpu.model}): the inputs are converted "
            "and the matmul runs many times slower than fp32; expect a slowdown, not a speed-up.")
    if cfg.alignment != "aligned":
        out["tflops"] += (" Unaligned shape: " + (
            "tiles with ragged edges and unvectorised loads cost tensor-core kernels more than "
            "the FLOPs they lose." if gpu else
            "on a CPU the vector remainder (16 fp32 lanes of AVX-512, 8 of AVX2) is ragged and "
            "rows no longer start on a cache-line boundary."))
    return out
