"""Gradient accumulation: k micro-batches of b sequences, one optimizer step, against one batch of k*b.

- `one_batch` (the reference): one forward and backward over all k*b sequences.
- `accumulate`: k forwards and backwards of b sequences each, every micro-batch's loss scaled by
  1/k, the gradients summing in `.grad`; then one optimizer step.
The mean loss over k equal micro-batches is the mean over the whole batch, so the gradients are
the same up to the order of the sums (fp32 rounding). Activations are held for one micro-batch at
a time: the peak follows b, not k*b, while every step still trains on k*b*T tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit import hardware, planner
from labkit.config import ConfigError, RunConfig, knob

from labkit.blocks.training import Trainer, compare_grads, step_with_gradients
from labkit.blocks.transforms import apply_accumulation
from labkit.workload import Comparison, Workload

VARIANTS = ("one_batch", "accumulate")
REFERENCE = "one_batch"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"batch_size": 2, "micro_batches": 2}, {"batch_size": 2, "micro_batches": 2, "seq_len": 32, "num_layers": 2})

# Normwise relative gradient difference (||g - g_ref|| / ||g_ref|| per parameter) allowed against
# one batch: k partial sums round differently from one sum, a few fp32 ulps (1.2e-7 each).
TOLERANCE = 1e-6


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="one batch of k*b, or k micro-batches of b")
    micro_batches: int = knob(4, min=1, help="k: micro-batches per optimizer step (batch_size is one)")


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"grad_accumulation trains in float32 (got {cfg.dtype}); precision is "
                          "the mixed_precision experiment's knob")


def accumulation_step(cfg: Config) -> Trainer:
    """The plain training step over a batch of k*b sequences, in one piece or, accumulating, in k
    micro-batches of b (`apply_accumulation`): views of the one batch, the same sequences as the
    reference, in order. The k*b sequences of token ids stay on the device (8 bytes a token)."""
    trainer = Trainer(cfg, batch_size=cfg.batch_size * cfg.micro_batches)  # (k*b, T)
    if cfg.variant == "accumulate":
        apply_accumulation(trainer, [cfg.batch_size] * cfg.micro_batches)
    return trainer


def build(cfg: Config) -> Workload:
    trainer = accumulation_step(cfg)
    piece = next(trainer.micro_batches())
    return Workload(
        step=trainer.step, check=lambda: step_with_gradients(trainer),
        tokens_per_step=cfg.micro_batches * cfg.batch_size * cfg.seq_len,  # k*b*T for both
        forward=lambda: trainer.forward(piece.inputs, piece.targets),  # what one piece holds for its backward
        resident=trainer.model.parameters, notes=notes(cfg), compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Every parameter's gradient after one step from the same weights and batch, against one batch."""
    return compare_grads(reference, outputs, TOLERANCE)


def piece_size(cfg: Config) -> int:
    """Sequences in one forward: b when accumulating, k*b in one batch."""
    return cfg.batch_size * (1 if cfg.variant == "accumulate" else cfg.micro_batches)


def expected(cfg: Config) -> dict[str, float]:
    pieces = cfg.micro_batches if cfg.variant == "accumulate" else 1
    plan = planner.training_memory(cfg.model, batch_size=piece_size(cfg), seq_len=cfg.seq_len,
                                   precision="fp32", optimizer="adamw", device=cfg.device,
                                   accumulation_steps=pieces)
    tokens = cfg.micro_batches * cfg.batch_size * cfg.seq_len
    flops = cfg.micro_batches * planner.train_step_flops(cfg.model, batch=cfg.batch_size,
                                                         seq_len=cfg.seq_len, attention=cfg.attention)
    out = {"peak_mem_bytes": plan.total_bytes, "activation_bytes": plan.activation_bytes,
           "flops": flops}
    peak = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads).get(cfg.dtype)
    if peak:
        step_s = flops / (peak * 1e12)
        out.update(tflops=peak, step_ms=step_s * 1e3, tokens_per_s=tokens / step_s)
    return out


def notes(cfg: Config) -> dict[str, str]:
    k, b, piece = cfg.micro_batches, cfg.batch_size, piece_size(cfg)
    out = {"peak_mem_bytes": (
        f"predicted: the planner's step at {piece} sequences per forward (k={k}, b={b}). To set "
        "accumulation beside a plain step of b, sweep micro_batches (1 is that step): one_batch "
        "grows with k, accumulate stays flat, above the plain step by up to one gradient buffer "
        "(4 bytes per parameter): from the second micro-batch on, every gradient is held beside "
        "a micro-batch's activations."),
        "activation_bytes": f"held by one forward of {piece} sequences.",
        "tokens_per_s": (f"both train on k*b*T = {k * b * cfg.seq_len} tokens per step; k small "
                         "forwards use the device less well than one large one.")}
    if cfg.variant == "accumulate":
        out["grad_max_rel_diff"] = ("max over parameters of ||g - g_ref|| / ||g_ref||: not 0, "
                                    "since k partial sums round differently from one sum.")
    return out
