"""Ulysses (DeepSpeed-Ulysses, arXiv 2309.14509): all-to-all from sequence shards to head shards,
attention over the whole sequence on H/n heads here, and all-to-all back.

Rank r holds tokens rL..(r+1)L-1 (L = S/n) of every head: (B, H, L, D). `SeqToHeads` sends the
j-th H/n of its heads to rank j and receives every rank's tokens of its own heads: (B, H/n, S, D);
`HeadsToSeq` is the inverse, and each is the other's backward, so autograd sees one op.
H and KV must both divide by n: rank r's q heads rH/n.. read kv heads rKV/n.., as SDPA's
enable_gqa maps them (q head h reads kv head h // G).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit.blocks.distributed import release_buffers


def heads_refusal(heads: int, kv_heads: int, n: int) -> str | None:
    """Why Ulysses cannot split these heads over n ranks, in one line (None: it can)."""
    if heads % n or kv_heads % n:
        return (f"ulysses splits heads over the ranks: num_heads={heads} and num_kv_heads="
                f"{kv_heads} must both be multiples of nproc={n}")
    return None


def _all_to_all(send: torch.Tensor, group) -> torch.Tensor:
    """(n, ...) chunks: chunk j goes to rank j; chunk j of the result came from rank j."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def seq_to_heads(x: torch.Tensor, n: int, group=None) -> torch.Tensor:
    """(B, H, L, D) this rank's tokens of every head -> (B, H/n, n·L, D) every token of its heads."""
    b, h, length, d = x.shape
    send = x.reshape(b, n, h // n, length, d).transpose(0, 1).contiguous()  # (n, B, H/n, L, D)
    recv = _all_to_all(send, group)  # chunk j: rank j's L tokens, in sequence order
    out = recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * length, d)
    release_buffers((send, recv), keep=(x, out))
    return out


def heads_to_seq(x: torch.Tensor, n: int, group=None) -> torch.Tensor:
    """(B, H/n, S, D) every token of this rank's heads -> (B, H, S/n, D) its tokens of every head."""
    b, h, seq, d = x.shape
    send = x.reshape(b, h, n, seq // n, d).permute(2, 0, 1, 3, 4).contiguous()  # (n, B, H/n, L, D)
    recv = _all_to_all(send, group)  # chunk j: rank j's heads of this rank's tokens
    out = recv.transpose(0, 1).reshape(b, n * h, seq // n, d)
    release_buffers((send, recv), keep=(x, out))
    return out


class Reshard(torch.autograd.Function):
    """`seq_to_heads` (to_heads) or `heads_to_seq`; its backward is the other one (saves nothing)."""

    @staticmethod
    def forward(ctx, x, n: int, group, to_heads: bool):
        ctx.n, ctx.group, ctx.to_heads = n, group, to_heads
        return (seq_to_heads if to_heads else heads_to_seq)(x, n, group)

    @staticmethod
    def backward(ctx, grad):
        back = heads_to_seq if ctx.to_heads else seq_to_heads
        return back(grad.contiguous(), ctx.n, ctx.group), None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                      group=None) -> torch.Tensor:
    """q (B, H, L, D), k, v (B, KV, L, D) of this rank's tokens -> its (B, H, L, D) output: four
    all-to-alls forward (q, k, v, out) and four backward."""
    n = dist.get_world_size(group) if dist.is_initialized() else 1
    if n == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    qh, kh, vh = (Reshard.apply(t.contiguous(), n, group, True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=True)
    return Reshard.apply(out, n, group, False)
