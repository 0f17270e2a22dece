"""Mixed precision: one training step of the decoder (AdamW) in fp32, TF32, fp16 and bf16.

- `fp32`: the reference.
- `tf32`: fp32 tensors, matmuls on tensor cores with a 10-bit mantissa (NVIDIA Ampere or newer).
- `fp16`: autocast to float16 and a GradScaler: the loss is multiplied so small gradients do not
  flush to zero in fp16; steps whose gradients overflow are skipped and the scale halves.
- `bf16`: autocast to bfloat16 (fp32's exponent range, so no scaling), fp32 weights.
- `bf16_weights`: the weights themselves in bf16 (half the bytes), with an fp32 master copy that
  the optimizer updates, so small updates are not lost to bf16 rounding.

Two knobs break a run on purpose (the troubleshooting lab's faults): `mlp_scale` multiplies every
block's MLP output weights (w2) at initialisation, so its fp16 output passes 65504 and becomes inf
in the forward (large activations, as in models with outlier features; bf16 and fp32 hold them);
`loss_weight` multiplies the loss before backward, so gradients shrink below fp16's smallest
subnormal (2^-24) and flush to zero without loss scaling (`loss_scaling=False`). What the check
records of its steps shows it: `nonfinite_losses`, `zero_grad_pct` (of the gradient elements of
the last step, exactly zero) and, with a GradScaler, `skipped_steps`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from labkit import hardware, planner
from labkit.config import ConfigError, RunConfig, knob
from labkit.blocks.training import Trainer
from labkit.blocks.transforms import (AUTOCAST, PRECISION_TOLERANCE, apply_precision, compute_dtype,
                                     weights_dtype)
from labkit.workload import Comparison, Workload

VARIANTS = ("fp32", "tf32", "fp16", "bf16", "bf16_weights")
REFERENCE = "fp32"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"batch_size": 1, "seq_len": 32}, {"batch_size": 1, "seq_len": 16, "num_layers": 2, "steps": 1},
             {"batch_size": 1, "seq_len": 16, "num_layers": 1, "steps": 1})

# fp16 and bf16 steps are emulated (15-70x slower than fp32) on a CPU without AVX-512 FP16/BF16:
# half the batch keeps the three 16-bit variants to seconds there
SIZES = {"tiny": {"batch_size": 2}}
# What the check's steps show of the precision: kept in the comparison, so also in a failed one's rows
STEP_FIGURES = ("nonfinite_losses", "zero_grad_pct", "loss_first", "grad_norm")
# Relative loss difference against fp32 after `steps` steps that still counts as a match.
TOLERANCE = PRECISION_TOLERANCE


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="precision recipe")
    steps: int = knob(3, min=1, help="training steps compared with fp32")
    lr: float = knob(1e-3, min=0.0, help="AdamW learning rate")
    loss_scaling: bool = knob(True, help="fp16: a GradScaler (False: plain backward, so small "
                                         "gradients flush to zero in fp16)")
    loss_weight: float = knob(1.0, min=0.0, help="the loss is multiplied by this before backward "
                                                 "(tiny: tiny gradients)")
    mlp_scale: float = knob(1.0, min=0.0, help="every block's MLP output weights (w2) multiplied "
                                               "by this at init (large: large activations)")


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError("mixed_precision sets precision by variant; dtype must be float32 "
                          f"(got {cfg.dtype}); valid variants: {', '.join(VARIANTS)}")


def precision_step(cfg: Config) -> Trainer:
    """The plain training step with the variant's precision (`apply_precision`), and the faults'
    knobs: the loss weighted, the MLP's output weights scaled (before the optimizer copies them)."""
    trainer = Trainer(cfg, weights=weights_dtype(cfg.variant), lr=cfg.lr, optimizer=False)
    apply_precision(trainer, cfg.variant, loss_scaling=cfg.loss_scaling)
    trainer.loss_weight, trainer.zero_grad_pct = cfg.loss_weight, math.nan
    trainer.grad_hooks.append(record_zero_grads)
    if cfg.mlp_scale != 1.0:
        with torch.no_grad():
            for block in trainer.model.layers:
                block.mlp.w2.weight.mul_(cfg.mlp_scale)
    trainer.build_optimizer()
    return trainer


def record_zero_grads(trainer: Trainer) -> None:
    """The share of gradient elements that are exactly zero (%), kept on the trainer."""
    grads = [p.grad for p in trainer.model.parameters() if p.grad is not None]
    total = sum(g.numel() for g in grads)
    trainer.zero_grad_pct = 100 * sum(int((g == 0).sum()) for g in grads) / total if total else math.nan


def report(trainer: Trainer) -> dict[str, float]:
    out = {"grad_norm": trainer.grad_norm}
    if trainer.scaler is not None:
        out.update(loss_scale=trainer.scaler.get_scale(), skipped_steps=trainer.skipped_steps)
    return out


def train(trainer: Trainer, steps: int) -> dict[str, object]:
    """The plain losses and gradient norm, and what they show of the precision: losses that are
    inf or nan, the last step's zero gradient elements (%), steps GradScaler skipped."""
    out = trainer.train(steps)
    nonfinite = sum(not math.isfinite(x) for x in trainer.losses)
    return {**out, "nonfinite_losses": nonfinite, "zero_grad_pct": trainer.zero_grad_pct,
            "loss_first": trainer.losses[0], "skipped_steps": trainer.skipped_steps}


def skip_reason(cfg: Config) -> str | None:
    """Why this variant cannot run on this device, or None."""
    if cfg.variant == "tf32":
        if not cfg.device.startswith("cuda"):
            return "TF32 is a mode of NVIDIA tensor cores (Ampere or newer); this device is a CPU"
        if torch.cuda.get_device_capability(cfg.device)[0] < 8:
            return "TF32 needs compute capability 8.0 (Ampere) or newer"
    if cfg.variant.startswith("bf16") and cfg.device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support (compute capability 8.0 or newer needed)"
    return None


def build(cfg: Config) -> Workload:
    trainer = precision_step(cfg)
    model = trainer.model
    return Workload(
        step=trainer.step, check=lambda: train(trainer, cfg.steps),
        tokens_per_step=cfg.batch_size * cfg.seq_len,
        tensors={"param_bytes": model.parameters, "optimizer_bytes": trainer.optimizer_tensors},
        forward=trainer.forward, resident=trainer.model.parameters, report=lambda: report(trainer),
        notes=notes(cfg), compute_dtype=compute_dtype(cfg.variant))


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The loss after the same steps from the same weights and batch: the quality delta."""
    ref, got = reference["losses"][-1], outputs["losses"][-1]
    delta = abs(got - ref)
    rel = delta / abs(ref)
    ok = math.isfinite(got) and rel <= TOLERANCE[cfg.variant]
    message = "" if ok else f"loss {got:.5f} vs {ref:.5f} ({100 * rel:.2f}% > {100 * TOLERANCE[cfg.variant]:.0f}%)"
    # What the steps showed of the precision, kept also when the check fails (a nan loss)
    steps = {k: outputs[k] for k in STEP_FIGURES if k in outputs}
    if cfg.variant == "fp16" and cfg.loss_scaling:
        steps["skipped_steps"] = outputs["skipped_steps"]
    return Comparison({"loss": got, "loss_delta": delta, **steps}, ok, message)


def expected(cfg: Config) -> dict[str, float]:
    m = cfg.model
    weights = "bfloat16" if cfg.variant == "bf16_weights" else "float32"
    flops = planner.train_step_flops(m, batch=cfg.batch_size, seq_len=cfg.seq_len,
                                     attention=cfg.attention)
    peak = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads).get(compute_dtype(cfg.variant))
    out = {"param_bytes": planner.param_bytes(m, weights), "flops": flops, "loss_delta": 0.0,
           "optimizer_bytes": planner.adamw_state_bytes(m, master_copy=cfg.variant == "bf16_weights")}
    if peak:
        step_s = flops / (peak * 1e12)
        out.update(tflops=peak, step_ms=step_s * 1e3, tokens_per_s=cfg.batch_size * cfg.seq_len / step_s)
    plan = planner.training_memory(m, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                   precision=cfg.variant, device=cfg.device)
    out.update(peak_mem_bytes=plan.total_bytes, activation_bytes=plan.activation_bytes)
    return out


def notes(cfg: Config) -> dict[str, str]:
    """What to read in the numbers, for this variant on this device."""
    out = {"step_ms": "predicted: the step's FLOPs at the device's peak (the datasheet's on a GPU, "
                      "on a CPU its physical ceiling from cores, FMA units, vector width and clock): "
                      "a bound; `labkit env` shows how much of it a plain matmul reaches here."}
    if cfg.variant in AUTOCAST:
        out["activation_bytes"] = (
            "Autocast casts the inputs of matmul-type ops (linear, matmul, SDPA) to 16 bits and "
            "saves those casts (the weights' casts are counted apart, in "
            "saved_weight_copy_bytes); the rest keeps its dtype: the residual stream stays fp32 "
            "(fp32 + 16-bit promotes to fp32), RMSNorm and RoPE compute in fp32 on purpose (a "
            "16-bit sum of squares loses precision), and the loss uses fp32 logits. So saved "
            "bytes shrink by less than 2x.")
        out["saved_weight_copy_bytes"] = (
            "16-bit copies of the fp32 weights that autocast makes and keeps for backward: a "
            "per-step cost independent of batch size that can outweigh the activation saving "
            "at small batches.")
    if cfg.variant == "bf16_weights":
        out["activation_bytes"] = ("Weights in bf16: activations are bf16 except where the model "
                                   "upcasts on purpose (RMSNorm, RoPE, the fp32 logits of the loss).")
    if not cfg.device.startswith("cuda") and cfg.variant in ("fp16", "bf16", "bf16_weights"):
        cpu, kind = hardware.cpu_info(), cfg.variant[:4]
        native = {"fp16": ("avx512_fp16", "amx_fp16")}.get(kind, ("avx512_bf16", "amx_bf16"))
        if not set(native) & set(cpu.flags):
            out["step_ms"] = (f"no {kind} speed-up on this CPU ({cpu.model}): it has no "
                              f"{' or '.join(native)}, so {kind} matmuls are converted and run "
                              "many times slower than fp32; expect a slowdown, not a speed-up.")
    if cfg.variant == "fp16":
        out["loss_scale"] = "GradScaler's scale after the run; it halves on every skipped step."
    return out
