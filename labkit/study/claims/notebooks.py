"""Claims of the notebooks' Markdown: the experiment notebooks' text (notebooks/text/*.md) and
the exercises' (notebooks/exercises/text/*.md, whose computed numbers are `{placeholders}`
filled by labkit at run time; the few typed ones are here)."""
from __future__ import annotations

import dataclasses

from labkit import hardware, planner
from labkit.blocks import fp8
from labkit.config import MODELS
from labkit.planner.compression import UNIT_ROUNDOFF
from labkit.planner.precision import (BIAS_CORRECTIONS, EAGER_FP32_BYTES, EAGER_QUANTIZED_BYTES, LOW_BIT,
                                      QUANTIZED_MIN)
from labkit.study.claims.base import GIB, H100, H200, LLAMA3, Claim, bf16_peak, ridge, sci, state_bytes, tbps
from labkit.study.claims.serving import bits_int4, int8_kv_ratio, saved_mib
from labkit.study.claims.training import nf4_bits

NB, EX = "notebooks/text/", "notebooks/exercises/text/"
LOW8 = LOW_BIT["adamw8bit"]


def gqa_gib(kv_heads: int) -> float:
    """Llama-3-8B's bf16 KV cache of one 8,192-token sequence with `kv_heads` kv heads."""
    m = dataclasses.replace(LLAMA3, num_kv_heads=kv_heads)
    return planner.kv_cache_bytes(m, batch_size=1, seq_len=8192) / GIB


def pcie_gbps() -> int:
    """PCIe Gen4 x16's GB/s one way, as data/gpus.json's A100 PCIe row holds it."""
    return hardware.gpu_spec("A100 PCIe 40GB")["interconnect_gbps"]


CLAIMS = [
    Claim(NB + '00_environment.md', 'about 295 bf16 FLOP per byte of HBM traffic (989.5 TFLOP/s over 3.35 TB/s), an H200 about 206 (over 4.8 TB/s)',
          lambda: (f"about {ridge(H100):.0f} bf16 FLOP per byte of HBM traffic ({bf16_peak(H100)} TFLOP/s over "
                   f"{tbps(H100)} TB/s), an H200 about {ridge(H200):.0f} (over {tbps(H200)} TB/s)")),
    Claim(NB + '01_mixed_precision.md', '4 bytes per parameter in fp32, **2** with `bf16_weights`',
          lambda: f"{state_bytes('fp32')[0]} bytes per parameter in fp32, **{state_bytes('bf16_weights')[0]}** with `bf16_weights`"),
    Claim(NB + '01_mixed_precision.md', 'two fp32 moments (8 bytes per parameter); `bf16_weights` adds a 4-byte fp32 master copy (12 bytes)',
          lambda: (f"two fp32 moments ({state_bytes('fp32')[2]} bytes per parameter); `bf16_weights` adds a "
                   f"{planner.PRECISION_BYTES['bf16_weights'].master}-byte fp32 master copy ({state_bytes('bf16_weights')[2]} bytes)")),
    Claim(NB + '02_kv_cache.md', '0.508x on tiny (2 kv heads of head_dim 64)',
          lambda: (f"{int8_kv_ratio('per_token'):.3f}x on tiny ({MODELS['tiny'].num_kv_heads} kv heads of head_dim "
                   f"{MODELS['tiny'].head_dim})")),
    Claim(NB + '02_kv_cache.md', '(2 x head_dim): 0.516x',
          lambda: f"(2 x head_dim): {int8_kv_ratio('per_head'):.3f}x"),
    Claim(NB + '08_memory_planner.md', '2 + 2 + 12 = 16 bytes per parameter',
          lambda: "{} + {} + {} = {} bytes per parameter".format(*state_bytes('bf16_weights'), sum(state_bytes('bf16_weights')))),
    Claim(NB + '08_memory_planner.md', "fp32's 4 + 4 + 8 again",
          lambda: "fp32's {} + {} + {} again".format(*state_bytes('fp32'))),
    Claim(NB + '08_memory_planner.md', '`bf16_pure` (8 bytes: 16-bit moments too)',
          lambda: f"`bf16_pure` ({sum(state_bytes('bf16_pure'))} bytes: 16-bit moments too)"),
    Claim(NB + '08_memory_planner.md', 'fp32 model states (16 bytes)',
          lambda: f"fp32 model states ({sum(state_bytes('bf16'))} bytes)"),
    Claim(NB + '09_collectives.md', '(NVLink 4 on H100/H200: 450 GB/s one way; PCIe Gen4 x16: 32)',
          lambda: (f"(NVLink 4 on H100/H200: {H100['interconnect_gbps']} GB/s one way; PCIe Gen4 x16: "
                   f"{pcie_gbps()})")),
    Claim(NB + '17_attention.md', '3.7x on tiny from 1024 to 2048',
          lambda: f"{saved_mib(2048, 'naive') / saved_mib(1024, 'naive'):.1f}x on tiny from 1024 to 2048"),
    Claim(NB + '20_matmul.md', '(85 at 512)',
          lambda: f"({2 * 512 / 3 / 4:.0f} at 512)"),
    Claim(NB + '20_matmul.md', 'fp16 keeps 10 mantissa bits (2^-11 ≈ 4.9e-4), bf16 7 (2^-8 ≈ 3.9e-3)',
          lambda: (f"fp16 keeps 10 mantissa bits (2^-11 ≈ {sci(UNIT_ROUNDOFF['fp16'])}), bf16 7 "
                   f"(2^-8 ≈ {sci(UNIT_ROUNDOFF['bf16'])})")),
    Claim(NB + '20_matmul.md', '(989.5 against 67 TFLOP/s on an H100 SXM datasheet)',
          lambda: f"({bf16_peak(H100)} against {H100['peak_tflops']['float32']} TFLOP/s on an H100 SXM datasheet)"),
    Claim(NB + '26_recipe.md', 'every tensor of 4096 elements or more as 8-bit codes with an fp32 scale per 256',
          lambda: f"every tensor of {QUANTIZED_MIN} elements or more as {LOW8.bits}-bit codes with an fp32 scale per {LOW8.block}"),
    Claim(NB + '26_recipe.md', '53 bytes per element of the largest tensor',
          lambda: f"{EAGER_QUANTIZED_BYTES} bytes per element of the largest tensor"),
    Claim(NB + '27_weight_quant.md', '0.14x at group 64',
          lambda: f"{bits_int4(64) / 32:.2f}x at group 64"),
    Claim(NB + '27_weight_quant.md', "(the MLP's 688 on `tiny`, 344 on `reference`)",
          lambda: f"(the MLP's {MODELS['tiny'].ffn_size} on `tiny`, {MODELS['reference'].ffn_size} on `reference`)"),
    Claim(NB + '30_finetune.md', 'about 4.13 bits per weight, so about 0.13x of fp32',
          lambda: f"about {nf4_bits():.2f} bits per weight, so about {nf4_bits() / 32:.2f}x of fp32"),
    Claim(NB + '30_finetune.md', '4 + 2 × 16 / 64 = 4.5 bits a weight',
          lambda: f"4 + 2 × 16 / 64 = {bits_int4(64)} bits a weight"),
    Claim(NB + '32_fp8.md', '2^-4 = 6.25% and 2^-3 = 12.5%',
          lambda: f"2^-4 = {fp8.rounding_bound('e4m3'):.2%} and 2^-3 = {fp8.rounding_bound('e5m2'):.1%}"),
    Claim(NB + '32_fp8.md', 'about 0.196 x 2^-m',
          lambda: f"about {fp8.rms_rounding_error('e4m3') * 2**fp8.MANTISSA_BITS['e4m3']:.3f} x 2^-m"),
    Claim(NB + '35_grad_compression.md', "int8's scales assume 25 MiB buckets",
          lambda: f"int8's scales assume {planner.format_bytes.__kwdefaults__['bucket_cap_mb']:.0f} MiB buckets"),
    # the exercises' text: typed numbers beside the {placeholders}
    Claim(EX + 'decode_bandwidth_bound.md', '3.35 x 10^12 B/s / (2 x 8,030,261,248 B)',
          lambda: f"{tbps(H100)} x 10^12 B/s / (2 x {planner.num_params(LLAMA3):,} B)"),
    Claim(EX + 'decode_bandwidth_bound.md', "the GPU's ~295 FLOP/byte ridge point",
          lambda: f"the GPU's ~{ridge(H100):.0f} FLOP/byte ridge point"),
    Claim(EX + 'decode_bandwidth_bound.md', 'all 16 GB of weights',
          lambda: f"all {planner.param_bytes(LLAMA3, 'bfloat16') / 1e9:.0f} GB of weights"),
    Claim(EX + 'kv_concurrent_8k.md', 'weights: 2 bytes x 8,030,261,248',
          lambda: f"weights: 2 bytes x {planner.num_params(LLAMA3):,}"),
    Claim(EX + 'kv_concurrent_8k.md', '131,072 bytes per token (2 x 32 x 8 x 128 x 2)',
          lambda: f"{planner.kv_bytes_per_token(LLAMA3, 'bfloat16'):,} bytes per token (2 x 32 x 8 x 128 x 2)"),
    Claim(EX + 'kv_per_token.md', 'x 128 x 2 bytes = 131,072 bytes',
          lambda: f"x 128 x 2 bytes = {planner.kv_bytes_per_token(LLAMA3, 'bfloat16'):,} bytes"),
    Claim(EX + 'gqa_kv_saving.md', 'from 4 GiB to 1 GiB',
          lambda: f"from {gqa_gib(LLAMA3.num_heads):.0f} GiB to {gqa_gib(LLAMA3.num_kv_heads):.0f} GiB"),
    Claim(EX + 'adamw8bit_step_peak.md', '53 bytes per element of the tensor it updates when its moments are quantized (24 when they are fp32)',
          lambda: (f"{EAGER_QUANTIZED_BYTES} bytes per element of the tensor it updates when its moments are quantized "
                   f"({EAGER_FP32_BYTES} when they are fp32)")),
    Claim(EX + 'adamw8bit_step_peak.md', '(4 bytes per 256 elements) and 8 bytes of bias corrections',
          lambda: f"(4 bytes per {LOW8.block} elements) and {BIAS_CORRECTIONS} bytes of bias corrections"),
    Claim(EX + 'adamw8bit_state_bytes.md', 'which of them reach 4096 elements? Each of those costs two moments of n + 4·n/256 + 1024 bytes',
          lambda: (f"which of them reach {QUANTIZED_MIN} elements? Each of those costs two moments of n + 4·n/{LOW8.block} "
                   f"+ {4 * LOW8.map_size} bytes")),
]

