"""Context parallelism as a transform of a training step: each of a group's `cp` ranks holds a
share of every sequence's tokens (one contiguous block, or zig-zag's two pieces), and every
block's attention runs over the group: ring attention (`labkit.blocks.ring`) or Ulysses
(`labkit.blocks.ulysses`). `compose` applies it after tensor parallelism, before the
data-parallel wrapper, which then reduces the gradients over dp x cp.

    apply_context_parallel(trainer, "ring_zigzag", layout.cp_mesh, replicas=layout.dp)

Why the step stays the plain step of the global batch:
- the batch: each row's tokens cut into cp shards, laid out as rows (dp, cp, B, S/cp), so the
  wrapper over dp x cp, which hands rank d·cp + c its slice of the rows, hands it replica d's
  shard c;
- the positions: the decoder numbers a shard's tokens 0..S/cp-1; each attention rotates q and k
  by the shard's own positions (RoPE), and learned position embeddings look those up;
- the loss: each rank's mean over its B·S/cp tokens, an equal share of the global batch's, so
  the wrapper's average over the dp x cp ranks is the global batch's mean;
- the gradients: every shard's k and v reach every rank of the group (ring hops, all-to-alls),
  and their gradients travel back to their shard's rank in the backward, so each rank's gradient
  is its tokens' share of the whole loss's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from labkit.blocks import ring as rings
from labkit.blocks.model import apply_rope, rope_tables
from labkit.blocks.ulysses import ulysses_attention
from labkit.config import ModelConfig

CP_MODES = ("ring", "ring_zigzag", "ulysses")
SPLITS = {"ring": "contiguous", "ring_zigzag": "zigzag", "ulysses": "contiguous"}


def shape_refusal(model: ModelConfig, seq_len: int, mode: str, cp: int, tp: int = 1) -> str | None:
    """Why `seq_len` or the heads (each tensor-parallel rank's H/tp, KV/tp) do not split over
    `cp` ranks in `mode`, in one line; None where they do."""
    pieces = 2 * cp if SPLITS[mode] == "zigzag" else cp
    if seq_len % pieces:
        return (f"context_parallel={cp} ({mode}) cuts seq_len={seq_len} into {pieces} equal pieces: "
                f"use a multiple of {pieces}")
    heads, kv_heads = model.num_heads // tp, model.num_kv_heads // tp
    if mode == "ulysses" and (heads % cp or kv_heads % cp):
        return (f"ulysses gives each of context_parallel={cp} ranks a share of the heads: "
                f"{heads} query and {kv_heads} kv heads per rank (tensor_parallel={tp}) must both "
                f"be multiples of {cp}")
    return None


def output_copy_bytes(model: ModelConfig, batch: int, seq_len: int, cp: int, *, tp: int = 1,
                      layers: int | None = None, e: int = 4) -> int:
    """What a cp rank's forward keeps beyond the plain step of its seq_len/cp tokens (the
    planner's case): each block not recomputed (`layers`; None: all) keeps its attention output
    twice, as the ring or Ulysses made it (B, H, S/cp, hd) and as wo's (B, S/cp, H·hd) input, where
    SDPA's output is itself wo's input. B·(S/cp)·(H/tp)·hd·e bytes a block."""
    layers = model.num_layers if layers is None else layers
    return layers * batch * (seq_len // cp) * (model.num_heads // tp) * model.head_dim * e


@dataclass
class SequenceShard:
    """This rank's share of every sequence: its (start, length) `runs`, their global
    `positions` (S/cp,) in the order held, and how its attention reaches the group's other
    shards (`ring`, or Ulysses' all-to-alls); `rope`: the RoPE tables at those positions of the
    forward running (None for learned positions)."""

    mode: str
    seq_len: int
    runs: list[tuple[int, int]]
    positions: torch.Tensor
    group: object = field(default=None, repr=False)
    ring: rings.Ring | None = None
    rope: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def start_forward(self, model) -> None:
        """The RoPE tables at this shard's positions, made anew for each forward as the decoder
        makes its own (every block's backward holds them: activations of that forward)."""
        m = model.cfg
        self.rope = None if model.pos_embed is not None else rope_tables(
            self.positions, m.head_dim, m.rope_theta, m.rope_llama3)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this shard's queries over the whole sequence: (B, H, S/cp, hd)."""
        if self.ring is not None:
            return rings.ring_attention(q, k, v, self.ring)
        return ulysses_attention(q, k, v, causal=True, group=self.group)


def sharded_attention(attn, shard: SequenceShard, x: torch.Tensor, start_pos, cache, impl, rope,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """`model.Attention.forward` on a sequence shard: the same projections (tensor-parallel
    shards included: the local head count), RoPE at the shard's own positions, and the group's
    attention in place of the local one."""
    if cache is not None or mask is not None:
        raise ValueError("context parallelism attends causally over whole rows: no cache, no mask")
    B, T, _ = x.shape
    hd = attn.cfg.head_dim
    q = attn.wq(x).view(B, T, -1, hd).transpose(1, 2)  # (B, H, S/cp, hd)
    k = attn.wk(x).view(B, T, -1, hd).transpose(1, 2)  # (B, KV, S/cp, hd)
    v = attn.wv(x).view(B, T, -1, hd).transpose(1, 2)
    if rope is not None:  # the decoder's tables number the shard 0..S/cp-1: not its positions
        q, k = apply_rope(q, *shard.rope), apply_rope(k, *shard.rope)
    y = shard.attend(q, k, v)
    return attn.wo(y.transpose(1, 2).reshape(B, T, -1))


def sequence_rows(t: torch.Tensor, replicas: int, n: int, split: str) -> torch.Tensor:
    """(replicas·B, S) rows -> (replicas·n·B, S/n): replica d's B rows cut into n shards, shard c
    at rows (d·n + c)·B onwards."""
    seq_len = t.shape[1]
    rows = t.reshape(replicas, -1, seq_len)  # (dp, B, S)
    shards = [rings.shard(rows, rings.pieces(seq_len, n, c, split), dim=2) for c in range(n)]
    return torch.stack(shards, 1).reshape(-1, seq_len // n)


def apply_context_parallel(trainer, mode: str, mesh, *, replicas: int = 1):
    """The step's model and batch split along the sequence over `mesh` (1-D, cp ranks): the
    global batch's `replicas` x B rows become shards laid out as rows (`sequence_rows`; the
    data-parallel wrapper over dp x cp takes this rank's), every block's attention becomes
    `sharded_attention` over the group. `trainer.sequence_shard` is this rank's shard."""
    if mode not in CP_MODES:
        raise ValueError(f"unknown cp_mode {mode!r}; valid: {', '.join(CP_MODES)}")
    n, r, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    model, split, seq_len = trainer.model, SPLITS[mode], trainer.inputs.shape[1]
    trainer.inputs, trainer.targets = (sequence_rows(t, replicas, n, split)
                                       for t in (trainer.inputs, trainer.targets))
    trainer.sizes = [len(trainer.inputs)]
    runs = rings.pieces(seq_len, n, r, split)
    ring = rings.Ring(seq_len=seq_len, split=split, group=group) if mode != "ulysses" else None
    shard = SequenceShard(mode, seq_len, runs, rings.positions(runs).to(trainer.cfg.device), group, ring)
    model.register_forward_pre_hook(lambda module, args: shard.start_forward(module))
    for block in model.layers:
        block.attn.forward = functools.partial(sharded_attention, block.attn, shard)
    if model.pos_embed is not None:  # GPT-2's learned positions: this shard's rows of the table
        model.pos_embed.register_forward_pre_hook(lambda module, args: (shard.positions,))
    trainer.sequence_shard = shard
    return trainer
