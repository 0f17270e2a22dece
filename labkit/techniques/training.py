"""The plain training step every training experiment starts from: the decoder, one fixed seeded
batch, next-token cross-entropy on fp32 logits, AdamW, `zero_grad(set_to_none=True)`.

Techniques change it from outside: a precision context (`Trainer.precision`), a transformed model
(checkpointing), a different backward/step (`Trainer.backward_and_update`), or several
micro-batches per step.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import torch.nn.functional as F

from labkit.config import RunConfig
from labkit.model import build_model
from labkit.workload import Comparison


def make_batch(cfg: RunConfig, batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded token ids: inputs (B, T) and next-token targets (B, T), on the config's device."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    batch = torch.randint(0, cfg.model.vocab_size, (batch_size or cfg.batch_size, cfg.seq_len + 1),
                          generator=gen).to(cfg.device)
    return batch[:, :-1], batch[:, 1:]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed on fp32 logits whatever the model's dtype."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def total_norm(params) -> float:
    """The global L2 norm of the gradients (nan when there are none)."""
    grads = [p.grad.float() for p in params if p.grad is not None]
    if not grads:
        return math.nan
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


class CopyAdamW:
    """AdamW on copies of the weights, elsewhere or in another dtype: fp32 master copies of
    16-bit weights on their device (`dtype=torch.float32`), or host copies (`device="cpu"`).
    Each step hands the gradients to the copies (upcast to `dtype`; with `device`, copied into
    staging buffers there, pinned when `pin_memory`, so a GPU copies asynchronously), updates the
    copies and copies the result back into the weights (rounding to their dtype)."""

    def __init__(self, params, lr: float, *, dtype: torch.dtype | None = None,
                 device: str | None = None, pin_memory: bool = False):
        self.params = list(params)
        self.copies = [torch.nn.Parameter(torch.empty_like(p, dtype=dtype, device=device,
                                                           pin_memory=pin_memory))
                       for p in self.params]
        # with `device`: gradient staging buffers there, allocated once
        self.staging = [torch.empty_like(c, pin_memory=pin_memory) if device else None
                        for c in self.copies]
        with torch.no_grad():
            for c, p in zip(self.copies, self.params):
                c.copy_(p)
        self.inner = torch.optim.AdamW(self.copies, lr=lr)
        # gradients to the copies and weights back, per step
        self.bytes_per_step = sum(2 * p.numel() * p.element_size() for p in self.params)

    @torch.no_grad()
    def step(self) -> None:
        for p, c, g in zip(self.params, self.copies, self.staging):
            c.grad = None if p.grad is None else (
                p.grad.to(c.dtype) if g is None else g.copy_(p.grad, non_blocking=True))
        if self.staging[0] is not None and self.params[0].is_cuda:
            # The gradients must land before the CPU reads them; this also orders the previous
            # step's weight copies (which read the host weights) before the update rewrites them.
            torch.cuda.synchronize(self.params[0].device)
        self.inner.step()
        for p, c in zip(self.params, self.copies):
            p.copy_(c, non_blocking=True)  # from pinned memory: asynchronous, ordered on the stream
            c.grad = None  # an upcast gradient is freed here; a staging buffer stays

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def state_tensors(self) -> list[torch.Tensor]:
        """The copies and AdamW's moments (and step counters)."""
        return self.copies + optimizer_state(self.inner)


class Trainer:
    """A model, one fixed batch and AdamW; `step()` is one training step and returns the loss."""

    def __init__(self, cfg: RunConfig, *, weights: torch.dtype = torch.float32, lr: float = 1e-3):
        self.cfg = cfg
        self.model = build_model(cfg.model, device=cfg.device, dtype=weights, seed=cfg.seed,
                                 attention=cfg.attention)
        self.inputs, self.targets = make_batch(cfg)
        self.optimizer = self.make_optimizer(lr)
        self.grad_norm, self.losses = math.nan, []

    def make_optimizer(self, lr: float):
        return torch.optim.AdamW(self.model.parameters(), lr=lr)

    def precision(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def forward(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of a batch (the trainer's own by default)."""
        inputs = self.inputs if inputs is None else inputs
        targets = self.targets if targets is None else targets
        with self.precision():
            return lm_loss(self.model(inputs), targets)

    def backward_and_update(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.grad_norm = total_norm(self.model.parameters())
        self.optimizer.step()

    def step(self) -> float:
        loss = self.forward()
        self.backward_and_update(loss)
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        return self.losses[-1]

    def accumulate_grads(self, pieces) -> float:
        """Forward and backward of each (inputs, targets, weight) piece; the gradients add up in
        `.grad` (weights summing to 1 give the mean gradient of all the pieces' sequences, as one
        batch would). Each piece's activations are freed by its backward. Returns the loss."""
        total = 0.0
        for inputs, targets, weight in pieces:
            loss = self.forward(inputs, targets) * weight
            loss.backward()
            total += loss.item()
        return total

    def train(self, steps: int) -> dict[str, object]:
        """`steps` steps; the losses and the last gradient norm (what `check()` compares)."""
        for _ in range(steps):
            self.step()
        return {"losses": list(self.losses), "grad_norm": self.grad_norm}

    def optimizer_tensors(self) -> list[torch.Tensor]:
        return optimizer_state(self.optimizer)


def step_with_gradients(trainer: Trainer) -> dict:
    """One training step; its loss and host copies of the gradients it applied. numpy copies:
    they stay outside the harness's memory meter (and off the GPU) while kept for comparisons."""
    loss = trainer.forward()
    loss.backward()
    grads = {n: p.grad.detach().cpu().numpy().copy() for n, p in trainer.model.named_parameters()}
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return {"loss": loss.item(), "grads": grads}


def gradient_difference(reference: dict, grads: dict) -> tuple[float, float]:
    """The largest absolute difference over all parameters, and the largest normwise relative
    one, ||g - g_ref|| / ||g_ref|| per tensor (elementwise ratios blow up where g_ref ~ 0); where
    g_ref is all zeros, that tensor's largest absolute difference. Both are nan when any gradient
    holds a nan (never a match). Every name in `reference` must be in `grads` with its shape
    (a ValueError otherwise); names only in `grads` are not compared."""
    max_abs = max_rel = 0.0
    for name, ref in reference.items():
        got = grads.get(name)
        if got is None or got.shape != ref.shape:
            found = "missing" if got is None else f"shape {tuple(got.shape)}"
            raise ValueError(f"gradient {name!r}: {found}, the reference's is {tuple(ref.shape)}")
        diff = got.astype(np.float64) - ref
        largest = float(np.abs(diff).max()) if diff.size else 0.0
        norm = float(np.linalg.norm(ref))
        # np.maximum keeps a nan; the builtin max(0.0, nan) is 0.0, and a nan gradient would pass
        max_abs = float(np.maximum(max_abs, largest))
        max_rel = float(np.maximum(max_rel, float(np.linalg.norm(diff)) / norm if norm else largest))
    return max_abs, max_rel


def compare_grads(reference: dict, outputs: dict, tolerance: float, *,
                  extra: dict[str, float] | None = None, limits: dict[str, float] | None = None,
                  reported: dict[str, float] | None = None) -> Comparison:
    """`outputs["grads"]` against `reference["grads"]` (`gradient_difference`): a match when the
    normwise relative difference and every `extra` difference are within `tolerance` (or that
    difference's own limit in `limits`); a nan never matches. Metrics, in order: `reported`
    (default: `outputs["loss"]`; shown, not checked), `extra`, grad_max_abs_diff,
    grad_max_rel_diff. The message names every checked difference and its limit."""
    max_abs, max_rel = gradient_difference(reference["grads"], outputs["grads"])
    extra, limits = extra or {}, limits or {}
    checked = {"gradients max relative": (max_rel, tolerance),
               **{name: (value, limits.get(name, tolerance)) for name, value in extra.items()}}
    ok = all(value <= limit for value, limit in checked.values())
    message = "" if ok else ", ".join(f"{name} {value:.2e} (<= {limit:g})"
                                      for name, (value, limit) in checked.items())
    reported = {"loss": outputs["loss"]} if reported is None else reported
    return Comparison({**reported, **extra, "grad_max_abs_diff": max_abs,
                       "grad_max_rel_diff": max_rel}, ok, message)
