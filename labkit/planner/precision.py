"""Bytes per element of what a training step keeps, for each precision recipe, and K, the
optimizer's bytes per parameter in ZeRO's notation (`optimizer_bytes_per_param`); for AdamW with
8- or 4-bit moments, its states and its update's temporaries per tensor (`low_bit_state_bytes`,
`low_bit_update_bytes`)."""
from __future__ import annotations

from dataclasses import dataclass

from labkit.config import ConfigError, check_choice

# One vocabulary with the recipe (`labkit run recipe --set precision=...`), the mixed-precision
# experiment, the ladder and the panel: what runs is named as it is planned.
PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "bf16_weights", "bf16_pure", "fp16_pure")
OPTIMIZERS = ("adam", "adamw", "sgd", "adamw8bit", "adamw4bit")


@dataclass(frozen=True)
class LowBit:
    """How torchao stores one AdamW moment of a quantized parameter (`labkit.blocks.optimizers`)."""

    bits: int  # per element of the codes (4: two to a byte)
    block: int  # elements per fp32 absmax scale
    map_size: int  # fp32 values of the quantization map, one map per moment


LOW_BIT = {"adamw8bit": LowBit(bits=8, block=256, map_size=256),
           "adamw4bit": LowBit(bits=4, block=128, map_size=16)}
QUANTIZED_MIN = 4096  # elements: a smaller parameter keeps fp32 moments (bitsandbytes' rule too)
LOW_BIT_IMPLS = ("eager", "compiled")


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each thing a training step keeps, for one precision recipe."""

    weight: int  # the weights the model computes with
    grad: int  # their gradients
    moment: int  # one optimizer moment (Adam's m or v, SGD's momentum)
    master: int  # an fp32 master copy of the weights kept by the optimizer (0: none)
    act: int  # activations (where the model does not upcast on purpose)
    cast: int = 0  # autocast: bytes of its 16-bit compute dtype (0: no autocast)
    unsharded: int = 0  # FSDP2's gathered weights and unsharded gradients (0: as weight and grad)

    @property
    def gathered(self) -> int:
        """The dtype of the weights FSDP2 gathers (and of the gradients it makes whole)."""
        return self.unsharded or self.weight

    @property
    def whole_grad(self) -> int:
        """The dtype of a gradient the backward makes whole, before it is sharded or reduced."""
        return self.unsharded or self.grad

    @property
    def residual(self) -> int:
        """The residual stream's (and the norms') dtype: fp32 under autocast, which leaves adds
        and norms to the weights' dtype; the activation dtype otherwise."""
        return 4 if self.cast else self.act


_FP32 = PrecisionBytes(weight=4, grad=4, moment=4, master=0, act=4)
# Autocast (torch.autocast) over fp32 weights, fp32 gradients and fp32 AdamW: the matmuls'
# inputs and outputs (and SDPA's) in 16 bits, the residual stream and the norms in fp32, and
# a cached 16-bit copy of every matmul weight (`_weight_casts`).
_AUTOCAST = PrecisionBytes(weight=4, grad=4, moment=4, master=0, act=2, cast=2)
# Pure 16-bit: weights, gradients and optimizer moments all in 16 bits, no master copy.
_PURE = PrecisionBytes(weight=2, grad=2, moment=2, master=0, act=2)
PRECISION_BYTES = {
    "fp32": _FP32,
    "tf32": _FP32,  # fp32 tensors; only the matmuls' inputs are rounded (to 10-bit mantissas)
    "bf16": _AUTOCAST,
    "fp16": _AUTOCAST,  # with a GradScaler, which holds no tensor of the model's size
    # ZeRO's mixed precision: 16-bit weights and gradients, fp32 master weights and moments:
    # 2 + 2 + K with K = 12 for Adam (master 4 + m 4 + v 4), 16 bytes per parameter.
    "bf16_weights": PrecisionBytes(weight=2, grad=2, moment=4, master=4, act=2),
    "bf16_pure": _PURE,
    "fp16_pure": _PURE,
}
# bf16 under FSDP2 (ZeRO-2 and 3) is its MixedPrecisionPolicy(param_dtype=bf16,
# reduce_dtype=fp32) in place of autocast (`compose`, step 1): fp32 shards, gradient shards and
# AdamW; each unit gathered in bf16, its forward, backward and whole gradients in bf16, reduced
# in fp32 (`precision_bytes`).
FSDP2_BF16 = PrecisionBytes(weight=4, grad=4, moment=4, master=0, act=2, unsharded=2)
DTYPE_OF = {"fp32": "float32", "tf32": "float32", "bf16": "bfloat16", "fp16": "float16",
            "bf16_weights": "bfloat16", "bf16_pure": "bfloat16", "fp16_pure": "float16"}


def precision_bytes(precision: str, *, fsdp2_sharded: bool = False) -> PrecisionBytes:
    """The bytes of `precision` (one of PRECISIONS) as the step runs it: bf16 on FSDP2's
    sharded stages is its mixed-precision policy (FSDP2_BF16), elsewhere autocast."""
    check_choice("precision", precision, PRECISIONS)
    return FSDP2_BF16 if precision == "bf16" and fsdp2_sharded else PRECISION_BYTES[precision]


def optimizer_bytes_per_param(precision: str, optimizer: str) -> int:
    """K in ZeRO's notation: the optimizer's bytes per parameter. Adam/AdamW keep two moments
    (m, v); SGD with momentum keeps one buffer; bf16_weights adds the fp32 master copy.
    (K = 12 for mixed-precision Adam, as in the ZeRO paper.)"""
    p = PRECISION_BYTES[check_choice("precision", precision, PRECISIONS)]
    if check_choice("optimizer", optimizer, OPTIMIZERS) in LOW_BIT:
        raise ConfigError(f"{optimizer}'s bytes per parameter depend on each tensor's size "
                          "(low_bit_state_bytes); K is for adam, adamw and sgd")
    moments = 1 if optimizer == "sgd" else 2
    return p.master + moments * p.moment


def quantized(numel: int, optimizer: str) -> bool:
    """Whether torchao keeps this parameter's moments in low bits: at least QUANTIZED_MIN
    elements, a whole number of blocks."""
    return numel >= QUANTIZED_MIN and numel % LOW_BIT[optimizer].block == 0


def low_bit_state_bytes(sizes: list[int], optimizer: str) -> int:
    """AdamW's two moments for parameters of `sizes` elements under `optimizer` (LOW_BIT): a
    quantized one n·bits/8 bytes of codes, 4 per block of scale and its map each; the others
    fp32, 4 bytes each. (The per-tensor step counters, 4 bytes each, are not counted, as for
    torch's AdamW.)"""
    q = LOW_BIT[check_choice("optimizer", optimizer, tuple(LOW_BIT))]
    return sum(2 * (n * q.bits // 8 + 4 * (n // q.block) + 4 * q.map_size) if quantized(n, optimizer)
               else 2 * 4 * n for n in sizes)


# torchao's eager update of one parameter at its busiest, bytes per element: the decayed fp32
# weights and both fp32 moments (12) while a moment is quantized again, whose branchless binary
# search holds 41 more: the scaled fp32 input (4), int64 codes and their rounded-up neighbours
# (8 + 8), the two map values around each element (4 + 4), the residual, the gap and its half
# (4 + 4 + 4) and a bool mask (1). A parameter with fp32 moments: 24, six fp32 tensors at the
# update's end. Both plus the two 0-dim bias corrections (8 bytes). Counted op by op in
# torchao 0.18's `single_param_adam` and `quantize_8bit_with_qmap`; the tests hold it to the
# live-tensor tracker.
EAGER_QUANTIZED_BYTES, EAGER_FP32_BYTES, BIAS_CORRECTIONS = 53, 24, 8


def low_bit_update_bytes(sizes: list[int], optimizer: str, impl: str) -> int:
    """The temporaries of `optimizer`'s step: torchao updates one parameter at a time, so the
    largest of one parameter's; eager (a CPU's) per EAGER_QUANTIZED_BYTES / EAGER_FP32_BYTES,
    plus its new block scales; compiled (one fused kernel per parameter): none."""
    q = LOW_BIT[check_choice("optimizer", optimizer, tuple(LOW_BIT))]
    if check_choice("optimizer_impl", impl, LOW_BIT_IMPLS) == "compiled":
        return 0
    return BIAS_CORRECTIONS + max(
        EAGER_QUANTIZED_BYTES * n + 4 * (n // q.block) if quantized(n, optimizer) else EAGER_FP32_BYTES * n
        for n in sizes)
