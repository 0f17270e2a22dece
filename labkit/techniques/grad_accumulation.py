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

from labkit.techniques.training import Trainer, compare_grads, make_batch, total_norm
from labkit.workload import Comparison, Workload

VARIANTS = ("one_batch", "accumulate")
REFERENCE = "one_batch"
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


class AccumulatingTrainer(Trainer):
    """The plain training step over a batch of k*b sequences, in one piece or in k micro-batches."""

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.inputs, self.targets = make_batch(cfg, cfg.batch_size * cfg.micro_batches)  # (k*b, T)
        pieces = cfg.micro_batches if cfg.variant == "accumulate" else 1
        # Views of the one batch, (b, T) each: the same sequences as the reference, in order. The
        # k*b sequences of token ids stay on the device (8 bytes a token: small beside the rest).
        self.pieces = list(zip(self.inputs.chunk(pieces), self.targets.chunk(pieces)))

    def accumulate(self) -> float:
        """Forward and backward of every piece, each loss scaled by 1/k; returns the batch's loss."""
        weight = 1 / len(self.pieces)
        return self.accumulate_grads([(inputs, targets, weight) for inputs, targets in self.pieces])

    def update(self) -> None:
        self.grad_norm = total_norm(self.model.parameters())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        self.losses.append(self.accumulate())
        self.update()
        return self.losses[-1]

    def step_with_gradients(self) -> dict:
        """One step; its loss and host copies of the gradients it applied (see checkpointing)."""
        loss = self.accumulate()
        grads = {n: p.grad.detach().cpu().numpy().copy() for n, p in self.model.named_parameters()}
        self.update()
        return {"loss": loss, "grads": grads}


def build(cfg: Config) -> Workload:
    trainer = AccumulatingTrainer(cfg)
    first = trainer.pieces[0]
    return Workload(
        step=trainer.step, check=trainer.step_with_gradients,
        tokens_per_step=cfg.micro_batches * cfg.batch_size * cfg.seq_len,  # k*b*T for both
        forward=lambda: trainer.forward(*first),  # what one piece holds for its backward
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
    peak = hardware.ceilings(cfg.device, num_threads=cfg.num_threads).peak_tflops.get(cfg.dtype)
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
