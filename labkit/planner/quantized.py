"""The bytes of a frozen base stored quantized, for fine-tuning on a small memory: torchao's NF4
(QLoRA) and labkit.blocks.quant's weight-only int8 and int4, what each stores (`nf4_bytes`,
`weight_only_bytes`) and what one matmul's dequantization holds (`nf4_dequant_bytes`,
`weight_only_dequant_bytes`), each held to the measured bytes in the tests."""
from __future__ import annotations

from labkit.config import DTYPE_BYTES, ConfigError, check_choice
from labkit.planner.plan import _positive

NF4_BLOCK_SIZE = 64  # weights per int8 absmax scaler (the QLoRA paper's and torchao's default)
NF4_SCALER_BLOCKS = (256, 128, 64, 32, 16, 8, 4, 2, 1)  # torchao's default first: 256
INT4_GROUP_SIZE = 64  # inputs per int4 scale and zero point (gpt-fast's and torchao's default)


def nf4_scaler_block(numel: int, block_size: int = NF4_BLOCK_SIZE) -> int:
    """The scaler block size for one weight: the largest of 256, 128, ..., 1 that divides its
    number of blocks (torchao asserts that it divides). ConfigError when `block_size` does not
    divide `numel`."""
    _positive(numel=numel, block_size=block_size)
    if numel % block_size or numel % 2:
        raise ConfigError(f"a weight of {numel} elements does not split into NF4 blocks of "
                          f"{block_size} (valid: an even number of elements divisible by it)")
    blocks = numel // block_size
    return next(n for n in NF4_SCALER_BLOCKS if blocks % n == 0)


def nf4_bytes(out_features: int, in_features: int, *, block_size: int = NF4_BLOCK_SIZE,
              double_quant: bool = True, dtype: str = "fp32") -> int:
    """One weight as NF4 stores it. double_quant (torchao's NF4Tensor, quantized from a `dtype`
    weight): 4-bit codes two per byte, an int8 scaler per block, one `dtype` factor per scaler
    block (`nf4_scaler_block`; with a single scaler block torchao keeps a view of a whole
    scaler-block-long tensor, so that many), the scalers' mean and the 16-entry code book, both
    in `dtype`. Without double quantization (the QLoRA paper's baseline, not a torchao option):
    codes plus one fp32 absmax per block."""
    numel = out_features * in_features
    sb = nf4_scaler_block(numel, block_size)
    blocks, w = numel // block_size, DTYPE_BYTES[_dtype_name(dtype)]
    if not double_quant:
        return numel // 2 + 4 * blocks
    factors = blocks // sb if blocks // sb > 1 else blocks
    return numel // 2 + blocks + w * factors + w + 16 * w


def weight_only_bytes(out_features: int, in_features: int, scheme: str,
                      group_size: int = INT4_GROUP_SIZE, dtype_bytes: int = 4) -> int:
    """Bytes one (N, K) linear weight is stored in by weight-only quantization (labkit.blocks.quant):
    data plus 16-bit scales and zero points. `none`: N K dtype_bytes; int8 and fp8: N K + 2 N;
    int4: N ceil(K / 2) + 4 N ceil(K / group)."""
    N, K = out_features, in_features
    if scheme == "none":
        return N * K * dtype_bytes
    if scheme in ("int8", "fp8"):
        return N * K + 2 * N
    return N * -(-K // 2) + 2 * 2 * N * -(-K // group_size)


def weight_only_dequant_bytes(out_features: int, in_features: int, scheme: str, *,
                              dtype: str = "fp32", group_size: int = INT4_GROUP_SIZE) -> int:
    """The peak of dequantizing one (N, K) int8 or int4 weight (labkit.blocks.quant's dequant
    layout) for one matmul, forward or backward, in a w-byte `dtype`. int8, q·scale: q in the
    dtype and the product (2·w·N·K) beside the scales in it (w·N). int4, (q - 8)·scale + zero:
    the unpacked codes (N·K bytes), q - 8 and the product (2·w·N·K) and a per-group value
    repeated over the padded row (w·N·ceil(K / group)·group). Measured with LiveTensorTracker
    in the tests."""
    N, K, w = out_features, in_features, DTYPE_BYTES[_dtype_name(dtype)]
    if scheme == "int8":
        return 2 * w * N * K + w * N
    return (1 + 2 * w) * N * K + w * N * -(-K // group_size) * group_size


def nf4_dequant_bytes(out_features: int, in_features: int, *, dtype: str = "fp32",
                      block_size: int = NF4_BLOCK_SIZE) -> int:
    """The peak of torchao's dequantization of one weight (get_original_weight, in forward and
    again in backward): two int64 code tensors (numel/2 each: 8·numel), the two looked-up halves
    and their scaled copies (w·numel/2 each), the stacked weight (w·numel) and the dequantized
    scalers (w per block); measured with LiveTensorTracker in the tests."""
    numel, w = out_features * in_features, DTYPE_BYTES[_dtype_name(dtype)]
    return numel * (8 + 3 * w) + w * (numel // block_size)


def _dtype_name(dtype: str) -> str:
    from labkit.config import DTYPE_ALIASES

    return DTYPE_ALIASES[check_choice("compute dtype", dtype, tuple(DTYPE_ALIASES))]
