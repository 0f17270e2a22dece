"""FLOP counting with `FlopCounterMode`, with the attention kernels registered: PyTorch counts
`_scaled_dot_product_flash_attention_for_cpu` (and its backward) as zero otherwise, and older
releases refuse grouped-query shapes in the CUDA kernels' formulas."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


# The fused kernels take (q, k, v, ...) and their backwards (grad_out, q, k, v, ...); the counter
# passes argument shapes (and out_shape) to these formulas. Grouped-query attention hands k and v
# with fewer heads: each query head still does a full S x S, so k and v are counted at q's heads
# (older PyTorch formulas assert equal heads instead).
def _at_query_heads(q_shape, *shapes) -> list[tuple[int, ...]]:
    return [(s[0], q_shape[1], *s[2:]) for s in shapes]


def _sdpa(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, *_at_query_heads(q_shape, k_shape, v_shape))


def _sdpa_backward(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_shape, q_shape, *_at_query_heads(q_shape, k_shape, v_shape))


_KERNELS = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
            "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
ATTENTION_FLOPS = {**{getattr(aten, k): _sdpa for k in _KERNELS if hasattr(aten, k)},
                   **{getattr(aten, k + "_backward"): _sdpa_backward for k in _KERNELS
                      if hasattr(aten, k + "_backward")}}


def make_flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOPS)


def count_flops(fn: Callable[[], object]) -> int:
    """Total FLOPs (multiply-add = 2) of one call of `fn`."""
    with make_flop_counter() as counter:
        fn()
    return counter.get_total_flops()
