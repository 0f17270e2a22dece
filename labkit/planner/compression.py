"""Compressed gradients: the bytes one data-parallel rank hands to the gradient reduction per step,
and how far each format may move the averaged gradient.

S, as nccl-tests counts it (the all-reduce's buffer, the reduce-scatter's input), for Ψ gradient
elements over N ranks:
- fp32 4Ψ; bf16 and fp16 2Ψ; int8 Ψ plus one fp32 scale per bucket, agreed by an all-reduce(max)
  before the int8 all-reduce (`int8_reduce_bytes`);
- PowerSGD (Vogels et al., 2019, arXiv 1905.13727) at rank r: an (n, m) gradient as P (n, r) and
  Q (m, r) where (n + m) r · 2 < n m (torch's min_compression_rate 2), vectors and the matrices it
  does not pay to compress as they are (`powersgd_numel`).
A ring all-reduce moves 2(N-1)/N · S through each rank's link, a reduce-scatter (N-1)/N · S
(`bus_bytes`). `rounding_tolerance` is the normwise relative error a 16-bit reduction may add;
`int8_levels` the integer range each rank may use so that N of them summed in int8 cannot overflow.
"""
from __future__ import annotations

import math

from labkit.config import ConfigError, ModelConfig
from labkit.planner.finetune import linear_shapes
from labkit.planner.model import num_params

WIRE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}  # bytes per gradient element sent
SCALE_BYTES = 4  # int8: one fp32 scale per bucket
INT8_MAX = 127  # symmetric int8: -127..127 (-128 unused)
MIN_COMPRESSION_RATE = 2  # PowerSGDState's default
# Unit roundoff (half the spacing at 1) of each 16-bit format: 8 and 11 significant bits.
UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
FP16_SUBNORMAL_HALF_SPACING = 2.0**-25  # fp16 below 2^-14 keeps an absolute spacing of 2^-24


def int8_levels(world: int) -> int:
    """The largest |q| each of `world` ranks may send, floor(127 / N), so that their int8 sum
    stays within 127: 63 on 2 ranks, 31 on 4 (log2 N bits of the 7 spent on headroom)."""
    levels = INT8_MAX // world
    if levels < 1:
        raise ConfigError(f"an int8 all-reduce over {world} ranks overflows whatever each sends; "
                          f"valid: at most {INT8_MAX} ranks")
    return levels


def int8_reduce_bytes(bucket_numels: list[int]) -> int:
    """S of the int8 hook's collectives: each bucket's int8 all-reduce (1 byte an element) and
    the all-reduce(max) of its fp32 scale."""
    return sum(bucket_numels) + SCALE_BYTES * len(bucket_numels)


def grad_reduce_bytes(num_params: int, fmt: str, *, num_buckets: int = 0) -> int:
    """S per step for Ψ = `num_params` gradient elements sent as `fmt` (int8 with `num_buckets`
    scales)."""
    if fmt not in WIRE_BYTES:
        raise ConfigError(f"unknown gradient format {fmt!r}; valid: {', '.join(WIRE_BYTES)}")
    return WIRE_BYTES[fmt] * num_params + (SCALE_BYTES * num_buckets if fmt == "int8" else 0)


def powersgd_numel(shapes: list[tuple[int, ...]], rank: int,
                   min_compression_rate: int = MIN_COMPRESSION_RATE) -> dict[str, int]:
    """Elements PowerSGD all-reduces per step, as torch's hook splits them: `uncompressed`
    (vectors, and matrices (n, m) = (shape[0], numel / shape[0]) where (n + m) r' ·
    min_compression_rate >= n m, r' = min(n, m, rank)), `p` (n r' each) and `q` (m r' each)."""
    out = {"uncompressed": 0, "p": 0, "q": 0}
    for shape in shapes:
        numel = 1
        for d in shape:
            numel *= d
        n = shape[0] if shape else 1
        m = numel // n
        r = min(n, m, rank)
        if len(shape) > 1 and (n + m) * r * min_compression_rate < n * m:
            out["p"], out["q"] = out["p"] + n * r, out["q"] + m * r
        else:
            out["uncompressed"] += numel
    return out


def powersgd_bytes(shapes: list[tuple[int, ...]], rank: int) -> int:
    """S per step of PowerSGD's three all-reduces (uncompressed, P, Q), in fp32."""
    return WIRE_BYTES["fp32"] * sum(powersgd_numel(shapes, rank).values())


def ddp_buckets(numels: list[int], cap_bytes: float, element_bytes: int = 4) -> list[int]:
    """Elements per DDP bucket once DDP has rebuilt them after its first iteration: gradients in
    the order the backward makes them (about the reverse of registration; `numels` in
    registration order), a bucket closed once it holds `cap_bytes` or more."""
    buckets, size = [], 0
    for numel in reversed(numels):
        size += numel
        if size * element_bytes >= cap_bytes:
            buckets, size = buckets + [size], 0
    return buckets + ([size] if size else [])


def bus_bytes(size: float, world: int, collective: str = "all_reduce") -> float:
    """The bytes one rank moves on its busiest link for a ring collective of S = `size`:
    2(N-1)/N · S for an all-reduce, (N-1)/N · S for a reduce-scatter or all-gather."""
    return size * (2 if collective == "all_reduce" else 1) * (world - 1) / world


def compression_ratio(reference_bytes: float, sent_bytes: float) -> float:
    """How many times fewer bytes than the fp32 reduction: reference / sent."""
    return reference_bytes / sent_bytes if sent_bytes else float("inf")


def rounding_tolerance(fmt: str, world: int) -> float:
    """The normwise relative error a 16-bit reduction over `world` ranks may add to the mean
    gradient, relative to the mean of the ranks' own gradient norms: N + 1 roundings of at most
    u each (the cast, the N - 1 additions of the ring, the division by N), (N + 1) u. fp16
    also rounds what falls below 2^-14 to a fixed spacing (`FP16_SUBNORMAL_HALF_SPACING`)."""
    if fmt not in UNIT_ROUNDOFF:
        raise ConfigError(f"no rounding bound for {fmt!r}; valid: {', '.join(UNIT_ROUNDOFF)}")
    return (world + 1) * UNIT_ROUNDOFF[fmt]


def param_shapes(m: ModelConfig) -> list[tuple[int, ...]]:
    """A dense decoder's weight matrices (embedding, head unless tied, GPT-2's positions, every
    block linear as (out, in)), then all its vectors (norms, biases) as one: PowerSGD sends
    vectors as they are, so their total is all it needs."""
    if m.num_experts:
        raise ConfigError("param_shapes covers dense decoders; an MoE block's experts are stacked 3-D weights")
    d = m.hidden_size
    mats = [(m.vocab_size, d)] * (1 if m.tie_embeddings else 2)
    mats += [(m.max_seq_len, d)] if m.arch == "gpt2" else []
    mats += list(linear_shapes(m).values()) * m.num_layers
    return mats + [(num_params(m) - sum(a * b for a, b in mats),)]


def format_bytes(m: ModelConfig, *, powersgd_rank: int = 1, bucket_cap_mb: float = 25.0) -> dict[str, int]:
    """S per rank and step of each gradient format for model `m` (int8 with DDP's buckets of
    `bucket_cap_mb` MiB, PowerSGD at `powersgd_rank`)."""
    shapes, psi = param_shapes(m), num_params(m)
    buckets = ddp_buckets([math.prod(s) for s in shapes], bucket_cap_mb * 2**20)
    out = {fmt: grad_reduce_bytes(psi, fmt) for fmt in ("fp32", "bf16", "fp16")}
    return {**out, "int8": int8_reduce_bytes(buckets), "powersgd": powersgd_bytes(shapes, powersgd_rank)}
