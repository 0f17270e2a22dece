"""Calibrated weight quantization: the rounding chooses its values from what the layers see on
calibration text, not from the weights alone (round-to-nearest, RTN, is `labkit.blocks.quant`).

- `gptq_int4` (Frantar et al. 2022, "GPTQ", arXiv 2210.17323, Algorithm 1): each linear's columns
  are rounded one at a time, and each column's rounding error is spread over the columns not yet
  rounded through the inverse Hessian of the layer's squared output error, H = 2 X^T X over the
  calibration inputs X (damped by 1% of its mean diagonal; its upper Cholesky factor as in the
  paper). A group's scale and zero point are taken from its weights as updated when the group
  starts (the lazy batch is the group: 64 columns). No act-order: columns in their own order, so
  the groups stay contiguous and the result is RTN's storage format, served by `Int4Linear`.
- `awq_int4` (Lin et al. 2023, "AWQ", arXiv 2306.00978, section 3.2): per input channel scales
  s = mean|x|^alpha (normalised by sqrt(max s * min s)), alpha searched on a grid of 20 in [0, 1)
  for the least output error ||X W^T - (X / s) Q(W s)^T||^2 (computed as tr(dW H dW^T) with
  H = X^T X); W s is rounded by RTN and 1 / s folded into the op before (the norm, or the rows of
  v or the up projection), so nothing more is stored. alpha = 0 is s = 1, RTN. The paper's weight
  clipping search is left out.
- `smoothquant_w8a8` (Xiao et al. 2022, "SmoothQuant", arXiv 2211.10438, section 4):
  s = max|x|^a / max|w|^(1 - a), a = 0.5, folded the same way; then int8 weights with a scale
  per output channel and int8 activations with a scale per token, computed at run time (dynamic);
  `w8a8` is the same without smoothing (s = 1).

Where 1 / s cannot be folded (the output projection under grouped-query attention: heads share a
v row; GPT-2's second MLP linear, behind a GELU) the linear is left unscaled, as AutoAWQ does; so
is the output head (AutoAWQ leaves it alone: on the reference model, scaling it through the final
norm cut its calibration output error by 7% and raised the perplexity delta 3.5x, the squared
error of the logits being a poor stand-in for the loss).
Calibration runs block by block (the paper's order): a block's inputs are those of the blocks
already quantized, its statistics are collected over the calibration text, then it is quantized.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from labkit.blocks import quant
from labkit.blocks.model import Decoder

METHODS = ("gptq_int4", "awq_int4", "smoothquant_w8a8", "w8a8")
STORAGE = {"gptq_int4": "int4", "awq_int4": "int4", "smoothquant_w8a8": "int8", "w8a8": "int8"}
aten = torch.ops.aten
DAMP = 0.01  # GPTQ: the Hessian's diagonal damping, a share of its mean diagonal (the paper's 1%)
AWQ_GRID = 20  # AWQ: alpha in 0, 1/20, ..., 19/20 (the paper's grid)
SMOOTH_ALPHA = 0.5  # SmoothQuant's migration strength a
INT_MM_MIN_ROWS = 17  # CUDA's aten._int_mm takes more than 16 rows


@dataclass
class Stats:
    """One linear's inputs over the calibration tokens: sum of x x^T (K, K) fp32, sum of |x|,
    max |x| per input channel (K,), and the number of tokens."""

    hessian: torch.Tensor
    abs_sum: torch.Tensor
    abs_max: torch.Tensor
    count: int = 0

    def add(self, x: torch.Tensor) -> None:  # x (M, K)
        x = x.float()
        self.hessian += x.t() @ x
        self.abs_sum += x.abs().sum(0)
        self.abs_max = torch.maximum(self.abs_max, x.abs().amax(0))
        self.count += x.shape[0]


class _Stop(Exception):
    """Raised past the last module whose inputs are wanted: the rest of the forward is not run."""


def _stop(module, args, output):
    raise _Stop


@torch.no_grad()  # not inference_mode: the scales folded from these stats end up in parameters
def collect_stats(model: Decoder, tokens: torch.Tensor, names: list[str],
                  stop_after: nn.Module | None = None) -> dict[str, Stats]:
    """Each named linear's `Stats` over one forward pass of `tokens` (B, T), cut short after
    `stop_after` (a block: the later blocks and the head are not needed)."""
    stats, hooks = {}, []
    for name in names:
        mod = model.get_submodule(name)
        k = mod.in_features
        z = dict(device=tokens.device, dtype=torch.float32)
        stats[name] = s = Stats(torch.zeros(k, k, **z), torch.zeros(k, **z), torch.zeros(k, **z))
        hooks.append(mod.register_forward_pre_hook(lambda m, args, s=s: s.add(args[0].reshape(-1, m.in_features))))
    if stop_after is not None:
        hooks.append(stop_after.register_forward_hook(_stop))
    try:
        model(tokens)
    except _Stop:
        pass
    finally:
        for h in hooks:
            h.remove()
    return stats


# --- GPTQ ------------------------------------------------------------------------------------------

def inverse_hessian_factor(hessian: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """The upper Cholesky factor U of H^-1 (K, K) fp32, H damped: the paper's `Hinv`. A channel
    never seen (zero diagonal) gets 1 there: its weights then meet no error feedback."""
    h = hessian.double().clone()
    diag = h.diagonal()
    diag[diag == 0] = 1.0
    diag += damp * diag.mean()
    inverse = torch.cholesky_inverse(torch.linalg.cholesky(h))
    return torch.linalg.cholesky(inverse, upper=True).float()


def gptq_int4(w: torch.Tensor, factor: torch.Tensor, group_size: int, sdtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows w (N, K) rounded column by column with error feedback through `factor` (U of H^-1):
    (q uint8 (N, K), scale (N, G), zero (N, G)) in `quant.quantize_int4`'s format."""
    W = w.float().clone()
    N, K = W.shape
    q_out = torch.empty(N, K, dtype=torch.uint8, device=w.device)
    scales, zeros = [], []
    for g0 in range(0, K, group_size):
        g1 = min(g0 + group_size, K)
        block = W[:, g0:g1]  # updated by every group before
        _, scale, zero = quant.quantize_int4(block, group_size, sdtype)  # (N, 1) each
        s, z = scale.float()[:, 0], zero.float()[:, 0]
        low = z - 8 * s  # the same fp32 arithmetic as quantize_int4 and dequantize_int4
        errors = torch.empty_like(block)
        for i in range(g1 - g0):
            col = block[:, i]
            q = torch.round((col - low) / s).clamp(0, 15)
            q_out[:, g0 + i] = q.to(torch.uint8)
            err = (col - ((q - 8) * s + z)) / factor[g0 + i, g0 + i]
            block[:, i:] -= err[:, None] * factor[g0 + i, g0 + i:g1][None, :]
            errors[:, i] = err
        W[:, g1:] -= errors @ factor[g0:g1, g1:]  # the lazy batch's update of the columns after it
        scales.append(scale)
        zeros.append(zero)
    return q_out, torch.cat(scales, 1), torch.cat(zeros, 1)


def apply_gptq(model: Decoder, names: list[str], stats: dict[str, Stats], group_size: int,
               kernel: str, damp: float = DAMP) -> None:
    """GPTQ on `names`, the linears sharing an input (one Hessian) as one matrix of their rows
    stacked: rows are independent, so it is the same rounding in fewer column steps."""
    for _, group in scaling_groups(model):
        if group[0] not in names:
            continue
        hessian = stats[group[0]]
        factor = inverse_hessian_factor(2 * hessian.hessian / max(hessian.count, 1), damp)
        linears = [model.get_submodule(n) for n in group]
        w = torch.cat([lin.weight.detach() for lin in linears])
        values = gptq_int4(w, factor, group_size, quant.scale_dtype(w.dtype))
        rows = [lin.out_features for lin in linears]
        for name, lin, *parts in zip(group, linears, *(v.split(rows) for v in values)):
            quant._set(model, name, int4_layer(*parts, lin.bias, group_size, kernel, w.dtype))


def int4_layer(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor | None,
               group_size: int, kernel: str, dtype: torch.dtype) -> quant.QuantLinear:
    """An int4 linear holding the given values (q (N, K) 0..15, scale and zero (N, G)) in the
    layout `kernel` picks for its shape, as `quant.quantize_linear` picks it."""
    N, K = q.shape
    row = [0]

    def stored(w, g, sdtype):  # row chunks in order, from the first again on a retry
        r, n = row[0], w.shape[0]
        row[0] = (r + n) % N
        return q[r:r + n], scale[r:r + n], zero[r:r + n]

    linear = nn.Linear(K, N, bias=False, device="meta")
    linear.weight = nn.Parameter(torch.zeros((), dtype=dtype, device=q.device).expand(N, K), requires_grad=False)
    linear.bias = bias
    return quant.quantize_linear(linear, "int4", group_size=group_size, kernel=kernel, quantizer=stored)


# --- scaling folded into the op before: AWQ and SmoothQuant -------------------------------------------

def scaling_groups(model: Decoder) -> list[tuple[str | None, list[str]]]:
    """(the op whose output feeds the linears, the linears sharing that input) for every
    quantized linear; None where 1 / s cannot be folded into the op before."""
    cfg, out = model.cfg, []
    for i, _ in enumerate(model.layers):
        p = f"layers.{i}."
        llama = cfg.arch == "llama"
        out += [(p + "attn_norm", [p + "attn.wq", p + "attn.wk", p + "attn.wv"]),
                (p + "attn.wv" if cfg.num_heads == cfg.num_kv_heads else None, [p + "attn.wo"]),
                (p + "mlp_norm", [p + "mlp.w1", p + "mlp.w3"] if llama else [p + "mlp.w1"]),
                (p + "mlp.w3" if llama else None, [p + "mlp.w2"])]
    return out + [(None, ["lm_head"])]  # the head unscaled, as AutoAWQ: see the module docstring


@torch.no_grad()
def fold_scales(model: Decoder, prev: str, names: list[str], s: torch.Tensor) -> None:
    """x -> x / s in the op `prev` (a norm's weight and bias, or a linear's output rows), each of
    `names`' weight columns times s: the full-precision outputs unchanged (fp rounding aside).
    New tensors, not in place: a head tied to the embedding leaves the embedding as it was."""
    op = model.get_submodule(prev)
    if isinstance(op, nn.Linear):
        op.weight = nn.Parameter(op.weight / s[:, None].to(op.weight.dtype), requires_grad=False)
    else:
        op.weight = nn.Parameter(op.weight / s.to(op.weight.dtype), requires_grad=False)
    if getattr(op, "bias", None) is not None:
        op.bias = nn.Parameter(op.bias / s.to(op.bias.dtype), requires_grad=False)
    for name in names:
        lin = model.get_submodule(name)
        lin.weight = nn.Parameter(lin.weight * s[None, :].to(lin.weight.dtype), requires_grad=False)


def rtn_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """w (N, K) through RTN int4 and back, fp32."""
    q, scale, zero = quant.quantize_int4(w, group_size, quant.scale_dtype(w.dtype))
    return quant.dequantize_int4(q, scale, zero, group_size, torch.float32)


def output_error(weights: list[torch.Tensor], hessian: torch.Tensor, s: torch.Tensor, group_size: int) -> float:
    """sum over the linears of ||X W^T - (X / s) Q(W s)^T||^2 = tr(dW H dW^T), H = X^T X."""
    total = 0.0
    for w in weights:
        dw = rtn_int4(w.float() * s, group_size) / s - w.float()
        total += ((dw @ hessian) * dw).sum().item()
    return total


def awq_scales(weights: list[torch.Tensor], stats: Stats, group_size: int, grid: int = AWQ_GRID
               ) -> tuple[torch.Tensor, float]:
    """(s (K,), alpha) of least output error over alpha in range(grid) / grid."""
    x_mean = (stats.abs_sum / max(stats.count, 1)).clamp(min=1e-4)
    best = (math.inf, None, 0.0)
    for alpha in (i / grid for i in range(grid)):
        s = x_mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        err = output_error(weights, stats.hessian, s, group_size)
        if err < best[0]:
            best = (err, s, alpha)
    return best[1], best[2]


def smooth_scales(weights: list[torch.Tensor], stats: Stats, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothQuant's s_j = max|x_j|^a / max|w_j|^(1 - a), the weights' max over every linear
    sharing the input."""
    w_max = torch.cat([w.detach().abs().float() for w in weights]).amax(0).clamp(min=1e-5)
    return (stats.abs_max.clamp(min=1e-5).pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)


# --- W8A8: int8 weights per output channel, int8 activations per token -------------------------------

def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (q int8 (M, K), scale (M,) fp32), symmetric: x ~ q * scale."""
    scale = x.float().abs().amax(1).clamp(min=1e-8) / 127
    return torch.round(x.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class W8A8Linear(quant.QuantLinear):
    """y = (q_x q_w^T) * s_x s_w: the weight as int8's storage (`weight_int8`, `scale` per
    output channel, 16-bit), each token of x quantized at run time. Packed: aten._int_mm (int8
    x int8 -> int32); else emulated in fp32 (exact while 127^2 K < 2^24)."""

    scheme = "w8a8"

    def __init__(self, weight, bias, packed: bool):
        super().__init__(weight, bias, packed)
        q, scale = quant.by_rows(lambda w: quant.quantize_int8(w, quant.scale_dtype(weight.dtype)), weight)
        self.register_buffer("weight_int8", q)  # (N, K)
        self.register_buffer("scale", scale)  # (N,)

    def matmul(self, x):
        qx, sx = quantize_per_token(x)
        if self.packed and (not x.is_cuda or x.shape[0] >= INT_MM_MIN_ROWS):
            acc = aten._int_mm(qx, self.weight_int8.t()).float()
        else:
            acc = qx.float() @ self.weight_int8.float().t()
        return (acc * sx[:, None] * self.scale.float()[None, :]).to(x.dtype)


def w8a8_packed_reason(out_features: int, in_features: int, kernel: str) -> str | None:
    if kernel == "dequant":
        return "kernel=dequant"
    if in_features % 8 or out_features % 8:
        return "aten._int_mm wants in_features and out_features multiples of 8"
    return None


# --- the model transform ---------------------------------------------------------------------------

def blocks_of(model: Decoder) -> list[list[str]]:
    """The quantized linears, one list per block in order, the head last."""
    names = quant.target_linears(model)
    return [[n for n in names if n.startswith(f"layers.{i}.")] for i in range(len(model.layers))] + [["lm_head"]]


def quantize_block(model: Decoder, method: str, names: list[str], stats: dict[str, Stats], *,
                   group_size: int, kernel: str, damp: float) -> None:
    if method == "gptq_int4":
        return apply_gptq(model, names, stats, group_size, kernel, damp)
    for prev, group in scaling_groups(model):
        if prev is None or group[0] not in names or method == "w8a8":
            continue
        weights = [model.get_submodule(n).weight for n in group]
        s = (awq_scales(weights, stats[group[0]], group_size)[0] if method == "awq_int4"
             else smooth_scales(weights, stats[group[0]]))
        fold_scales(model, prev, group, s)
    for name in names:
        lin = model.get_submodule(name)
        if STORAGE[method] == "int4":
            new = quant.quantize_linear(lin, "int4", group_size=group_size, kernel=kernel)
        else:
            new = W8A8Linear(lin.weight.detach(), lin.bias,
                             w8a8_packed_reason(lin.out_features, lin.in_features, kernel) is None)
        quant._set(model, name, new)


def relayout(layer: quant.Int4Linear, kernel: str, dtype: torch.dtype) -> quant.QuantLinear:
    """`layer`'s values (dequant layout) in the layout `kernel` picks: the same values, another
    order of bytes."""
    q = quant.unpack_int4(layer.weight_packed, layer.in_features)
    return int4_layer(q, layer.scale, layer.zero, layer.bias, layer.group_size, kernel, dtype)


def apply_calibrated(model: Decoder, method: str, tokens: torch.Tensor, *, group_size: int = 64,
                     kernel: str = "auto", damp: float = DAMP) -> Decoder:
    """Quantize every block linear and the head by `method`, calibrated on `tokens` (B, T),
    block by block: each block's input statistics are collected with the blocks before it
    already quantized (and, for AWQ and SmoothQuant, its own scales folded before rounding).
    Calibration runs the quantized blocks on the dequant path (torch's CPU int4 kernel is slow
    at a calibration batch's thousand rows); the int4 layers are then laid out for `kernel`."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {', '.join(METHODS)}")
    dtype = model.embed.weight.dtype
    for i, names in enumerate(blocks_of(model)):
        stats = collect_stats(model, tokens, names, model.layers[i] if i < len(model.layers) else None)
        quantize_block(model, method, names, stats, group_size=group_size, kernel="dequant", damp=damp)
    for name in quant.target_linears(model):
        layer = model.get_submodule(name)
        if kernel != "dequant" and isinstance(layer, quant.Int4Linear):
            quant._set(model, name, relayout(layer, kernel, dtype))
        elif kernel != "dequant" and isinstance(layer, W8A8Linear):
            layer.packed = w8a8_packed_reason(layer.out_features, layer.in_features, kernel) is None
    return model
