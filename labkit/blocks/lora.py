"""LoRA adapters and a quantized frozen base (NF4, int8, int4) for labkit's decoder, applied from
outside (the model stays plain).

- `apply_lora(model, targets, rank=, alpha=)`: PEFT's `LoraConfig` and `get_peft_model`. PEFT fits
  this decoder as it is: its block linears are plain `nn.Linear`s named by attribute (`attn.wq`,
  `mlp.w1`, ...), which PEFT's `target_modules` matches by name suffix
  (`planner.lora_module_names`: the targets' attributes, checked against the architecture). `get_peft_model` swaps each
  targeted linear for a `peft.tuners.lora.Linear` in place and freezes everything else, so the
  decoder object itself carries the adapters; the `PeftModel` wrapper it returns only forwards.
  Each targeted W (out x in) gets A (r x in, Kaiming-uniform) and B (out x r, zeros), and the
  output is W x + (alpha / r) B A x: at initialisation exactly the base's.
- `apply_nf4(model, block_size)`: every block linear's weight as torchao's `NF4Tensor` (the QLoRA
  paper's 4-bit NormalFloat, as torchtune uses it): 4-bit codes, an absmax scaler per
  `block_size` weights, the scalers themselves double-quantized to int8 with one factor per
  `planner.nf4_scaler_block(numel, block_size)` scalers (torchao needs that block to divide the
  number of scalers; the planner counts the same bytes). Each matmul dequantizes it to the
  input's dtype, forward and backward (`FrozenMatmul`), and keeps only the 4-bit weight.
- `apply_weight_only(model, scheme)`: the same for weight-only int8 (a scale per output channel)
  or int4 (a scale and zero point per 64 inputs), `labkit.blocks.quant`'s formats: LoRA on an
  8- or 4-bit round-to-nearest base (methods `lora_int8`, `lora_int4`), no extra library.
- A tensor subclass's bytes are its inner tensors' storage (`labkit.measure.memory.storage_bytes`;
  an `NF4Tensor`'s own storage is a placeholder of the unquantized size).

PEFT and torchao are optional (`pip install labkit[finetune]`): imported inside the functions.
"""
from __future__ import annotations

import functools
import hashlib
import math
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from labkit import planner
from labkit.measure.memory import inner_tensors

NEEDS = {"lora": ("peft",), "qlora": ("peft", "torchao"), "lora_int8": ("peft",),
         "lora_int4": ("peft",)}  # the libraries of each method


def missing_library(method: str) -> str | None:
    """The first library `method` (lora, qlora) needs that does not import here, or None."""
    for name in NEEDS.get(method, ()):
        try:
            __import__(name)
        except ImportError:
            return name
    return None


def block_linears(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """(name, module) of every linear inside the decoder blocks (not the head), the base's own:
    under a PEFT wrapper its `base_layer`."""
    for name, module in model.named_modules():
        if ".layers." in f".{name}" and isinstance(module, nn.Linear) and not _is_adapter(name):
            yield name, module


def _is_adapter(name: str) -> bool:
    return ".lora_" in name or name.split(".")[-1].startswith("lora_")


def apply_lora(model: nn.Module, targets: tuple[str, ...], *, rank: int, alpha: float) -> nn.Module:
    """Rank-`rank` adapters on the targeted block linears of `model`, in place (PEFT); every other
    weight frozen. The adapters take the base layer's dtype (`autocast_adapter_dtype=False`: PEFT
    would otherwise keep them in fp32 under a bf16 base). Returns the same decoder."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                        target_modules=planner.lora_module_names(model.cfg, targets))
    get_peft_model(model, config, autocast_adapter_dtype=False)  # injects into `model` itself
    return model


def adapters(model: nn.Module) -> Iterator[tuple[nn.Module, nn.Linear, nn.Linear, float]]:
    """(base linear, A, B, scaling) of each LoRA layer in `model`, in module order."""
    for module in model.modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            yield (module.base_layer, module.lora_A["default"], module.lora_B["default"],
                   module.scaling["default"])


def apply_nf4(model: nn.Module, block_size: int = planner.NF4_BLOCK_SIZE) -> float:
    """Every block linear's weight as an NF4Tensor, in place, made from the weight as it is (its
    dtype is what it dequantizes to). Returns the largest ratio, over the weights, of the error
    max |w - deq(w)| to its bound (`nf4_error_bound`): at most 1 when the format holds.

    The NF4 weight is a buffer, not a Parameter: `nn.Parameter(nf4)` runs a detach that makes
    a second wrapper, whose placeholder storage labkit's CPU memory tracker would count at the
    unquantized size; and a frozen base has nothing to train."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    worst = 0.0
    for _, linear in list(block_linears(model)):
        w = linear.weight.detach()
        if w.numel() % block_size:
            raise ValueError(f"a {tuple(w.shape)} weight does not split into blocks of {block_size}")
        nf4 = to_nf4(w, block_size, planner.nf4_scaler_block(w.numel(), block_size))
        error = (w.float() - nf4.get_original_weight().float()).abs().reshape(-1, block_size)
        worst = max(worst, float((error.amax(1) / nf4_error_bound(w, nf4)).max()))
        del linear.weight
        linear.register_buffer("weight", nf4)
        linear.forward = functools.partial(frozen_linear, linear)
    return worst


class FrozenMatmul(torch.autograd.Function):
    """y = x deq(W)^T, and dL/dx = g deq(W) in backward, for a frozen weight stored quantized:
    the dequantized copy lives only for each matmul. `weight` is an NF4Tensor (its `.to(dtype)`
    dequantizes) or a QuantLinear holder (its `dequantize(dtype)`). As torchao's LinearNF4,
    except that the weight is kept on `ctx` rather than with save_for_backward, which detaches
    an NF4Tensor into a second wrapper whose placeholder storage (the unquantized size) labkit's
    CPU memory tracker would count as a new tensor; the weight is a leaf that needs no grad, so
    keeping it on ctx makes no reference cycle."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight) -> torch.Tensor:
        ctx.weight = weight
        return F.linear(x, dequantized(weight, x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad @ dequantized(ctx.weight, grad.dtype), None


def dequantized(weight, dtype: torch.dtype) -> torch.Tensor:
    return weight.dequantize(dtype) if isinstance(weight, nn.Module) else weight.to(dtype)


def frozen_linear(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The forward of a linear whose weight is stored quantized (NF4: `linear.weight`; int8 or
    int4: `linear.quantized`); its bias, if any, stays in its dtype."""
    y = FrozenMatmul.apply(x, linear.quantized if hasattr(linear, "quantized") else linear.weight)
    return y if linear.bias is None else y + linear.bias


def apply_weight_only(model: nn.Module, scheme: str,
                      group_size: int = planner.INT4_GROUP_SIZE) -> None:
    """Every block linear's weight stored in `scheme` (int8: per output channel; int4: per
    `group_size` inputs), in place: the weight leaves the nn.Linear (which PEFT still wraps),
    its quantized form (`labkit.blocks.quant`'s dequant layout, the bytes `weight_only_bytes`
    counts) becomes the child `quantized`, and each matmul dequantizes it (`FrozenMatmul`)."""
    from labkit.blocks import quant

    for _, linear in list(block_linears(model)):
        w = linear.weight.detach()
        holder = quant.quantize_linear(linear, scheme, group_size=group_size, kernel="dequant")
        holder.bias = None  # the bias stays on the linear (frozen_linear adds it)
        del linear.weight
        linear.quantized = holder
        # what PEFT reads to place and cast the adapters: an empty stand-in of the weight's dtype
        # and device (a plain attribute, not a buffer: the holder's tensors are the stored ones)
        linear.weight = torch.empty(0, dtype=w.dtype, device=w.device)
        linear.forward = functools.partial(frozen_linear, linear)


def quantize_base(model: nn.Module, method: str) -> float:
    """The frozen base's block linears stored as `method` keeps them (planner.BASE_FORMAT: NF4
    for qlora, int8 or int4 for lora_int8 and lora_int4), in place; nothing for the others.
    Returns the NF4 weights' worst error against its bound (`apply_nf4`), nan when not NF4."""
    scheme = planner.BASE_FORMAT.get(method)
    if scheme == "nf4":
        return apply_nf4(model)
    if scheme:
        apply_weight_only(model, scheme)
    return math.nan


# NF4's 16 codes (the QLoRA paper's, as torchao stores them): normal quantiles scaled to [-1, 1].
NF4_CODES = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609,
             0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)
NF4_HALF_GAP = max(b - a for a, b in zip(NF4_CODES, NF4_CODES[1:])) / 2  # 0.1519 (-1 to -0.6962)


def nf4_error_bound(w: torch.Tensor, nf4) -> torch.Tensor:
    """Per block, the most |w - deq(w)| may be. Rounding w / absmax to the nearest code errs by at
    most half the largest code gap times the block's absmax a; dequantizing multiplies the code
    (|code| <= 1) by the double-quantized scaler, which is off a by at most one int8 step of its
    scaler block (2 max|a - mean| / 256; one step, not half, since 128 clamps to 127); and the
    product is rounded to w's dtype (eps x a). (num_blocks,), fp32."""
    block = nf4.block_size
    absmax = w.float().reshape(-1, block).abs().amax(1)  # (num_blocks,)
    deviation = (absmax - absmax.mean()).reshape(-1, nf4.scaler_block_size).abs().amax(1)
    step = (2 * deviation / 256).repeat_interleave(nf4.scaler_block_size)
    return (NF4_HALF_GAP + torch.finfo(w.dtype).eps) * absmax + step + 1e-12


# --- bytes of what is stored ----------------------------------------------------------------------

def base_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every weight of the base model as stored: the parameters and buffers that are not adapters
    (the NF4 weights are buffers)."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [t for name, t in named if not _is_adapter(name)]


def linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """The base's block linear weights as stored (NF4, int8 or int4 with their scales, or plain),
    adapters left out."""
    return [t for _, linear in block_linears(model) for t in
            (linear.quantized.stored() if hasattr(linear, "quantized") else [linear.weight])]


def digest(tensors: Iterable[torch.Tensor]) -> str:
    """A SHA-1 of the bytes of `tensors` as stored: equal digests mean bitwise-equal tensors. Kept
    as a digest, not a copy, so checking the frozen base holds no memory."""
    h = hashlib.sha1()
    for t in inner_tensors(tensors):
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()
