"""Context parallelism: one attention layer's sequence split over n ranks, each holding S/n tokens.

Per rank and per training step (forward + backward) of one attention layer, `e` bytes an element
(fp32: 4), B sequences, H query heads, KV key/value heads of D dims:
- `ring_sent_bytes`: ring attention passes K and V blocks (B·KV·(S/n)·D each) to the next rank:
  n-1 hops of both in the forward, n-1 again in the backward, and n hops of their gradients
  (dK, dV travel with the blocks and take one more hop home): 2·(3n-2) blocks, 0 on one rank.
- `ulysses_all_to_all_bytes`: Ulysses' all-to-alls (q, k, v to head shards, the output back; the
  backward the same four for the gradients), each of this rank's whole shard: S per all-to-all,
  as nccl-tests counts it. `ulysses_sent_bytes`: the (n-1)/n of it that leaves the rank.
  At a fixed S/n both stay flat as n grows (arXiv 2309.14509); the ring's grow with n.
- `cp_activation_bytes`: what attention saves for backward, q, k, v, the output and one fp32
  log-sum-exp per query row, for S/n tokens: 1/n of one process's.
- `causal_pairs`: the (query, key) pairs a causal mask lets through, per rank (per sequence and
  head), for the contiguous split and the load-balanced zig-zag one; `causal_block_work`, the
  pairs scored when each needed block is computed whole, and `causal_idle_fraction` from it.
"""
from __future__ import annotations

from labkit.config import ConfigError

SPLITS = ("contiguous", "zigzag")
LSE_BYTES = 4  # one fp32 log-sum-exp per query row


def check_split(seq_len: int, n: int, split: str) -> None:
    """A ConfigError unless `seq_len` splits into n equal blocks (2n for zig-zag)."""
    if split not in SPLITS:
        raise ConfigError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    pieces = 2 * n if split == "zigzag" else n
    if seq_len % pieces:
        raise ConfigError(f"seq_len={seq_len} does not split into {pieces} equal blocks "
                          f"({split} over {n} ranks): use a multiple of {pieces}")


def cp_block_bytes(batch: int, heads: int, seq_len: int, head_dim: int, n: int, *, e: int = 4) -> int:
    """One rank's block of a (B, heads, S, D) tensor: B·heads·(S/n)·D elements of e bytes."""
    return batch * heads * (seq_len // n) * head_dim * e


def ring_sent_bytes(batch: int, kv_heads: int, seq_len: int, head_dim: int, n: int, *,
                    backward: bool = True, e: int = 4) -> int:
    """Bytes one rank sends in one ring-attention forward (+ backward): `ring_sends` blocks, 2·(n-1)
    K/V blocks forward, 2·(n-1) again and 2·n dK/dV blocks backward."""
    return ring_sends(n, backward=backward) * cp_block_bytes(batch, kv_heads, seq_len, head_dim, n, e=e)


def ring_sends(n: int, *, backward: bool = True) -> int:
    """Point-to-point sends per rank (K and V each one send a hop; dK and dV likewise)."""
    return 0 if n == 1 else 2 * ((n - 1) + ((n - 1) + n if backward else 0))


def ulysses_all_to_all_bytes(batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int,
                             n: int, *, backward: bool = True, e: int = 4) -> int:
    """S summed over Ulysses' all-to-alls (4 forward: q, k, v, out; 4 backward), each this rank's
    whole (B, heads, S/n, D) shard; 0 on one rank."""
    if n == 1:
        return 0
    per_pass = 2 * cp_block_bytes(batch, heads + kv_heads, seq_len, head_dim, n, e=e)
    return per_pass * (2 if backward else 1)


def ulysses_sent_bytes(batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int, n: int,
                       *, backward: bool = True, e: int = 4) -> float:
    """The share of the all-to-alls that leaves the rank: (n-1)/n of each (its own part stays)."""
    total = ulysses_all_to_all_bytes(batch, heads, kv_heads, seq_len, head_dim, n,
                                     backward=backward, e=e)
    return total * (n - 1) / n


def cp_activation_bytes(batch: int, heads: int, kv_heads: int, seq_len: int, head_dim: int, n: int,
                        *, e: int = 4) -> int:
    """Saved for backward per rank: q, k, v and the output of S/n tokens, and a log-sum-exp per
    query row: ((2H + 2KV)·D·e + 4H)·B·S/n. n = 1: one process's."""
    tokens = batch * (seq_len // n)
    return tokens * ((2 * heads + 2 * kv_heads) * head_dim * e + heads * LSE_BYTES)


def causal_pairs(seq_len: int, n: int, split: str = "contiguous", *, causal: bool = True) -> list[int]:
    """Allowed (query, key) pairs each rank computes, per sequence and head. Contiguous: rank r
    holds tokens rL..(r+1)L-1 (L = S/n) and sees r whole blocks and its own triangle,
    r·L² + L(L+1)/2. Zig-zag: blocks r and 2n-1-r of c = S/(2n) tokens, (2n-1)·c² + c(c+1) =
    c·(S+1) on every rank. Without the mask, S²/n everywhere."""
    check_split(seq_len, n, split)
    if not causal:
        return [seq_len * seq_len // n] * n
    if split == "zigzag":
        c = seq_len // (2 * n)
        return [c * (seq_len + 1)] * n
    block = seq_len // n
    return [r * block * block + block * (block + 1) // 2 for r in range(n)]


def causal_block_work(seq_len: int, n: int, split: str = "contiguous", *, causal: bool = True) -> list[int]:
    """Pairs each rank scores when it computes every block it needs whole, the causal triangle's
    as a full square (as `labkit.blocks.ring` does): contiguous (r+1)·L², zig-zag (2n+1)·c²
    (of its 2 x 2n piece pairs, those whose key piece is not after the query piece)."""
    check_split(seq_len, n, split)
    if not causal:
        return [seq_len * seq_len // n] * n
    if split == "zigzag":
        c = seq_len // (2 * n)
        return [(2 * n + 1) * c * c] * n
    block = seq_len // n
    return [(r + 1) * block * block for r in range(n)]


def causal_idle_fraction(seq_len: int, n: int, split: str = "contiguous", *,
                         causal: bool = True) -> list[float]:
    """Each rank's share of the busiest rank's block compute spent waiting, 1 - work/max, with the
    work of `causal_block_work`: contiguous 1 - (r+1)/n, zig-zag 0."""
    work = causal_block_work(seq_len, n, split, causal=causal)
    return [1 - w / max(work) for w in work]


def causal_imbalance(seq_len: int, n: int, split: str = "contiguous", *, causal: bool = True) -> float:
    """The busiest rank's work over the mean: ((2n-1)·S/n + 1)/(S+1) contiguous (near (2n-1)/n),
    1 zig-zag."""
    pairs = causal_pairs(seq_len, n, split, causal=causal)
    return max(pairs) * n / sum(pairs)
