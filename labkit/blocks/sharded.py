"""A training step over sharded parameters (DTensors: tensor parallel, FSDP2, both), as the
tensor_parallel and hybrid experiments build, run and check it:

- `check_tp_shape`: what a tensor-parallel split needs of the model and the dtype;
- `corrupt_row_outputs`: fault=corrupt_reduction's hooks on the row-parallel matmuls;
- `build_sharded_step`: the plain step, transformed, cut to this rank's rows, then the optimizer
  built over the sharded parameters; its gradients kept at rest (tensor parallelism lays each
  out as its parameter before the update: `transforms.match_grad_placements`); `train_step`: one
  step of it, and `backward`, which lays them out at once;
- whole tensors from shards for the check: `full_grads` (every gradient), `full_tensor` (one
  tensor, also from an offloaded shard).
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from labkit.config import ConfigError
from labkit.blocks.distributed import DistConfig
from labkit.blocks.training import Trainer
from labkit.blocks.transforms import match_grad_placements

# Row-parallel matmuls sum n partial products in another order than one matmul does: a few fp32
# ulps (1.2e-7 each) on the logits, normwise on the gradients.
TP_TOLERANCE = 1e-5


def check_tp_shape(cfg: DistConfig, n: int) -> None:
    """DTensor splits heads evenly; unlike Megatron it cannot replicate kv heads across ranks."""
    m = cfg.model
    if m.num_heads % n or m.num_kv_heads % n:
        valid = [d for d in range(1, m.num_kv_heads + 1) if m.num_kv_heads % d == 0]
        raise ConfigError(f"tensor parallel degree {n} must divide num_heads={m.num_heads} and "
                          f"num_kv_heads={m.num_kv_heads}; valid degrees: {valid} (set nproc, or "
                          "num_kv_heads)")
    if m.tie_embeddings:
        raise ConfigError("tensor parallel splits the embedding by rows and the head by columns: "
                          "they cannot share a tied weight; use tie_embeddings=False")
    if cfg.dtype != "float32":
        raise ConfigError(f"tensor parallel is checked in float32 (got {cfg.dtype})")


def corrupt_row_outputs(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """fault=corrupt_reduction: this rank's partial products of every wo and w2 multiplied by
    `scale` before RowwiseParallel sums them across ranks. Call before `apply_tp`: a module's
    forward hooks run in the order they were registered, so these see the unreduced output."""
    def hook(module, args, out):  # out: DTensor, Partial (one rank's share of the sum)
        return DTensor.from_local(out.to_local() * scale, out.device_mesh, out.placements,
                                  shape=out.shape, stride=out.stride(), run_check=False)

    for block in model.layers:
        block.attn.wo.register_forward_hook(hook)
        block.mlp.w2.register_forward_hook(hook)
    return model


def build_sharded_step(cfg: DistConfig, apply: Callable[[Trainer], Trainer] | None = None,
                       rows: slice = slice(None)) -> Trainer:
    """The plain training step, its model transformed by `apply` (a step transform: tensor
    parallel, FSDP, both) and its batch cut to this rank's `rows`, then the optimizer built, so
    that it sees the sharded parameters. Each step drops the previous step's gradients first, so
    its own stay at rest after it (where `grad_bytes` is measured: local shards); no gradient
    norm (on DTensors it would add collectives to the step)."""
    trainer = Trainer(cfg, optimizer=False)
    if apply is not None:
        apply(trainer)
    trainer.inputs, trainer.targets = trainer.inputs[rows], trainer.targets[rows]  # (b, T) of this rank
    trainer.sizes = [len(trainer.inputs)]
    trainer.grads_at_rest, trainer.measure_norm = True, False
    trainer.build_optimizer()
    return trainer


def train_step(trainer: Trainer) -> float:
    """One step of a trainer `build_sharded_step` made (its gradients kept at rest, laid out as
    their parameters, no norm): `Trainer.step` with those options."""
    return trainer.step()


def backward(trainer: Trainer, loss: torch.Tensor) -> None:
    """The step's backward, then every gradient laid out as its parameter (at once, for a check
    that counts the collectives of the backward)."""
    trainer.backward(loss)
    match_grad_placements(trainer.model)


def grads(trainer: Trainer) -> list[torch.Tensor]:
    return [p.grad for p in trainer.model.parameters() if p.grad is not None]


def full_grads(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Host copies of every gradient, gathered whole (same order on every rank: collectives)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[name] = g.detach().cpu().numpy().copy()
    return out


def full_tensor(p: torch.Tensor, device: str) -> torch.Tensor:
    """The whole tensor on every rank (a collective for DTensors). An offloaded shard is on the
    host while the mesh's collectives (NCCL) are on the GPU: gather a device copy."""
    if not isinstance(p, DTensor):
        return p.detach()
    local = DTensor.from_local(p.to_local().detach().to(device), p.device_mesh, p.placements,
                               shape=p.shape, stride=p.stride(), run_check=False)
    return local.full_tensor()
