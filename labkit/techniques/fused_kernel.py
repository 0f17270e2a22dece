"""Kernel fusion: residual add + RMSNorm, unfused, compiled, and as our own Triton kernel.

Between its sublayers a Llama block adds the sublayer's output to the residual stream and
normalises the sum: `h = x + residual; y = rmsnorm(h) * weight`. Every op in it does a few FLOPs
per element, so it is bound by memory traffic, not arithmetic. The least it can move is x,
residual and weight read once and y and h written once: (4 x rows x hidden + hidden) x bytes per
element. Its time at best is those bytes over the device's bandwidth; `gbps` (those bytes over
the measured time) says how close each variant gets.

- `eager` (the reference): the unfused ops, `x + residual` then `labkit.blocks.model.RMSNorm`. Each op is
  its own kernel, reading its input from memory and writing its output back: the add, the fp32
  upcast (16-bit dtypes), the square, the mean, the rsqrt, two multiplies.
- `compiled`: `torch.compile` of the same function. Inductor fuses the chain into one or two
  generated loops (C++ on the CPU, Triton on a GPU). Its first call traces and compiles: that
  cold start (`compile_s`) is reported apart from the steady-state `step_ms`.
- `triton`: our kernel (`labkit.blocks.kernels.rmsnorm`), one row per program, fp32 inside. CUDA only
  here; its correctness on the CPU is tested under `TRITON_INTERPRET=1`.

Every variant's y and h are compared with eager's before timing (`max_abs_error`,
`max_rel_error`: the largest error over the largest reference value).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit import hardware
from labkit.config import DTYPE_BYTES, ConfigError, RunConfig, knob, torch_dtype
from labkit.blocks.kernels import triton_available
from labkit.measure.clock import clock
from labkit.measure.modes import unmetered
from labkit.blocks.model import RMSNorm
from labkit.workload import Comparison, Workload

VARIANTS = ("eager", "compiled", "triton")
REFERENCE = "eager"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"rows": 1024},)

SIZES = {"tiny": {"rows": 4096}}  # 4096 rows pass the CPU caches
# max_rel_error against eager that still counts as a match: rounding of the storage dtype (the
# variants round once where eager rounds after normalising and again after the weight).
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}
MAX_ROW_BYTES = 64 * 1024  # one row per program: the padded row must fit the kernel's registers


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="how the add + RMSNorm runs")
    rows: int = knob(0, min=0, help="tokens normalised per call (0: batch_size x seq_len)")


def num_rows(cfg: Config) -> int:
    return cfg.rows or cfg.batch_size * cfg.seq_len


def validate(cfg: Config) -> None:
    padded = 1 << (cfg.model.hidden_size - 1).bit_length()
    if padded * DTYPE_BYTES[cfg.dtype] > MAX_ROW_BYTES:
        raise ConfigError(f"hidden_size={cfg.model.hidden_size} is too wide for one row per program "
                          f"in {cfg.dtype}; valid: up to {MAX_ROW_BYTES // DTYPE_BYTES[cfg.dtype]}")


def skip_reason(cfg: Config) -> str | None:
    if cfg.variant == "triton":
        if not triton_available():
            return "Triton is not installed (pip install triton)"
        if not cfg.device.startswith("cuda"):
            return ("Triton kernels need a CUDA GPU here; on the CPU the kernel's correctness is "
                    "tested under TRITON_INTERPRET=1 (tests/test_fused_kernel.py)")
    if cfg.variant == "compiled" and not cfg.device.startswith("cuda"):
        return hardware.inductor_cpu_problem()
    return None


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused reference: (rmsnorm(x + residual) * weight, x + residual)."""
    h = x + residual
    return norm(h), h


def make_inputs(cfg: Config) -> tuple[torch.Tensor, torch.Tensor, RMSNorm]:
    """x and residual (rows, hidden) and a norm whose weight is not all ones, seeded."""
    gen = torch.Generator().manual_seed(cfg.seed)
    shape, dtype, n = (num_rows(cfg), cfg.model.hidden_size), torch_dtype(cfg.dtype), cfg.model.hidden_size
    x, residual = (torch.randn(shape, generator=gen).to(cfg.device, dtype) for _ in range(2))
    norm = RMSNorm(n, cfg.model.norm_eps).requires_grad_(False)
    norm.weight.copy_(1 + 0.1 * torch.randn(n, generator=gen))
    return x, residual, norm.to(cfg.device, dtype)


def make_step(cfg: Config, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm):
    """The variant's zero-argument call, and a dict that receives the compile time."""
    found: dict[str, float] = {}
    if cfg.variant == "triton":
        from labkit.blocks.kernels.rmsnorm import fused_add_rmsnorm  # imports triton: only here

        return (lambda: fused_add_rmsnorm(x, residual, norm.weight, norm.eps)), found
    if cfg.variant == "eager":
        return (lambda: add_rmsnorm(x, residual, norm)), found
    torch.compiler.reset()  # a cold start per point: no graph left from an earlier build or shape
    compiled = torch.compile(add_rmsnorm)

    def step():
        # torch.compile falls back to eager while a TorchDispatchMode is active (the CPU memory
        # tracker is one), so run it outside: what is checked and timed is the compiled code.
        with unmetered():
            if "compile_s" in found:
                return compiled(x, residual, norm)
            start = clock(cfg.device)  # the device drained: the cold call's own time
            out = compiled(x, residual, norm)
            found["compile_s"] = clock(cfg.device) - start
            return out

    return step, found


def build(cfg: Config) -> Workload:
    x, residual, norm = make_inputs(cfg)
    call, found = make_step(cfg, x, residual, norm)

    @torch.no_grad()
    def step():
        return call()

    def check() -> dict:
        y, h = step()
        return {"y": y, "h": h}

    return Workload(step=step, check=check, tokens_per_step=num_rows(cfg),
                    per_second=per_second(cfg), report=lambda: dict(found), notes=notes(cfg),
                    count_flops=False)  # FlopCounterMode counts no pointwise or reduction FLOPs


def per_second(cfg: Config) -> dict[str, float]:
    """Amounts per step that the harness divides by the step's time: GB moved, and the same as a
    percentage of what the device's bandwidth moves in one second."""
    out = {"gbps": bytes_moved(cfg) / 1e9}
    bandwidth = hardware.bandwidth_gbps(cfg.device, num_threads=cfg.num_threads)
    if bandwidth:
        out["peak_bandwidth_pct"] = 100 * bytes_moved(cfg) / (bandwidth * 1e9)
    return out


def bytes_moved(cfg: Config) -> int:
    """The fused floor: read x, residual (rows x hidden) and weight (hidden); write y and h."""
    rows, n = num_rows(cfg), cfg.model.hidden_size
    return (4 * rows * n + n) * DTYPE_BYTES[cfg.dtype]


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    errors = [(outputs[k].float() - reference[k].float()).abs().max().item() for k in ("y", "h")]
    scale = max(reference[k].float().abs().max().item() for k in ("y", "h"))
    metrics = {"max_abs_error": max(errors), "max_rel_error": max(errors) / scale}
    ok = metrics["max_rel_error"] <= TOLERANCE[cfg.dtype]
    message = "" if ok else (f"max_rel_error {metrics['max_rel_error']:.3g} > tolerance "
                             f"{TOLERANCE[cfg.dtype]:g} ({cfg.dtype})")
    return Comparison(metrics, ok, message)


def expected(cfg: Config) -> dict[str, float]:
    out: dict[str, float] = {"max_abs_error": 0.0, "max_rel_error": 0.0} if cfg.variant == "eager" else {}
    bandwidth = hardware.bandwidth_gbps(cfg.device, num_threads=cfg.num_threads)
    if bandwidth:  # the floor: the fused bytes at the device's bandwidth
        out.update(step_ms=1e3 * bytes_moved(cfg) / (bandwidth * 1e9), gbps=bandwidth,
                   peak_bandwidth_pct=100.0)
    return out


def notes(cfg: Config) -> dict[str, str]:
    out = {"gbps": "the fused floor's bytes (read x, residual, weight; write y, h) over the measured "
                   "time; predicted: the device's bandwidth ceiling (measured on a CPU). Unfused "
                   "ops move more bytes than this, so their figure is an effective bandwidth.",
           "step_ms": "one call (a forward pass of add + RMSNorm); predicted: the fused bytes at "
                      "the device's bandwidth."}
    if cfg.variant == "compiled":
        out["compile_s"] = ("the first call: tracing, inductor's code generation and the C++ (CPU) "
                            "or Triton (GPU) build; a warm on-disk inductor cache shortens it.")
        if not cfg.device.startswith("cuda"):
            out["peak_mem_bytes"] = ("the inputs only: the compiled code runs outside the CPU "
                                     "memory tracker (torch.compile falls back to eager under it).")
    return out
