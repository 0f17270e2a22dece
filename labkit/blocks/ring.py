"""Ring attention: each rank keeps its query block and passes key/value blocks around the ring.

Shapes: q (B, H, L, D) and k, v (B, KV, L, D) hold this rank's L = S/n tokens; H = KV·G
(grouped-query attention: q head h reads kv head h // G, as SDPA's enable_gqa). A rank's tokens
are `pieces`, (start, length) runs of the sequence: one block (contiguous) or blocks r and 2n-1-r
of 2n (zig-zag). Every piece has the same length, so a key piece is wholly before a query piece
(attended whole), the same piece (the causal triangle) or wholly after it (skipped).

`RingAttention` (an autograd.Function) runs n steps: at each it starts sending the k, v it holds
to rank r+1 and receiving rank r-1's (`batch_isend_irecv`, so the transfer overlaps the block's
compute), attends its queries to the held block, and merges the partial softmaxes by their
log-sum-exp. Its backward passes k, v around again and accumulates dq here; dk, dv travel with
their block and take one more hop home. It saves q, k, v, the output and the log-sum-exp of S/n
tokens: nothing of the whole sequence is gathered anywhere.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

BUGS = ("none", "no_rescale", "no_block_mask")  # mistakes put in on purpose (the check catches them)
KV_TAG, GRAD_TAG = 0, 1  # the k/v hops and the dk/dv hops between the same two ranks


def pieces(seq_len: int, n: int, rank: int, split: str) -> list[tuple[int, int]]:
    """This rank's (start, length) runs of the sequence: contiguous, or zig-zag's two."""
    if split == "zigzag":
        c = seq_len // (2 * n)
        return [(rank * c, c), ((2 * n - 1 - rank) * c, c)]
    block = seq_len // n
    return [(rank * block, block)]


def positions(runs: list[tuple[int, int]]) -> torch.Tensor:
    """The global token positions of `runs`, in the order the rank holds them."""
    return torch.cat([torch.arange(start, start + length) for start, length in runs])


def shard(t: torch.Tensor, runs: list[tuple[int, int]], dim: int = 2) -> torch.Tensor:
    """This rank's tokens of a whole-sequence tensor, contiguous in memory (sendable)."""
    return torch.cat([t.narrow(dim, start, length) for start, length in runs], dim).contiguous()


@dataclass
class Ring:
    """How the ring runs: ranks, the split, causal or not, the bug knob, and what it counted
    (`attended_pairs`: allowed (query, key) pairs per sequence and head; `compute_s`: seconds of
    block compute on the CPU; both summed over forwards)."""

    seq_len: int
    split: str = "contiguous"
    causal: bool = True
    bug: str = "none"
    attended_pairs: int = 0
    compute_s: float = 0.0
    group: object = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group) if dist.is_initialized() else 0

    def runs(self, rank: int) -> list[tuple[int, int]]:
        return pieces(self.seq_len, self.n, rank, self.split)

    def blocks(self, src: int):
        """(query slice, key slice, diagonal) for each piece pair of this rank against `src`'s
        block that the mask leaves anything of; `no_block_mask` attends to later blocks too."""
        for qo, (qs, ql) in _offsets(self.runs(self.rank)):
            for ko, (ks, kl) in _offsets(self.runs(src)):
                if self.causal and ks > qs and self.bug != "no_block_mask":
                    continue
                yield slice(qo, qo + ql), slice(ko, ko + kl), self.causal and ks == qs


def _offsets(runs):
    offset = 0
    for run in runs:
        yield offset, run
        offset += run[1]


def _hop(tensors, ring: Ring, tag: int):
    """Start sending `tensors` to the next rank and receiving as many from the previous one;
    (requests, receive buffers). One rank: nothing to send, the tensors are already home."""
    n, r = ring.n, ring.rank
    if n == 1:
        return [], list(tensors)
    bufs = [torch.empty_like(t) for t in tensors]
    # P2POp's peer is a global rank: a ring over a subgroup (a recipe's cp dimension) maps it
    to, frm = ((r + 1) % n, (r - 1) % n) if ring.group is None else \
        (dist.get_global_rank(ring.group, (r + 1) % n), dist.get_global_rank(ring.group, (r - 1) % n))
    ops = [dist.P2POp(dist.isend, t, to, ring.group, tag) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, frm, ring.group, tag) for b in bufs]
    return dist.batch_isend_irecv(ops), bufs


def _done(pending) -> list[torch.Tensor]:
    reqs, bufs = pending
    for req in reqs:
        req.wait()
    return bufs


def ring_pass(k: torch.Tensor, v: torch.Tensor, ring: Ring):
    """(step, source rank, k, v held) for each of n steps; the next hop is started before each
    yield (its transfer overlaps the caller's compute) and finished after."""
    n, r = ring.n, ring.rank
    for step in range(n):
        pending = _hop((k, v), ring, KV_TAG) if step < n - 1 else None
        yield step, (r - step) % n, k, v
        if pending is not None:
            k, v = _done(pending)


def _scores(qg, k, scale: float, diagonal: bool) -> torch.Tensor:
    """(B, KV, G, Lq, Lk) scaled scores; the triangle above the diagonal masked out."""
    s = qg @ k.unsqueeze(2).transpose(-1, -2) * scale
    if diagonal:
        above = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def _merge(out, lse, o, lse_b, bug: str) -> None:
    """Fold a block's softmax (o, its log-sum-exp lse_b) into the running (out, lse), in place:
    each weighted by its share exp(lse_i - lse_new) of the combined normaliser."""
    new = torch.logaddexp(lse, lse_b)
    if bug == "no_rescale":  # the bug: partial outputs summed as if each were the whole softmax
        out.add_(o)
    else:
        out.mul_((lse - new).exp().unsqueeze(-1)).add_(o * (lse_b - new).exp().unsqueeze(-1))
    lse.copy_(new)


def grouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, L, D) -> (B, KV, G, L, D): q heads grouped by the kv head they read."""
    b, h, length, d = t.shape
    return t.view(b, kv_heads, h // kv_heads, length, d)


class RingAttention(torch.autograd.Function):
    """Attention over the whole sequence with only S/n tokens of q, k, v here: (B, H, L, D)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        qg, scale = grouped(q, k.shape[1]), q.shape[-1] ** -0.5
        out = torch.zeros(qg.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        for _, src, kc, vc in ring_pass(k, v, ring):
            start = time.perf_counter()
            for qs, ks, diagonal in ring.blocks(src):
                s = _scores(qg[..., qs, :], kc[:, :, ks], scale, diagonal)
                lse_b = s.logsumexp(-1)
                o = (s - lse_b.unsqueeze(-1)).exp() @ vc[:, :, ks].unsqueeze(2)
                _merge(out[..., qs, :], lse[..., qs], o, lse_b, ring.bug)
                lq, lk = s.shape[-2:]
                ring.attended_pairs += lq * (lq + 1) // 2 if diagonal else lq * lk
            # CPU only: timing CUDA would drain the device, the hops in flight with it
            if q.device.type == "cpu":
                ring.compute_s += time.perf_counter() - start
        out = out.to(q.dtype).view(q.shape)
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, kv_heads = ctx.ring, k.shape[1]
        qg, dog, scale = grouped(q, kv_heads), grouped(dout.contiguous(), kv_heads), q.shape[-1] ** -0.5
        delta = (dog * grouped(out, kv_heads)).sum(-1)  # (B, KV, G, L): rowsum(dO · O)
        dq, pending = torch.zeros_like(qg), None
        for _, src, kc, vc in ring_pass(k, v, ring):
            dk, dv = torch.zeros_like(kc), torch.zeros_like(vc)
            for qs, ks, diagonal in ring.blocks(src):
                s = _scores(qg[..., qs, :], kc[:, :, ks], scale, diagonal)
                p = (s - lse[..., qs].unsqueeze(-1)).exp()  # the final softmax's probabilities
                dv[:, :, ks] += (p.transpose(-1, -2) @ dog[..., qs, :]).sum(2)
                ds = p * (dog[..., qs, :] @ vc[:, :, ks].unsqueeze(2).transpose(-1, -2)
                          - delta[..., qs].unsqueeze(-1))
                dq[..., qs, :] += ds @ kc[:, :, ks].unsqueeze(2) * scale
                dk[:, :, ks] += (ds.transpose(-1, -2) @ qg[..., qs, :]).sum(2) * scale
            if pending is not None:  # src's dk, dv from the ranks it visited before
                got_k, got_v = _done(pending)
                dk, dv = dk + got_k, dv + got_v
            pending = _hop((dk, dv), ring, GRAD_TAG)
        dk, dv = _done(pending)  # the last hop brings this rank's own blocks home
        return dq.view(q.shape), dk, dv, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """This rank's (B, H, L, D) output of attention over the whole ring's sequence."""
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring)
