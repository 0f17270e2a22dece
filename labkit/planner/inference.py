"""Inference: the KV cache and what serving holds per GPU (the weights and the cache)."""
from __future__ import annotations

from labkit.config import DTYPE_BYTES, ModelConfig, check_choice
from labkit.planner.model import local_shape, stage_params
from labkit.planner.model import num_params as _count_params
from labkit.planner.plan import MemoryPlan, _check_model, _positive
from labkit.planner.precision import DTYPE_OF, PRECISIONS


def kv_bytes_per_token(m: ModelConfig, dtype: str) -> int:
    """One token's keys and values across all layers: 2 * layers * kv_heads * head_dim * bytes."""
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * DTYPE_BYTES[dtype]


def kv_cache_bytes(m: ModelConfig, *, batch_size: int, seq_len: int, precision: str = "bf16",
                   tp: int = 1, pp: int = 1) -> int:
    """The KV cache one GPU holds for `batch_size` sequences of `seq_len` tokens:
    kv_bytes_per_token x batch x sequence, with the kv heads split over tp (one each when there
    are fewer than tp) and the layers over pp. Stored in the weights' dtype."""
    s = local_shape(m, tp)
    layers = -(-m.num_layers // pp)
    return 2 * layers * s.kv * DTYPE_BYTES[DTYPE_OF[precision]] * batch_size * seq_len


def inference_memory(m: ModelConfig, *, batch_size: int = 1, seq_len: int = 2048,
                     precision: str = "bf16", tp: int = 1, pp: int = 1) -> MemoryPlan:
    """Serving at (batch, seq): the weights (in `precision`'s dtype) and the KV cache, per GPU. The
    prefill's transient activations are not counted."""
    _positive(batch_size=batch_size, seq_len=seq_len, tp=tp, pp=pp)
    _check_model(m, None, seq_len=seq_len, tp=tp, pp=pp)
    sp = stage_params(m, tp=tp, pp=pp, first=True, last=pp == 1)
    weights = sp.total * DTYPE_BYTES[DTYPE_OF[check_choice("precision", precision, PRECISIONS)]]
    kv = kv_cache_bytes(m, batch_size=batch_size, seq_len=seq_len, precision=precision, tp=tp, pp=pp)
    return MemoryPlan(num_params=_count_params(m), param_bytes=weights, grad_bytes=0,
                      optimizer_bytes=0, activation_bytes=0, activation_bytes_per_layer=0,
                      overhead_bytes=0, kv_cache_bytes=kv,
                      held_at_peak=("param", "kv_cache"), peak_phase="decode")
