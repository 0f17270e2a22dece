"""Closed forms the exercises need that are not in the planner."""
from __future__ import annotations

import math

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # the smallest positive fp16 (subnormal)


def fp16_round(x: float) -> float:
    """What an fp32 value becomes in fp16, in closed form (round to nearest even; inf past the
    largest finite value; subnormals step by 2^-24)."""
    if abs(x) >= FP16_MAX + 16:  # halfway to the next power step rounds to inf
        return math.copysign(math.inf, x)
    exponent = max(math.frexp(abs(x))[1] - 11, -24) if x else -24  # 11 significant bits
    step = 2.0**exponent
    return round(x / step) * step


def fp16_demo() -> dict[str, float]:
    """The same values through torch: what fp16 storage does without and with a loss scale."""
    import torch

    def half(v: float) -> float:
        return torch.tensor(v, dtype=torch.float32).half().item()

    logits = torch.tensor([300.0, 250.0], dtype=torch.float16)
    return {"grad_fp16": half(1e-8), "grad_scaled": half(1e-8 * 65536) / 65536,
            "big_fp16": half(70000.0), "square_fp16": (logits * logits).sum().item()}


# NVIDIA's Matrix Multiplication Background User's Guide, "Tensor Core Requirements":
# https://docs.nvidia.com/deeplearning/performance/dl-performance-matrix-multiplication/index.html
TENSOR_CORE_ALIGN_BYTES = 16  # most efficient from here (cuBLAS 11+): 8 fp16/bf16, 4 tf32, 16 int8
TENSOR_CORE_BEST_BYTES = 128  # better still on A100 and newer: 64 fp16/bf16, 32 tf32, 128 int8


def tensor_core_friendly(m: int, n: int, k: int, dtype_bytes: int = 2,
                         align_bytes: int = TENSOR_CORE_ALIGN_BYTES) -> bool:
    """Whether every dimension is a multiple of `align_bytes` worth of elements, i.e. a shape at
    which cuBLAS's tensor-core kernels run efficiently. Not whether tensor cores are used: since
    cuBLAS 11 they serve any shape, but an unaligned one runs less efficient kernels (ragged
    tiles, narrower loads). Before cuBLAS 11 this alignment was a requirement. `align_bytes=128`
    asks for the alignment that is better still on A100 and newer (64 fp16 elements)."""
    multiple = max(1, align_bytes // dtype_bytes)
    return all(d % multiple == 0 for d in (m, n, k))


def ring_allreduce_bytes(size: int, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of `size` bytes over n ranks:
    a reduce-scatter then an all-gather, each (n - 1) steps of size / n."""
    return 2 * (n - 1) / n * size


def faster(ratio: float) -> str:
    return "the cached run" if ratio > 1.2 else "the uncached run" if ratio < 1 / 1.2 else "about the same"
