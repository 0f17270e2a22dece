"""Residual add + RMSNorm in one Triton kernel, as a Llama block does between its sublayers:

    h = x + residual                      (the new residual stream, returned)
    y = h / sqrt(mean(h**2) + eps) * weight

Unfused, eager PyTorch runs this as a chain of kernels (add, square, mean, rsqrt, two multiplies),
each reading its input from memory and writing its output back. Every one of them is
memory-bound: a few FLOPs per element. The fused kernel reads x, residual and weight once and
writes y and h once, so its floor is (4 x rows x hidden + hidden) x bytes per element at the
device's bandwidth.

One program normalises one row: the whole row (padded to a power of two, masked) sits in
registers, so the mean of squares needs no second pass over memory. Loads are upcast to fp32 and
the arithmetic is fp32 whatever the storage dtype (fp16 and bf16 sums of squares lose precision;
Triton's interpreter also computes bf16 arithmetic wrongly); stores round back to the storage dtype.
The rounded h is what is normalised, as in the unfused path, so the two agree to rounding.

Set `TRITON_INTERPRET=1` before importing this module to run it on CPU tensors (tests).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from labkit.blocks.kernels import interpreting


def _configs() -> list:
    # The interpreter has no driver to benchmark on: more than one config raises there.
    if interpreting():
        return [triton.Config({}, num_warps=4)]
    return [triton.Config({}, num_warps=w) for w in (1, 2, 4, 8, 16)]


@triton.autotune(configs=_configs(), key=["N", "BLOCK"])
@triton.jit
def _add_rmsnorm_kernel(X, R, W, Y, H, stride_x, stride_r, stride_y, stride_h, N, eps,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: rows x stride can pass 2**31 elements
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + r).to(H.dtype.element_ty)
    tl.store(H + row * stride_h + cols, h, mask=mask)
    h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / N + eps)  # masked columns add 0
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (h * rstd * w).to(Y.dtype.element_ty), mask=mask)


def check_inputs(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> None:
    """ValueError unless x and residual are (..., N) alike and weight is (N,) of their dtype and
    device; on a CUDA device unless the interpreter runs."""
    if x.shape != residual.shape or x.dim() < 1:
        raise ValueError(f"x {tuple(x.shape)} and residual {tuple(residual.shape)} must have one shape")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"weight {tuple(weight.shape)} must be ({x.shape[-1]},), the last dim of x")
    if not x.dtype == residual.dtype == weight.dtype or x.dtype not in (
            torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x, residual and weight must share one of float32, float16, bfloat16; "
                         f"got {x.dtype}, {residual.dtype}, {weight.dtype}")
    if not x.device == residual.device == weight.device:
        raise ValueError("x, residual and weight must be on one device")
    if x.device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (got {x.device}); "
                         "set TRITON_INTERPRET=1 before import to run them on the CPU")


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight, x + residual), both shaped like x, in one kernel."""
    check_inputs(x, residual, weight)
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n).contiguous(), residual.reshape(-1, n).contiguous()
    y, h = torch.empty_like(x2), torch.empty_like(x2)
    block = triton.next_power_of_2(n)
    if block * x.element_size() > 64 * 1024:  # one row must fit a program's registers
        raise ValueError(f"hidden size {n} is too large for one row per program")
    _add_rmsnorm_kernel[(x2.shape[0],)](x2, r2, weight.contiguous(), y, h, x2.stride(0),
                                        r2.stride(0), y.stride(0), h.stride(0), n, eps, BLOCK=block)
    return y.view_as(x), h.view_as(x)
