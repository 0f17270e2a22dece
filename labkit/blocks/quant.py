"""Weight-only quantization of a decoder's linear layers: int8, int4 and fp8, and two ways to load.

- `int8`: symmetric, one scale per output channel: w ~ q * scale, q in [-127, 127].
- `int4`: asymmetric, one scale and one zero point per `group_size` inputs of an output channel,
  in tinygemm's convention (gpt-fast, torchao): w ~ (q - 8) * scale + zero, q in [0, 15], two
  values packed per byte. A row whose width is not a multiple of `group_size` ends in a shorter
  group, with its own scale and zero point.
- `fp8`: float8_e4m3fn weights with one scale per output channel (GPUs, capability 8.9+).
Scales and zero points are 16-bit (bfloat16; float16 for a float16 model), as gpt-fast and torchao
store them; activations stay in the model's dtype (weight-only).

Two kernel paths: `dequant` (plain PyTorch: the weight dequantized to the activation dtype, then
F.linear; always there) and `packed` (torch's own kernels: aten._weight_int8pack_mm, and the int4
tinygemm kernels _weight_int4pack_mm_for_cpu / _weight_int4pack_mm on CUDA) where their
constraints hold (`packed_reason`); a layer they cannot serve is dequantized, and counted.

`apply_weight_quant(model, ...)` replaces every block linear and the output head. A head tied to
the embedding gets a quantized copy; the embedding keeps its table in the model dtype (a lookup
reads B rows of it per step, the head reads all of it). Loading: `load_quantized` builds the model
on `meta` and materializes and quantizes one linear at a time from a memory-mapped checkpoint
(`open_checkpoint`), so the full-precision model never exists whole; `load_full` loads everything
(then `apply_weight_quant`).
"""
from __future__ import annotations

import functools
import math
import mmap
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from labkit import planner
from labkit.blocks.model import Decoder, build_model
from labkit.blocks.reference import CODE_DTYPES, read_header
from labkit.config import ModelConfig

SCHEMES = ("int8", "int4", "fp8")
KERNELS = ("auto", "dequant", "packed")
INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes the tinygemm kernels take
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Rows quantized at a time: the quantizer's fp32 temporaries stay a few chunks of rows, not a few
# copies of the whole weight (a 4096-row head would otherwise spike the loading peak 4x).
CHUNK_ROWS = 256  # a multiple of 16: the CPU int4 layout packs blocks of 16 rows
aten = torch.ops.aten


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype of scales and zero points for a model in `dtype`."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


def round_up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Positive fp32 `x` in 16-bit `dtype`, rounded up (never below x): a scale that covers the
    range, so no value is clipped."""
    y = x.to(dtype)
    low = y.float() < x
    return torch.where(low, torch.nextafter(y, torch.full_like(y, math.inf)), y)


# --- int8: symmetric per output channel ---------------------------------------------------------

def by_rows(fn: Callable[[torch.Tensor], tuple], w: torch.Tensor, rows: int = CHUNK_ROWS) -> tuple:
    """fn applied to row chunks of w (N, K), each of its outputs concatenated along rows."""
    parts = [fn(chunk) for chunk in w.split(rows)]
    return tuple(torch.cat(outs) for outs in zip(*parts))


def quantize_int8(w: torch.Tensor, sdtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q int8 (N, K), scale (N,) in `sdtype`), w ~ q * scale; |error| <= scale / 2."""
    w32 = w.float()
    scale = round_up(w32.abs().amax(dim=1).clamp(min=1e-8) / 127, sdtype)
    q = torch.round(w32 / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(dtype) * scale.to(dtype)[:, None])


# --- int4: asymmetric, grouped, packed two per byte -----------------------------------------------

def num_groups(in_features: int, group_size: int) -> int:
    return -(-in_features // group_size)  # the last group may be shorter


def quantize_int4(w: torch.Tensor, group_size: int, sdtype: torch.dtype = torch.bfloat16
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w (N, K) -> (q uint8 (N, K) in 0..15, scale (N, G), zero (N, G)), G = ceil(K / group_size),
    w ~ (q - 8) * scale + zero (the group's minimum is zero - 8 * scale)."""
    N, K = w.shape
    G, pad = num_groups(K, group_size), -K % group_size
    w32 = w.float()
    lo = F.pad(w32, (0, pad), value=math.inf).view(N, G, group_size).amin(-1)  # padding ignored
    hi = F.pad(w32, (0, pad), value=-math.inf).view(N, G, group_size).amax(-1)
    scale = round_up(((hi - lo) / 15).clamp(min=1e-8), sdtype)
    zero = (lo + 8 * scale.float()).to(sdtype)
    low_end = expand_groups(zero.float() - 8 * scale.float(), group_size, K)
    q = torch.round((w32 - low_end) / expand_groups(scale.float(), group_size, K))
    return q.clamp(0, 15).to(torch.uint8), scale, zero


# w (N, K), group_size, scale dtype -> (q, scale, zero) as `quantize_int4` returns them
Int4Quantizer = Callable[[torch.Tensor, int, torch.dtype], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def expand_groups(per_group: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """(N, G) -> (N, K): each group's value repeated over its inputs (the last group cut short)."""
    return per_group.repeat_interleave(group_size, dim=1)[:, :in_features]


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    K = q.shape[1]
    return ((q.to(dtype) - 8) * expand_groups(scale.to(dtype), group_size, K)
            + expand_groups(zero.to(dtype), group_size, K))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """(N, K) uint8 values 0..15 -> (N, ceil(K / 2)) uint8: input 2i in the low nibble, 2i + 1 in
    the high one (an odd K pads a zero)."""
    q = F.pad(q, (0, q.shape[1] % 2))
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The inverse of `pack_int4`: (N, ceil(K / 2)) -> (N, K) uint8 values 0..15."""
    pairs = torch.stack([packed & 0xF, packed >> 4], dim=-1)  # (N, K/2, 2)
    return pairs.flatten(1)[:, :in_features]


# --- fp8: float8_e4m3fn per output channel ---------------------------------------------------------

def quantize_fp8(w: torch.Tensor, sdtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) -> (float8_e4m3fn (N, K), scale (N,)), w ~ q * scale, amax mapped to FP8_MAX."""
    w32 = w.float()
    scale = round_up(w32.abs().amax(dim=1).clamp(min=1e-8) / FP8_MAX, sdtype)
    return (w32 / scale.float()[:, None]).to(torch.float8_e4m3fn), scale


# --- bytes: the exact formula -----------------------------------------------------------------------

weight_bytes = planner.weight_only_bytes  # the planner's formula: the bytes each scheme stores


def bits_per_weight(in_features: int, scheme: str, group_size: int = 64, dtype_bytes: int = 4) -> float:
    """Storage bits per weight of a row of `in_features`: 4 + 32 / group_size for int4 when the
    groups divide the row (the shorter last group adds a little)."""
    return 8 * weight_bytes(1, in_features, scheme, group_size, dtype_bytes) / in_features


# --- which kernel can serve a layer -----------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _kernel_runs(scheme: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch has the packed kernel for `scheme` on this device type and activation dtype
    (tried once on a small problem: availability differs between builds)."""
    try:
        x = torch.zeros(2, 256, dtype=dtype, device=device_type)
        w = torch.randn(32, 256, dtype=dtype, device=device_type)
        layer = Int8Linear(w, None, packed=True) if scheme == "int8" else Int4Linear(w, None, 64, packed=True)
        layer(x)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def packed_reason(scheme: str, out_features: int, in_features: int, group_size: int,
                  device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why torch's packed kernel cannot serve this linear (None when it can)."""
    device_type = torch.device(device).type
    if scheme == "fp8":
        return "torch has no weight-only fp8 matmul (torch._scaled_mm quantizes activations too)"
    if scheme == "int4":
        if group_size not in INT4_KERNEL_GROUPS:
            return f"int4 kernels take group sizes {INT4_KERNEL_GROUPS}"
        if in_features % group_size:
            return f"in_features {in_features} is not a multiple of group_size {group_size}"
        if device_type == "cuda" and (dtype != torch.bfloat16 or in_features % 32 or out_features % 8):
            return "CUDA's int4 kernel needs bfloat16, in_features % 32 == 0 and out_features % 8 == 0"
        if device_type == "cpu" and out_features % 16:
            return f"out_features {out_features} is not a multiple of 16"
    if not _kernel_runs(scheme, device_type, dtype):
        return f"this torch build has no {scheme} packed kernel for {device_type} {dtype}"
    return None


# --- the quantized linears ----------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """A linear whose weight is stored quantized; `stored()` is that storage (what `weight_bytes`
    counts), `packed` whether torch's packed kernel runs it. The bias, if any, stays as it was."""

    scheme = ""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = packed
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def stored(self) -> list[torch.Tensor]:
        return [b for _, b in self.named_buffers()]

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # x (M, K) -> (M, N)
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        path = "packed" if self.packed else "dequant"
        return f"{self.in_features} -> {self.out_features}, {self.scheme}, {path}"


class Int8Linear(QuantLinear):
    scheme = "int8"

    def __init__(self, weight, bias, packed: bool):
        super().__init__(weight, bias, packed)
        q, scale = by_rows(lambda w: quantize_int8(w, scale_dtype(weight.dtype)), weight)
        self.register_buffer("weight_int8", q)  # (N, K)
        self.register_buffer("scale", scale)  # (N,) 16-bit

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8(self.weight_int8, self.scale, dtype)

    def matmul(self, x):
        if self.packed:  # the kernel wants the scales in the activation dtype (N values: cheap)
            return aten._weight_int8pack_mm(x, self.weight_int8, self.scale.to(x.dtype))
        return F.linear(x, self.dequantize(x.dtype))


class Int4Linear(QuantLinear):
    """Dequant path: `weight_packed` (N, ceil(K/2)) uint8, `scale` and `zero` (N, G). Packed path:
    the tinygemm layout (`_convert_weight_to_int4pack[_for_cpu]`, N K / 2 bytes) and
    `scales_and_zeros` (G, N, 2): the same bytes in the kernel's order."""

    scheme = "int4"

    def __init__(self, weight, bias, group_size: int, packed: bool, quantizer: Int4Quantizer | None = None):
        super().__init__(weight, bias, packed)
        self.group_size = group_size
        layout = self.kernel_layout if packed else pack_int4
        quantizer = quantizer or quantize_int4  # GPTQ's (labkit.blocks.calibrated): the same format

        def quantize(w):
            q, scale, zero = quantizer(w, group_size, scale_dtype(weight.dtype))
            return layout(q), scale, zero

        data, scale, zero = by_rows(quantize, weight)
        self.register_buffer("weight_packed", data)
        if not packed:
            self.register_buffer("scale", scale)
            self.register_buffer("zero", zero)
        else:
            self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous())

    def kernel_layout(self, q: torch.Tensor) -> torch.Tensor:
        """(N, K) values 0..15 in the kernel's layout, on q's device (built where it runs)."""
        if q.device.type == "cuda":  # (N, K/2) uint8, the even input in the high nibble
            tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
            return aten._convert_weight_to_int4pack((q[:, 0::2] << 4) | q[:, 1::2], tiles)
        return aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequant layout's weight (N, K) in `dtype` (the packed layout is the kernel's)."""
        return dequantize_int4(unpack_int4(self.weight_packed, self.in_features), self.scale,
                               self.zero, self.group_size, dtype)

    def matmul(self, x):
        if not self.packed:
            return F.linear(x, self.dequantize(x.dtype))
        sz = self.scales_and_zeros.to(x.dtype)
        if x.is_cuda:
            return aten._weight_int4pack_mm(x, self.weight_packed, self.group_size, sz)
        return aten._weight_int4pack_mm_for_cpu(x, self.weight_packed, self.group_size, sz)


class Fp8Linear(QuantLinear):
    scheme = "fp8"

    def __init__(self, weight, bias, packed: bool = False):
        super().__init__(weight, bias, False)  # dequant only: see packed_reason
        w8, scale = by_rows(lambda w: quantize_fp8(w, scale_dtype(weight.dtype)), weight)
        self.register_buffer("weight_fp8", w8)
        self.register_buffer("scale", scale)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight_fp8.to(dtype) * self.scale.to(dtype)[:, None]

    def matmul(self, x):
        return F.linear(x, self.dequantize(x.dtype))


def quantize_linear(linear: nn.Linear, scheme: str, *, group_size: int = 64,
                    kernel: str = "auto", quantizer: Int4Quantizer | None = None) -> QuantLinear:
    """`linear` as a QuantLinear on its device: the packed kernel unless `kernel` is `dequant` or
    `packed_reason` says it cannot serve this shape. `quantizer`: int4's rounding of each chunk
    of rows, RTN (`quantize_int4`) unless given."""
    w = linear.weight.detach()
    N, K = w.shape
    packed = kernel != "dequant" and packed_reason(scheme, N, K, group_size, w.device, w.dtype) is None
    if scheme == "int8":
        return Int8Linear(w, linear.bias, packed)
    if scheme == "fp8":
        return Fp8Linear(w, linear.bias)
    try:
        return Int4Linear(w, linear.bias, group_size, packed, quantizer)
    except RuntimeError:  # a layout constraint packed_reason does not know of: dequant (counted)
        if not packed:
            raise
        return Int4Linear(w, linear.bias, group_size, False, quantizer)


# --- the model transform -------------------------------------------------------------------------------

def target_linears(model: Decoder) -> list[str]:
    """Names of the linears quantized: every block linear and the output head."""
    return [name for name, mod in model.named_modules()
            if isinstance(mod, (nn.Linear, QuantLinear)) and (name.startswith("layers.") or name == "lm_head")]


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def apply_weight_quant(model: Decoder, scheme: str, *, group_size: int = 64,
                       kernel: str = "auto") -> Decoder:
    """Replace every block linear and the head by its quantized form, one at a time (each
    full-precision weight is freed as soon as it is replaced, unless held elsewhere). A head
    tied to the embedding gets a quantized copy; the embedding stays."""
    for name in target_linears(model):
        _set(model, name, quantize_linear(model.get_submodule(name), scheme, group_size=group_size,
                                          kernel=kernel))
    return model


def kernel_paths(model: nn.Module) -> dict[str, int]:
    """How many quantized linears each path runs: {'packed_layers': n, 'dequant_layers': m}."""
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return {"packed_layers": sum(m.packed for m in quant),
            "dequant_layers": sum(not m.packed for m in quant)}


def stored_weights(model: Decoder) -> list[torch.Tensor]:
    """What `weight_bytes` counts: each target linear's weight as stored (data, scales, zero
    points), biases excluded; an unquantized linear's `weight`."""
    out = []
    for name in target_linears(model):
        mod = model.get_submodule(name)
        out += mod.stored() if isinstance(mod, QuantLinear) else [mod.weight]
    return out


# --- loading ------------------------------------------------------------------------------------------

Checkpoint = dict[str, torch.Tensor]


def open_checkpoint(path: str) -> Checkpoint:
    """The tensors of a .safetensors file, memory-mapped (copy-on-write): nothing is read into
    the process until a tensor is copied out, as safetensors' own loader does."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header, base = read_header(mapped)
    out = {}
    for name, entry in header.items():
        dtype, (begin, end) = CODE_DTYPES[entry["dtype"]], entry["data_offsets"]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + begin)
        out[name] = flat.view(entry["shape"])
    return out


def _materialize(src: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """A copy of checkpoint tensor `src` in the process (never a view of the mapped file)."""
    return torch.empty(src.shape, dtype=dtype, device=device).copy_(src)


def _source(checkpoint: Checkpoint, name: str) -> torch.Tensor:
    if name == "lm_head.weight" and name not in checkpoint:
        return checkpoint["embed.weight"]  # a tied head saved once
    return checkpoint[name]


def load_quantized(cfg: ModelConfig, checkpoint: Checkpoint, *, dtype: torch.dtype, device,
                   scheme: str | None, group_size: int = 64, kernel: str = "auto",
                   attention: str = "sdpa") -> Decoder:
    """Quantize on load: the model built on `meta`; each target linear materialized from the
    checkpoint, quantized and its full-precision weight dropped before the next; the rest (the
    embedding, norms, biases) materialized in `dtype`. `scheme` None: no quantization."""
    model = build_model(cfg, device="meta", attention=attention)
    targets = set(target_linears(model))
    for name, mod in list(model.named_modules()):
        if name in targets:
            linear = nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta")
            linear.weight = nn.Parameter(_materialize(_source(checkpoint, name + ".weight"), dtype, device))
            if mod.bias is not None:
                linear.bias = nn.Parameter(_materialize(checkpoint[name + ".bias"], dtype, device))
            _set(model, name, linear if scheme is None else
                 quantize_linear(linear, scheme, group_size=group_size, kernel=kernel))
            continue
        for pname, p in mod.named_parameters(recurse=False):  # embedding, norms
            full = f"{name}.{pname}".lstrip(".")
            setattr(mod, pname, nn.Parameter(_materialize(checkpoint[full], dtype, device)))
    if scheme is None and cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


def load_full(cfg: ModelConfig, checkpoint: Checkpoint, *, dtype: torch.dtype, device,
              attention: str = "sdpa") -> Decoder:
    """The whole full-precision model materialized from the checkpoint (then, for
    `load_then_quantize`, `apply_weight_quant`)."""
    model = build_model(cfg, device="meta", attention=attention)
    state = {name: _materialize(_source(checkpoint, name), dtype, device) for name in model.state_dict()}
    model.load_state_dict(state, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.eval()


LOADINGS: dict[str, Callable] = {"quantize_on_load": load_quantized, "load_then_quantize": load_full}
