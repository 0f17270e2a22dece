"""FLOP counting with `FlopCounterMode`, with the CPU attention kernels registered: PyTorch counts
`_scaled_dot_product_flash_attention_for_cpu` (and its backward) as zero otherwise."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


# The CPU kernels take (q, k, v, ...) and (grad_out, q, k, v, ...) like the CUDA ones; the
# counter passes argument shapes (and out_shape) to these formulas.
def _cpu_sdpa(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def _cpu_sdpa_backward(grad_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


CPU_ATTENTION_FLOPS = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


def make_flop_counter() -> FlopCounterMode:
    return FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS)


def count_flops(fn: Callable[[], object]) -> int:
    """Total FLOPs (multiply-add = 2) of one call of `fn`."""
    with make_flop_counter() as counter:
        fn()
    return counter.get_total_flops()
