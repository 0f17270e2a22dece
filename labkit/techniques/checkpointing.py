"""Activation checkpointing: keep fewer activations for backward and recompute the rest.

`apply_checkpointing(model, mode, ...)` wraps chosen decoder blocks in non-reentrant
`torch.utils.checkpoint`; the model itself stays unchanged (a transform from outside).
- `full`: every block saves only its input; its forward runs again in backward.
- `every_n`: every n-th block, a middle ground.
- `selective`: every block, but the outputs of matmul-type ops are kept (they are costly to
  recompute) and the cheap elementwise ops (norms, activations, RoPE, softmax) are recomputed.
- `blocks`: an explicit set of block indices (what the memory-budget variant chooses).
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from labkit.model import Decoder

aten = torch.ops.aten
CHECKPOINT_MODES = ("none", "full", "every_n", "selective", "blocks")
# Ops whose outputs selective checkpointing keeps: the matmuls (and attention) hold the FLOPs.
SAVED_BY_SELECTIVE = {aten.mm.default, aten.addmm.default, aten.bmm.default,
                      aten._scaled_dot_product_flash_attention_for_cpu.default,
                      aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_cudnn_attention.default}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed_blocks(num_layers: int, mode: str, *, every: int = 2,
                        blocks: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Indices of the blocks a mode wraps."""
    if mode == "none":
        return ()
    if mode == "every_n":
        return tuple(range(0, num_layers, every))
    if mode == "blocks":
        return tuple(sorted(set(blocks)))
    return tuple(range(num_layers))


def apply_checkpointing(model: Decoder, mode: str, *, every: int = 2,
                        blocks: tuple[int, ...] = ()) -> Decoder:
    """Wrap the chosen blocks' forward in `torch.utils.checkpoint` (in place; returns the model)."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"unknown checkpointing mode {mode!r}; valid: {', '.join(CHECKPOINT_MODES)}")
    context_fn = (functools.partial(create_selective_checkpoint_contexts, _selective_policy)
                  if mode == "selective" else None)
    for i in checkpointed_blocks(len(model.layers), mode, every=every, blocks=blocks):
        block = model.layers[i]
        block.forward = _checkpointed(block.forward, context_fn)
    return model


def _checkpointed(forward, context_fn):
    kwargs = {"context_fn": context_fn} if context_fn else {}

    @functools.wraps(forward)
    def run(*args):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run
