"""Float8 training's napkin terms, from shapes alone: which block linears a recipe converts,
the bytes of their float8 copies, and the most a step can speed up when only those matmuls run
at the fp8 rate (Amdahl)."""
from __future__ import annotations

from labkit.config import ModelConfig
from labkit.planner.finetune import linear_shapes
from labkit.planner.model import train_step_flops

SCALE_BYTES = 4  # an fp32 scale, one per tensor (tensorwise) or one per row (rowwise)


def float8_shapes(m: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of every block linear an fp8 matmul takes (both dimensions
    multiples of 16, torch._scaled_mm's constraint), over all layers; the head is left out."""
    block = [(n, k) for n, k in linear_shapes(m).values() if n % 16 == 0 and k % 16 == 0]
    return block * m.num_layers


def float8_cast_bytes(m: ModelConfig, *, tokens: int, granularity: str) -> dict[str, int]:
    """Bytes of one forward's float8 copies: each converted weight (N x K bytes plus its scales:
    one, or one per output row) and each converted linear's input (tokens x K bytes plus one
    scale, or one per token)."""
    rowwise = granularity == "rowwise"
    shapes = float8_shapes(m)
    weight = sum(n * k + SCALE_BYTES * (n if rowwise else 1) for n, k in shapes)
    inputs = sum(tokens * k + SCALE_BYTES * (tokens if rowwise else 1) for _, k in shapes)
    return {"weight": weight, "input": inputs}


def float8_flop_share(m: ModelConfig, *, batch: int, seq_len: int, attention: str = "sdpa") -> float:
    """The share of a training step's FLOPs in the converted linears: their three matmuls
    (forward, grad_input, grad_weight) at 2 N K each per token, over the whole step's."""
    linear = 6 * batch * seq_len * sum(n * k for n, k in float8_shapes(m))
    return linear / train_step_flops(m, batch=batch, seq_len=seq_len, attention=attention)


def float8_speedup_bound(m: ModelConfig, *, batch: int, seq_len: int, rate_ratio: float,
                         attention: str = "sdpa") -> float:
    """The step's speed-up if the converted linears ran `rate_ratio` times faster (the fp8 peak
    over the 16-bit one, 2 on Hopper) and the rest as before: 1 / ((1 - f) + f / ratio), f the
    FLOP share. The casts, the amax reductions and everything bound by memory only lower it."""
    f = float8_flop_share(m, batch=batch, seq_len=seq_len, attention=attention)
    return 1.0 / ((1.0 - f) + f / rate_ratio)
