"""The plain training step every training experiment starts from: the decoder, one fixed seeded
batch, next-token cross-entropy on fp32 logits, AdamW, `zero_grad(set_to_none=True)`.

Techniques change it from outside, through the transforms of `labkit.blocks.transforms`, each of
which sets a part of `Trainer`: context managers around every forward (`contexts`: autocast,
saved-tensor hooks), a wrapped or transformed model (`net`, `model`: DDP, FSDP2, checkpointing),
the micro-batches of one step (`sizes`), a scaled loss (`scaler`), hooks on the final gradients
(`grad_hooks`) or the optimizer (`optimizer_factory`). `Trainer.step` is the one training loop:
an experiment that needs another order or source sets one of its options (gradients kept at
rest, a data source, a meter around each phase, a reduction by hand, a pipeline schedule) rather
than calling the optimizer itself.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel

from labkit.blocks.losses import IGNORE, lm_loss
from labkit.blocks.moe import add_aux_loss
from labkit.config import RunConfig
from labkit.model import build_model
from labkit.workload import Comparison


def make_batch(cfg: RunConfig, batch_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded token ids: inputs (B, T) and next-token targets (B, T), on the config's device."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    batch = torch.randint(0, cfg.model.vocab_size, (batch_size or cfg.batch_size, cfg.seq_len + 1),
                          generator=gen).to(cfg.device)
    return batch[:, :-1], batch[:, 1:]


class Piece(NamedTuple):
    """One micro-batch: its rows, their targets, its loss's weight, its document ids (or None)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    weight: float
    document_ids: torch.Tensor | None


def optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def total_norm(params) -> float:
    """The global L2 norm of the gradients (nan when there are none), accumulated in fp32 one
    gradient at a time: a 16-bit gradient's fp32 copy lives only for its own norm, so measuring
    the norm adds no whole-model temporary to the step it reports on. A sharded (DTensor)
    gradient's norm is made whole first (a collective): tensor-parallel and data-parallel-only
    parameters live on different meshes, and their norms do not stack."""
    from torch.distributed.tensor import DTensor

    norms = [torch.linalg.vector_norm(p.grad, dtype=torch.float32) for p in params if p.grad is not None]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    if not norms:
        return math.nan
    return torch.linalg.vector_norm(torch.stack(norms)).item()


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
    """The training step as a value: a model, one fixed batch, an optimizer, and the parts of the
    step function that the transforms in `labkit.blocks.transforms` set. `step()` is one training
    step and returns the loss.

    The parts, each plain by default:
    - `net`: what the forward calls (the model, or its data-parallel wrapper);
    - `contexts`: context managers entered around every forward (autocast, saved-tensor hooks);
    - `sizes`: the micro-batches, consecutive rows of the batch, of one optimizer step; each
      loss is weighted by its share, so the gradient is the batch's mean (one piece: the plain
      step, unweighted);
    - `document_ids` (rows, T) of a packed batch (`labkit.blocks.packing`): each forward gets its
      rows' ids, so each token attends within its document; `loss_tokens`: the tokens with a
      target per rank's batch (a packed or padded batch ignores some), so each piece's mean loss
      is weighted by its own such tokens over them and the gradient is the mean over every token
      with a target, whatever the pieces and ranks hold (None: by rows);
    - `loss_weight` and `scaler` (a GradScaler): the backward of `loss * loss_weight`, scaled;
    - `grad_hooks`: called with the trainer on the final (unscaled) gradients, before the update;
    - `optimizer_factory(params, lr)`: how the optimizer is built, once, after the transforms
      (`build_optimizer`, over the parameters that train), since its states take their dtype,
      device and shard from the weights.

    The options of the loop, each off by default:
    - `grads_at_rest`: the previous step's gradients are dropped at the start of a step, not after
      its update, so each step's stay until the next one (where gradient bytes are measured);
    - `measure_norm` (on): the gradient norm before each update (on DTensors it adds collectives);
    - `sync_each_micro_batch`: DDP all-reduces in every micro-batch's backward, not the last only;
    - `reduce_grads(trainer)`: a data-parallel reduction by hand, after the last backward;
    - `batches()`: a data source, called for each step's (inputs, targets) instead of the fixed
      batch (the `data` phase);
    - `phase(name)`: a context manager entered around each phase (`data`, `forward`, `backward`,
      `optimizer`): a meter, a marker, a range for a profiler;
    - `forward_backward()`: the forwards and backwards of one step by another schedule (a
      pipeline's), returning its loss, in place of the micro-batch loop.
    """

    def __init__(self, cfg: RunConfig, *, weights: torch.dtype = torch.float32, lr: float = 1e-3,
                 batch_size: int | None = None, optimizer: bool = True,
                 model: torch.nn.Module | None = None):
        self.cfg, self.lr = cfg, lr
        self.model = model if model is not None else build_model(
            cfg.model, device=cfg.device, dtype=weights, seed=cfg.seed, attention=cfg.attention)
        self.net = self.model
        self.inputs, self.targets = make_batch(cfg, batch_size)
        self.document_ids: torch.Tensor | None = None
        self.loss_tokens: float | None = None
        self.sizes = [len(self.inputs)]
        self.contexts: list[Callable[[], contextlib.AbstractContextManager]] = []
        self.loss_weight, self.scaler, self.skipped_steps = 1.0, None, 0
        self.host_hooks = None  # activation offload's saved-tensor hooks, when applied
        self.grad_hooks: list[Callable[[Trainer], None]] = []  # run on the final gradients
        self.optimizer_factory: Callable[..., Any] = adamw
        self.grads_at_rest, self.measure_norm, self.sync_each_micro_batch = False, True, False
        self.reduce_grads: Callable[[Trainer], None] | None = None
        self.batches: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
        self.phase: Callable[[str], contextlib.AbstractContextManager] = no_phase
        self.forward_backward: Callable[[], float] | None = None
        self.optimizer = self.build_optimizer() if optimizer else None
        self.grad_norm, self.losses = math.nan, []

    def build_optimizer(self):
        """The optimizer over the parameters that train (a frozen one gets no state)."""
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self.optimizer_factory(trained, self.lr)
        return self.optimizer

    def forward(self, inputs: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of a batch (the trainer's own by default, with its document ids)."""
        if inputs is None:
            inputs, targets, document_ids = self.inputs, self.targets, self.document_ids
        documents = {} if document_ids is None else {"document_ids": document_ids}
        with contextlib.ExitStack() as stack:
            for context in self.contexts:
                stack.enter_context(context())
            if getattr(self.model, "loss_chunk", 0):  # the head and the loss fused in its forward
                loss = self.net(inputs, targets=targets, **documents)
            else:
                loss = lm_loss(self.net(inputs, **documents), targets)
            return add_aux_loss(self.model, loss)  # + an MoE's load-balancing loss

    def micro_batches(self) -> Iterator[Piece]:
        """Each micro-batch: consecutive rows, weighted by its share of the rows, or of the
        tokens with a target (`loss_tokens`)."""
        ids = self.document_ids
        if len(self.sizes) == 1 and self.loss_tokens is None:
            yield Piece(self.inputs, self.targets, 1.0, ids)
            return
        total, start = sum(self.sizes), 0
        for size in self.sizes:
            rows = slice(start, start + size)
            targets = self.targets[rows]
            weight = (size / total if self.loss_tokens is None
                      else int((targets != IGNORE).sum()) / self.loss_tokens)
            yield Piece(self.inputs[rows], targets, weight, None if ids is None else ids[rows])
            start += size

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss * self.loss_weight if self.loss_weight != 1.0 else loss
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def record_grads(self) -> None:
        if self.measure_norm:
            self.grad_norm = total_norm(self.model.parameters())
        for hook in self.grad_hooks:
            hook(self)

    def drop_grads(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def update(self) -> None:
        """The optimizer step on the accumulated gradients (unscaled first, and skipped by the
        scaler when they hold inf or nan), then the gradients dropped (unless kept at rest)."""
        if self.scaler is None:
            self.record_grads()
            self.optimizer.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.unscale_(self.optimizer)
            self.record_grads()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.skipped_steps += self.scaler.get_scale() < scale  # the scale halves on a skip
        if not self.grads_at_rest:
            self.drop_grads()

    def accumulate(self, sync: bool = True) -> float:
        """Forward and backward of every micro-batch; the gradients add up in `.grad`, and each
        micro-batch's activations are freed by its backward. Returns the batch's loss. Without
        `sync` no gradient leaves this rank (DDP's no_sync throughout, no reduction by hand)."""
        if self.forward_backward is not None:
            return self.forward_backward()
        total, last = 0.0, len(self.sizes) - 1
        ddp = isinstance(self.net, DistributedDataParallel)
        for i, (inputs, targets, weight, ids) in enumerate(self.micro_batches()):
            # Under DDP the gradients are all-reduced in the last micro-batch's backward only
            # (unless `sync_each_micro_batch`). FSDP2 reduce-scatters in every one: skipping it
            # would keep whole gradients.
            local = ddp and (not sync or (i < last and not self.sync_each_micro_batch))
            with self.net.no_sync() if local else contextlib.nullcontext():
                with self.phase("forward"):
                    loss = self.forward(inputs, targets, ids)
                    loss = loss * weight if weight != 1.0 else loss
                with self.phase("backward"):
                    self.backward(loss)
            total += loss.item()
        if sync and self.reduce_grads is not None:
            self.reduce_grads(self)
        return total

    def step(self) -> float:
        """One training step: the previous gradients dropped (when kept at rest), the next batch
        (when there is a data source), every micro-batch's forward and backward, the update."""
        if self.grads_at_rest:
            self.drop_grads()
        if self.batches is not None:
            with self.phase("data"):
                self.inputs, self.targets = self.batches()
        self.losses.append(self.accumulate())
        with self.phase("optimizer"):
            self.update()
        return self.losses[-1]

    def train(self, steps: int) -> dict[str, object]:
        """`steps` steps; the losses and the last gradient norm (what `check()` compares)."""
        for _ in range(steps):
            self.step()
        return {"losses": list(self.losses), "grad_norm": self.grad_norm}

    def optimizer_tensors(self) -> list[torch.Tensor]:
        """This rank's optimizer states: a CopyAdamW's copies and moments, a
        ZeroRedundancyOptimizer's shard (its `.optim`), or the optimizer's own. (Imported here:
        torch.distributed.optim brings FSDP, 1 s of every process start on the reference CPU.)"""
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(self.optimizer, CopyAdamW):
            return self.optimizer.state_tensors()
        if isinstance(self.optimizer, ZeroRedundancyOptimizer):
            return optimizer_state(self.optimizer.optim)
        return optimizer_state(self.optimizer)


def no_phase(name: str) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def adamw(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


def step_with_gradients(trainer: Trainer) -> dict:
    """One training step; its loss and host copies of the gradients it applied. numpy copies:
    they stay outside the harness's memory meter (and off the GPU) while kept for comparisons."""
    if trainer.grads_at_rest:
        trainer.drop_grads()
    loss = trainer.accumulate()
    grads = {n: p.grad.detach().float().cpu().numpy().copy()  # numpy has no bf16
             for n, p in trainer.model.named_parameters()}
    trainer.update()
    return {"loss": loss, "grads": grads}


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
        diff = np.subtract(got, ref, dtype=np.float64)
        largest = float(max(diff.max(), -diff.min())) if diff.size else 0.0  # nan stays nan
        norm = _norm(ref)
        # np.maximum keeps a nan; the builtin max(0.0, nan) is 0.0, and a nan gradient would pass
        max_abs = float(np.maximum(max_abs, largest))
        max_rel = float(np.maximum(max_rel, _norm(diff) / norm if norm else largest))
    return max_abs, max_rel


def _norm(x: np.ndarray) -> float:
    return math.sqrt(_squares(x))


def _squares(x: np.ndarray) -> float:
    """The sum of squares in float64, without BLAS: numpy's threaded OpenBLAS (dnrm2) took 7.7 ms
    of CPU for a million float64 values here, its threads spinning on the cores the ranks need;
    this loop takes 0.5 ms."""
    flat = x.astype(np.float64, copy=False).ravel()
    return float(np.einsum("i,i", flat, flat))


def global_relative_difference(reference: dict, got: dict) -> float:
    """||got - reference|| / ||reference|| over every tensor together (float64; nan when any
    value is nan). For weights after AdamW steps, where a per-tensor ratio misleads: a tensor
    that starts at zero (a bias) moves by about lr per step whatever its gradient's size, so a
    sign that rounding flips in a near-zero gradient is a whole lr against a tiny norm."""
    diff = sum(_squares(np.subtract(got[n], ref, dtype=np.float64)) for n, ref in reference.items())
    norm = sum(map(_squares, reference.values()))
    return math.sqrt(diff / norm) if norm else math.sqrt(diff)


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
