"""Float8 training numerics in plain PyTorch, on any device (torch's float8 dtypes cast on the
CPU too): amax, scales, the quantize-dequantize round trip, and an emulated float8 linear.

Two formats (OCP FP8): `e4m3` (torch.float8_e4m3fn: 3 mantissa bits, largest 448, no inf) for
what the forward multiplies, and `e5m2` (torch.float8_e5m2: 2 mantissa bits, largest 57344) for
gradients, whose range is wider. A tensor is multiplied by a scale before the cast, so that its
largest magnitude (amax) lands on the format's largest value: scale = max_representable / amax,
one per tensor (`tensorwise`) or one per row (`rowwise`, torchao's axiswise scaling), and divided
by it after. Rounding to the nearest of 2^m values per binade makes the relative error at most
half an ulp, 2^-(m+1) of the value (2^-4 for e4m3, 2^-3 for e5m2) for values in the normal
range; below it (subnormals) the error grows, and under half the smallest subnormal a value
underflows to zero. With the scale taken from the tensor itself (dynamic scaling) nothing
saturates; a stale scale would clip.

The recipes are torchao's (`torchao.float8.Float8LinearConfig.from_recipe_name`, 0.18):
`tensorwise` casts input and weight to e4m3 and the output gradient to e5m2, one scale per
tensor; `rowwise` casts all three to e4m3, one scale per row along each matmul's reduction
dimension, scales rounded down to a power of two. `Float8Matmul` emulates the numerics of
torchao's float8 linear (its `emulate=True` path): each operand of the three matmuls (output,
grad_input, grad_weight) cast with its own scales, dequantized, multiplied in fp32 (as the fp8
tensor cores accumulate) and rounded to the compute dtype. It emulates the numerics, not the
speed: the casts are extra work and the matmul runs in fp32. `apply_float8` swaps a decoder's
block linears for it, or (`emulate=False`, CUDA with compute capability 8.9+) for torchao's
Float8Linear, which runs torch._scaled_mm on the fp8 tensor cores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MANTISSA_BITS = {"e4m3": 3, "e5m2": 2}
GRANULARITIES = ("tensorwise", "rowwise")
ROLES = ("input", "weight", "grad_output")  # the float8 linear's three cast operands
EPS = 1e-12  # torchao's floor on amax (an all-zero tensor gets a finite scale)
SCALE_BYTES = 4  # scales are fp32, one per tensor or one per row


def max_value(fmt: str) -> float:
    """The largest finite value: 448 (e4m3), 57344 (e5m2)."""
    return float(torch.finfo(FORMATS[fmt]).max)


def smallest_normal(fmt: str) -> float:
    """2^-6 (e4m3), 2^-14 (e5m2): below it values are subnormal, with fewer significant bits."""
    return float(torch.finfo(FORMATS[fmt]).smallest_normal)


def smallest_subnormal(fmt: str) -> float:
    """2^-9 (e4m3), 2^-16 (e5m2): half of it and less rounds to zero."""
    return smallest_normal(fmt) * 2.0 ** -MANTISSA_BITS[fmt]


def rounding_bound(fmt: str) -> float:
    """The largest relative rounding error for a normal value: half an ulp, 2^-(m+1)."""
    return 2.0 ** -(MANTISSA_BITS[fmt] + 1)


def rms_rounding_error(fmt: str) -> float:
    """The expected normwise relative error ||x' - x|| / ||x|| when each value's rounding error
    is uniform over +-half an ulp: ulp / sqrt(12) per value against its size, with the mantissa
    1 + f log-uniform over a binade (E[(1 + f)^2] = 3 / (2 ln 2)): 2^-m / sqrt(18 / ln 2),
    about 0.196 x 2^-m (0.0245 for e4m3, 0.049 for e5m2). Values in the normal range only."""
    return 2.0 ** -MANTISSA_BITS[fmt] / math.sqrt(18 / math.log(2))


def overflow_threshold(fmt: str) -> float:
    """Past max plus half its ulp a value would round beyond the format: the cast clamps it."""
    top = math.floor(math.log2(max_value(fmt)))
    return max_value(fmt) + 2.0 ** (top - MANTISSA_BITS[fmt] - 1)


@dataclass(frozen=True)
class Recipe:
    """How a float8 linear casts its operands: the scales' granularity, each role's format, and
    whether scales are rounded down to a power of two."""
    name: str
    granularity: str
    formats: dict[str, str]  # role -> "e4m3" / "e5m2"
    power_of_2: bool = False


RECIPES = {
    "tensorwise": Recipe("tensorwise", "tensorwise", {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}),
    "rowwise": Recipe("rowwise", "rowwise", {"input": "e4m3", "weight": "e4m3", "grad_output": "e4m3"},
                      power_of_2=True),
}


# --- amax, scale, the round trip -----------------------------------------------------------------

def to_fp32(data: torch.Tensor) -> torch.Tensor:
    """A float8 tensor's values in fp32, exactly: each byte looked up in its format's table of
    256 values (on the CPU 2-3x faster than torch's own cast, which gives the same values)."""
    table = _TABLES.get((data.dtype, data.device))
    if table is None:
        table = torch.arange(256, dtype=torch.uint8, device=data.device).view(data.dtype).float()
        _TABLES[(data.dtype, data.device)] = table
    return torch.take(table, data.view(torch.uint8).long())


_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def amax(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """max |x| in fp32: over the whole tensor (dim None, a scalar) or along `dim` (kept)."""
    a = x.detach().abs()
    return (a.amax() if dim is None else a.amax(dim=dim, keepdim=True)).float()


def scale_for(amax_: torch.Tensor, fmt: str, power_of_2: bool = False) -> torch.Tensor:
    """max_representable / amax (in fp64, then fp32, as torchao computes it); rounded down to a
    power of two when asked (the product by it is then exact)."""
    scale = (max_value(fmt) / amax_.double().clamp(min=EPS)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


@dataclass
class Float8:
    """A float8 copy of a tensor: `data` (one byte an element) and `scale` (fp32, broadcastable:
    one value, or one per row); the value is data / scale."""
    data: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (to_fp32(self.data) / self.scale).to(dtype)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def quantize(x: torch.Tensor, fmt: str, dim: int | None = None, *, power_of_2: bool = False,
             scale: torch.Tensor | None = None) -> Float8:
    """x * scale, clamped to +-max and cast to `fmt`. `dim`: one scale per slice along it (the
    amax taken over `dim`), None: one per tensor. `scale`: given (a stale or delayed one) rather
    than taken from x's own amax."""
    if scale is None:
        scale = scale_for(amax(x, dim), fmt, power_of_2)
    top = max_value(fmt)
    data = (x.detach().float() * scale).clamp(-top, top).to(FORMATS[fmt])
    return Float8(data, scale)


def round_trip(x: torch.Tensor, fmt: str, dim: int | None = None, *, power_of_2: bool = False) -> torch.Tensor:
    """x through float8 and back, in x's dtype."""
    return quantize(x, fmt, dim, power_of_2=power_of_2).dequantize(x.dtype)


def round_trip_stats(x: torch.Tensor, fmt: str, dim: int | None = None, *, power_of_2: bool = False,
                     scale: torch.Tensor | None = None) -> dict[str, float]:
    """What the round trip did to x: `rel_error` ||x' - x|| / ||x||; `max_rel_error` the largest
    |x' - x| / |x| over the values whose scaled magnitude is normal (at most `rounding_bound`);
    `underflow_fraction` the share of the nonzero values that became 0; `saturated_fraction` the
    share the clamp changed (past `overflow_threshold`); `amax`, and the scale (`scale` the
    smallest, `scale_max` the largest of a rowwise tensor's). In fp32 on the scaled values,
    where a value's relative error is what it is in x's units."""
    x = x.detach().float()
    if scale is None:
        scale = scale_for(amax(x, dim), fmt, power_of_2)
    scaled = x * scale
    top = max_value(fmt)
    back = to_fp32(scaled.clamp(-top, top).to(FORMATS[fmt]))
    size, err = scaled.abs(), (back - scaled).abs()
    nonzero = size > 0
    norm = float(torch.linalg.vector_norm(x))
    relative = torch.where(size >= smallest_normal(fmt), err / size, 0.0)  # normal values only
    return {"amax": float(x.abs().max()) if x.numel() else 0.0,
            "scale": float(scale.min()), "scale_max": float(scale.max()),
            "rel_error": float(torch.linalg.vector_norm(err / scale)) / norm if norm else 0.0,
            "max_rel_error": float(relative.max()) if x.numel() else 0.0,
            "underflow_fraction": (int(torch.count_nonzero(nonzero & (back == 0)))
                                   / max(int(torch.count_nonzero(nonzero)), 1)),
            "saturated_fraction": int(torch.count_nonzero(size > overflow_threshold(fmt))) / max(x.numel(), 1)}


def row_dim(granularity: str) -> int | None:
    """The dim an operand's amax is taken over: the last (one scale per row), or none."""
    return -1 if granularity == "rowwise" else None


# --- the emulated float8 linear --------------------------------------------------------------------

def _cast(x: torch.Tensor, recipe: Recipe, role: str, dim: int) -> torch.Tensor:
    """x cast as `role` to its format and back to fp32 (the values the fp8 matmul sees); `dim`:
    the reduction dimension of the matmul it enters, over which a rowwise amax is taken."""
    reduce = dim if recipe.granularity == "rowwise" else None
    return quantize(x, recipe.formats[role], reduce, power_of_2=recipe.power_of_2).dequantize()


class Float8Matmul(torch.autograd.Function):
    """x (M, K) @ weight (N, K)^T with float8 operands, as torchao's float8 linear computes it:
    forward  out         = q(x, e4m3) @ q(W, e4m3)^T      (rowwise: x per row, W per output row)
    backward grad_input  = q(g, fmt_g) @ q(W, e4m3)       (rowwise: g per row, W per input column)
             grad_weight = q(g, fmt_g)^T @ q(x, e4m3)     (rowwise: g and x per column, over M)
    where g is the output gradient (e5m2 in `tensorwise`, e4m3 in `rowwise`). The high-precision
    x and W are saved and cast again in backward along the other axis, as torchao does. Each
    product is in fp32 on the dequantized values, then rounded to the inputs' dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: Recipe) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.recipe = recipe
        x2 = x.reshape(-1, x.shape[-1])
        out = _cast(x2, recipe, "input", -1) @ _cast(weight, recipe, "weight", -1).T
        return out.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe = ctx.recipe
        g = grad_out.reshape(-1, grad_out.shape[-1])  # (M, N)
        x2 = x.reshape(-1, x.shape[-1])  # (M, K)
        grad_x = _cast(g, recipe, "grad_output", -1) @ _cast(weight, recipe, "weight", 0)
        grad_w = _cast(g, recipe, "grad_output", 0).T @ _cast(x2, recipe, "input", 0)
        return grad_x.to(x.dtype).reshape(x.shape), grad_w.to(weight.dtype), None


class EmulatedFloat8Linear(nn.Module):
    """A linear layer (its weight and bias, shared with the one it replaces) whose matmul is
    `Float8Matmul`: float8 numerics, emulated (not fp8 speed). The bias is added in high
    precision, as torchao's Float8Linear does."""

    def __init__(self, linear: nn.Linear, recipe: Recipe):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias, self.recipe = linear.weight, linear.bias, recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = Float8Matmul.apply(x, self.weight, self.recipe)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, recipe={self.recipe.name}"


# --- converting a decoder ----------------------------------------------------------------------------

def fp8_shape_ok(linear: nn.Linear) -> bool:
    """torch._scaled_mm needs both dimensions of a weight to be multiples of 16 (torchtitan and
    torchao's auto filter leave other linears in high precision; so does the emulation, to keep
    the same numerics on both)."""
    return linear.in_features % 16 == 0 and linear.out_features % 16 == 0


def block_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The decoder's block linears by name (`layers.0.attn.wq`, ...), converted or not: not the
    output head, which torchtitan's float8 converter leaves in high precision too."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, EmulatedFloat8Linear)) and name.startswith("layers.")}


def capture_linears(model: nn.Module, run) -> dict[str, dict[str, torch.Tensor]]:
    """What each block linear multiplies while `run()` does a forward and backward: its input
    and output gradient (flattened to rows: tokens x features) and its weight, detached."""
    seen: dict[str, dict[str, torch.Tensor]] = {}

    def hook(name):
        def record(module, args, out):
            seen[name] = {"input": args[0].detach().flatten(0, -2), "weight": module.weight.detach()}
            out.register_hook(lambda g: seen[name].__setitem__("grad_output", g.detach().flatten(0, -2)))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in block_linears(model).items()]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return seen


def fp8_linears(model: nn.Module) -> list[str]:
    """The block linears a float8 recipe converts (shapes that fp8 matmuls take)."""
    return [name for name, m in block_linears(model).items()
            if isinstance(m, nn.Linear) and fp8_shape_ok(m)]


def apply_float8(model: nn.Module, recipe: str, *, emulate: bool = True) -> list[str]:
    """Swap `fp8_linears(model)` for float8 ones, in place, and return their names: the emulated
    `EmulatedFloat8Linear`, or (emulate=False) torchao's Float8Linear from
    `convert_to_float8_training` with the recipe's config (CUDA, compute capability 8.9+)."""
    names = fp8_linears(model)
    if not emulate:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        chosen = set(names)
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                   module_filter_fn=lambda mod, fqn: fqn in chosen)
        return names
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, EmulatedFloat8Linear(getattr(owner, child), RECIPES[recipe]))
    return names


def cast_bytes(weight: torch.Tensor, inputs: torch.Tensor, recipe: Recipe) -> dict[str, int]:
    """Bytes of the forward's float8 copies of one linear's weight and input (data and scales),
    measured from the tensors `quantize` makes."""
    dim = row_dim(recipe.granularity)
    return {"weight": quantize(weight, recipe.formats["weight"], dim, power_of_2=recipe.power_of_2).nbytes,
            "input": quantize(inputs.reshape(-1, inputs.shape[-1]), recipe.formats["input"], dim,
                              power_of_2=recipe.power_of_2).nbytes}
