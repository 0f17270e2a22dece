"""Claims of the training questions (memory, parallelism, multi-GPU, precision, fine-tuning):
model states per precision and ZeRO stage, Korthikanti's activations, pipeline bubbles, ring
bytes, LoRA, NF4, int8/int4 bases and low-bit optimizer states, each at the question's settings."""
from __future__ import annotations

import dataclasses
import math

from labkit import planner
from labkit.blocks import fp8, optimizers
from labkit.config import MODELS
from labkit.planner.compression import UNIT_ROUNDOFF
from labkit.planner.precision import EAGER_QUANTIZED_BYTES
from labkit.study.claims.base import (GIB, LLAMA2, LLAMA3, Claim, korthikanti_gb, sci,
                                       state_bytes, zero_gb)
from labkit.study.exercises.formulas import FP16_MAX

gpipe, held = planner.gpipe_bubble_fraction, planner.in_flight_micro_batches
TINY2 = dataclasses.replace(MODELS["tiny"], num_layers=2)  # the ledger's and recipe's tiny step
K12 = state_bytes("bf16_weights", "adam")[2]  # mixed-precision Adam's K


def per_param(precision: str, optimizer: str = "adamw") -> int:
    return sum(state_bytes(precision, optimizer))


def kor_parts(s: int, h: int, a: int) -> tuple[float, float]:
    """(34-part, attention part) of one layer's activation bytes per s·b·h, t = 1, b = 1."""
    sbh = s * h
    total = planner.korthikanti_activation_bytes(s=s, b=1, h=h, a=a)
    rest = planner.korthikanti_activation_bytes(s=s, b=1, h=h, a=a, recompute="selective")
    return rest / sbh, (total - rest) / sbh


def min_micro_batches(p: int, bubble: float) -> int:
    """The fewest micro-batches whose GPipe/1F1B bubble fraction is at most `bubble`."""
    return next(m for m in range(1, 10**4) if gpipe(p, m) <= bubble + 1e-12)


def nf4_bits(double_quant: bool = True) -> float:
    """NF4's bits per weight (labkit.planner.nf4_bytes) on a 4096 x 4096 weight, fp32 factors."""
    return planner.nf4_bytes(4096, 4096, double_quant=double_quant) * 8 / 4096**2


def low_bit_gib(m, optimizer: str) -> float:
    return planner.low_bit_state_bytes(list(planner.stage_tensors(m)), optimizer) / GIB


CLAIMS = [
    # --- model states per parameter and ZeRO ---------------------------------------------------
    Claim('mem-01', '16 × 7e9 = 112 GB',
          lambda: f"{per_param('bf16_weights', 'adam')} × 7e9 = {zero_gb(7e9, 0, 1):.0f} GB"),
    Claim('mem-01', '84 GB is 12 × 7e9',
          lambda: f"{K12 * 7} GB is {K12} × 7e9"),
    Claim('mem-01', '28 GB is 4 bytes per parameter',
          lambda: f"{planner.PRECISION_BYTES['fp32'].weight * 7} GB is {planner.PRECISION_BYTES['fp32'].weight} bytes per parameter"),
    Claim('mem-02', '4 (fp32 weight) + 4 (fp32 gradient) + 8 (AdamW\'s two fp32 moments m and v) = 16',
          lambda: "{} (fp32 weight) + {} (fp32 gradient) + {} (AdamW's two fp32 moments m and v) = {}".format(
              *state_bytes("fp32"), per_param("fp32"))),
    Claim('mem-02', 'SGD with momentum would keep one moment (12 bytes)',
          lambda: f"SGD with momentum would keep one moment ({per_param('fp32', 'sgd')} bytes)"),
    Claim('mem-03', '2 (bf16 weights) + 2 (bf16 grads) + 12 (fp32 master 4 + m 4 + v 4) = 16',
          lambda: "{} (bf16 weights) + {} (bf16 grads) + {} (fp32 master 4 + m 4 + v 4) = {}".format(
              *state_bytes("bf16_weights"), per_param("bf16_weights"))),
    Claim('mem-03', 'grows from 8 to 12 per parameter',
          lambda: f"grows from {state_bytes('fp32')[2]} to {state_bytes('bf16_weights')[2]} per parameter"),
    Claim('mem-10', '2 moments × 4 bytes × 1e9 parameters = 8 GB',
          lambda: f"2 moments × 4 bytes × 1e9 parameters = {state_bytes('fp32')[2]} GB"),
    Claim('mem2-14', '8 × 1e9 = 8 GB',
          lambda: f"{state_bytes('fp32')[2]} × 1e9 = {state_bytes('fp32')[2]} GB"),
    Claim('mem2-08', '2 × 7e9 = 14 GB',
          lambda: f"{state_bytes('bf16_weights')[0]} × 7e9 = {state_bytes('bf16_weights')[0] * 7} GB"),
    Claim('mem2-08', 'the 12Ψ = 84 GB',
          lambda: f"the {K12}Ψ = {K12 * 7} GB"),
    Claim('par-07', '16 × 7.5e9 / 64 = 1.875 GB',
          lambda: f"{per_param('bf16_weights', 'adam')} × 7.5e9 / 64 = {zero_gb(7.5e9, 3, 64):.3f} GB"),
    Claim('par-07', 'Stage 0 is 120 GB, stage 1 2Ψ + 2Ψ + KΨ/Nd = 31.4 GB, stage 2 2Ψ + (2 + K)Ψ/Nd = 16.6 GB',
          lambda: (f"Stage 0 is {zero_gb(7.5e9, 0, 64):.0f} GB, stage 1 2Ψ + 2Ψ + KΨ/Nd = "
                   f"{zero_gb(7.5e9, 1, 64):.1f} GB, stage 2 2Ψ + (2 + K)Ψ/Nd = {zero_gb(7.5e9, 2, 64):.1f} GB")),
    Claim('par-06', '31.4, 16.6 and 1.9 GB',
          lambda: f"{zero_gb(7.5e9, 1, 64):.1f}, {zero_gb(7.5e9, 2, 64):.1f} and {zero_gb(7.5e9, 3, 64):.1f} GB"),
    Claim('par-08', '(2 + 12)Ψ / 64 = 1.64 GB, total 16.6 GB',
          lambda: f"(2 + {K12})Ψ / 64 = {zero_gb(7.5e9, 2, 64) - 15:.2f} GB, total {zero_gb(7.5e9, 2, 64):.1f} GB"),
    Claim('par2-05', '16Ψ = 208 GB',
          lambda: f"{per_param('bf16_weights', 'adam')}Ψ = {zero_gb(13e9, 0, 8):.0f} GB"),
    Claim('par2-05', '= 26 + 26 + 19.5 = 71.5 GB',
          lambda: f"= 26 + 26 + {zero_gb(13e9, 1, 8) - 52:.1f} = {zero_gb(13e9, 1, 8):.1f} GB"),
    Claim('par2-05', '= 26 + 22.75 = 48.75 GB',
          lambda: f"= 26 + {zero_gb(13e9, 2, 8) - 26:.2f} = {zero_gb(13e9, 2, 8):.2f} GB"),
    Claim('par2-05', 'Stage 3 (26 GB)',
          lambda: f"Stage 3 ({zero_gb(13e9, 3, 8):.0f} GB)"),
    Claim('rec-4', 'Without ZeRO it is 16 GB; ZeRO-1 (moments only) 4 + 4 + 8/4 = 10 GB; ZeRO-3 also shards the weights: 16 / 4 = 4 GB',
          lambda: (f"Without ZeRO it is {zero_gb(1e9, 0, 4, 'fp32', 'adamw'):.0f} GB; ZeRO-1 (moments only) "
                   f"4 + 4 + 8/4 = {zero_gb(1e9, 1, 4, 'fp32', 'adamw'):.0f} GB; ZeRO-3 also shards the weights: "
                   f"16 / 4 = {zero_gb(1e9, 3, 4, 'fp32', 'adamw'):.0f} GB")),
    Claim('rec-4', '(4 + 8) B x 1e9 / 4 = 3 GB of sharded gradients and moments: 7 GB',
          lambda: (f"(4 + 8) B x 1e9 / 4 = {zero_gb(1e9, 2, 4, 'fp32', 'adamw') - 4:.0f} GB of sharded gradients "
                   f"and moments: {zero_gb(1e9, 2, 4, 'fp32', 'adamw'):.0f} GB")),
    Claim('mem2-11', '50,304 × 2,048 × 4 B ≈ 0.41 GB',
          lambda: f"50,304 × 2,048 × 4 B ≈ {50304 * 2048 * state_bytes('fp32')[0] / 1e9:.2f} GB"),
    # --- activations (Korthikanti et al.) ------------------------------------------------------
    Claim('mem-05', '5 × 32 × 2048 / 4096 = 80, against 34',
          lambda: "5 × 32 × 2048 / 4096 = {1:.0f}, against {0:.0f}".format(*kor_parts(2048, 4096, 32))),
    Claim('mem-05', '80 / 114 = 70%',
          lambda: "{1:.0f} / {2:.0f} = {3:.0%}".format(*kor_parts(2048, 4096, 32), sum(kor_parts(2048, 4096, 32)),
                                                        kor_parts(2048, 4096, 32)[1] / sum(kor_parts(2048, 4096, 32)))),
    Claim('mem2-01', 'so one layer keeps 20.97M × (34 + 160) ≈ 4.07 GB and 40 layers about 163 GB',
          lambda: (f"so one layer keeps 20.97M × (34 + {kor_parts(4096, 5120, 40)[1]:.0f}) ≈ "
                   f"{korthikanti_gb(s=4096, b=1, h=5120, a=40):.2f} GB and 40 layers about "
                   f"{korthikanti_gb(s=4096, b=1, h=5120, a=40, L=40):.0f} GB")),
    Claim('mem2-01', '34 × 20.97M × 40 ≈ 28.5 GB',
          lambda: f"34 × 20.97M × 40 ≈ {korthikanti_gb(s=4096, b=1, h=5120, a=40, L=40, recompute='selective'):.1f} GB"),
    Claim('mem2-01', 'About 134 GB',
          lambda: "About {:.0f} GB".format(korthikanti_gb(s=4096, b=1, h=5120, a=40, L=40)
                                           - korthikanti_gb(s=4096, b=1, h=5120, a=40, L=40, recompute='selective'))),
    Claim('mem2-01', 'about 1.7 GB for 40 layers',
          lambda: f"about {korthikanti_gb(s=4096, b=1, h=5120, a=40, L=40, recompute='full'):.1f} GB for 40 layers"),
    Claim('mem2-02', '13 × 16.78M ≈ 218 MB',
          lambda: f"13 × 16.78M ≈ {korthikanti_gb(s=2048, b=1, h=8192, a=64, t=8, recompute='selective') * 1e3:.0f} MB"),
    Claim('mem2-02', '34/8 × 16.78M ≈ 71 MB',
          lambda: (f"34/8 × 16.78M ≈ {korthikanti_gb(s=2048, b=1, h=8192, a=64, t=8, recompute='selective', sequence_parallel=True) * 1e3:.0f} MB")),
    Claim('mem2-02', '570 MB is the unsplit 34·sbh',
          lambda: f"{korthikanti_gb(s=2048, b=1, h=8192, a=64, recompute='selective') * 1e3:.0f} MB is the unsplit 34·sbh"),
    Claim('par2-03', '33.6M × (10 + 3) ≈ 436 MB',
          lambda: f"33.6M × (10 + 3) ≈ {korthikanti_gb(s=4096, b=1, h=8192, a=64, t=8, recompute='selective') * 1e3:.0f} MB"),
    Claim('par2-03', '33.6M × 4.25 ≈ 143 MB',
          lambda: (f"33.6M × 4.25 ≈ {korthikanti_gb(s=4096, b=1, h=8192, a=64, t=8, recompute='selective', sequence_parallel=True) * 1e3:.0f} MB")),
    Claim('par2-03', '1,141 MB is 34·s·b·h',
          lambda: f"{korthikanti_gb(s=4096, b=1, h=8192, a=64, recompute='selective') * 1e3:,.0f} MB is 34·s·b·h"),
    # --- pipeline bubbles and in-flight micro-batches -----------------------------------------------
    Claim('par-01', '= 3 / 15 = 0.20',
          lambda: f"= 3 / 15 = {gpipe(4, 12):.2f}"),
    Claim('par-01', '0.25 = (p - 1)/m = 3/12',
          lambda: f"{gpipe(4, 12) / (1 - gpipe(4, 12)):.2f} = (p - 1)/m = 3/12"),
    Claim('par-11', '0.50, 0.33, 0.20, 0.11 for m = 1, 2, 4, 8 at p = 2',
          lambda: ", ".join(f"{gpipe(2, m):.2f}" for m in (1, 2, 4, 8)) + " for m = 1, 2, 4, 8 at p = 2"),
    Claim('par-11', 'p = 4 gives 3/7 ≈ 0.43',
          lambda: f"p = 4 gives 3/7 ≈ {gpipe(4, 4):.2f}"),
    Claim('par-11', 'm = 2 gives 0.33 against 0.20 at m = 4',
          lambda: f"m = 2 gives {gpipe(2, 2):.2f} against {gpipe(2, 4):.2f} at m = 4"),
    Claim('par2-02', 'm ≥ 63; 1F1B holds at most 8 micro-batches\' activations, GPipe all 63',
          lambda: (f"m ≥ {min_micro_batches(8, 0.1)}; 1F1B holds at most {held('1f1b', 8, 63, 0)} "
                   f"micro-batches' activations, GPipe all {held('gpipe', 8, min_micro_batches(8, 0.1), 0)}")),
    Claim('par2-02', 'With m = 8 the bubble is 7/15 ≈ 47%',
          lambda: f"With m = 8 the bubble is 7/15 ≈ {gpipe(8, 8):.0%}"),
    # --- collectives ------------------------------------------------------------------------
    Claim('dist-01', '2 × 7/8 × 1 GB = 1.75 GB',
          lambda: f"2 × 7/8 × 1 GB = {planner.bus_bytes(1e9, 8) / 1e9:.2f} GB"),
    Claim('dist-01', '0.875 GB = (n - 1)/n × S',
          lambda: f"{planner.bus_bytes(1e9, 8, 'reduce_scatter') / 1e9:.3f} GB = (n - 1)/n × S"),
    Claim('dist-02', '100 × 2 × 7/8 = 175 GB/s',
          lambda: f"100 × 2 × 7/8 = {planner.bus_bytes(100, 8):.0f} GB/s"),
    Claim('dist2-06', '320 × 7/8 = 280 GB/s',
          lambda: f"320 × 7/8 = {planner.bus_bytes(320, 8, 'all_gather'):.0f} GB/s"),
    Claim('dist2-07', '3 GB × 1.75 / 360 GB/s ≈ 14.6 ms',
          lambda: f"3 GB × 1.75 / 360 GB/s ≈ {planner.bus_bytes(3e9, 8) / 360e9 * 1e3:.1f} ms"),
    Claim('dist2-07', '1.75 × 3 GB = 5.25 GB',
          lambda: f"1.75 × 3 GB = {planner.bus_bytes(planner.grad_reduce_bytes(int(1.5e9), 'bf16'), 8) / 1e9:.2f} GB"),
    Claim('par2-01', '1 × 4096 × 8192 × 2 B ≈ 67 MB',
          lambda: f"1 × 4096 × 8192 × 2 B ≈ {4096 * 8192 * 2 / 1e6:.0f} MB"),
    Claim('par2-01', '2(n - 1)/n × S = 1.75 × 67 ≈ 117 MB per GPU, so about 235 MB',
          lambda: (f"2(n - 1)/n × S = 1.75 × 67 ≈ {planner.bus_bytes(4096 * 8192 * 2, 8) / 1e6:.0f} MB per GPU, "
                   f"so about {2 * planner.bus_bytes(4096 * 8192 * 2, 8) / 1e6:.0f} MB")),
    Claim('dist-07', '1.5e-3 for fp16 and 1.2e-2 for bf16 at N = 2',
          lambda: f"{sci(planner.rounding_tolerance('fp16', 2))} for fp16 and {sci(planner.rounding_tolerance('bf16', 2))} for bf16 at N = 2"),
    Claim('dist-07', "fp16's unit roundoff, 2^-11 ≈ 4.9e-4, per rounding (labkit's bound at 2 ranks: 1.5e-3)",
          lambda: (f"fp16's unit roundoff, 2^-11 ≈ {sci(UNIT_ROUNDOFF['fp16'])}, per rounding (labkit's bound at "
                   f"2 ranks: {sci(planner.rounding_tolerance('fp16', 2))})")),
    Claim('par-12', '10.00 of 20.00 MB at the tiny preset',
          lambda: (f"{planner.stage_params(MODELS['tiny'], tp=2).total * 4 / 1e6:.2f} of "
                   f"{planner.num_params(MODELS['tiny']) * 4 / 1e6:.2f} MB at the tiny preset")),
    Claim('par-12', '10.00 MB per rank against 20.00 MB',
          lambda: (f"{planner.stage_params(MODELS['tiny'], tp=2).total * 4 / 1e6:.2f} MB per rank against "
                   f"{planner.num_params(MODELS['tiny']) * 4 / 1e6:.2f} MB")),
    # --- precision -------------------------------------------------------------------------
    Claim('prec-01', 'largest 65,504',
          lambda: f"largest {FP16_MAX:,.0f}"),
    Claim('prec2-01', '80,000 > 65,504',
          lambda: f"80,000 > {FP16_MAX:,.0f}"),
    Claim('prec-03', 'its relative rounding error is about 8× fp16\'s (unit roundoffs 2^-8 ≈ 3.9e-3 against 2^-11 ≈ 4.9e-4',
          lambda: (f"its relative rounding error is about {UNIT_ROUNDOFF['bf16'] / UNIT_ROUNDOFF['fp16']:.0f}× fp16's "
                   f"(unit roundoffs 2^-8 ≈ {sci(UNIT_ROUNDOFF['bf16'])} against 2^-11 ≈ {sci(UNIT_ROUNDOFF['fp16'])}")),
    Claim('prec-03', 'E4M3 at 448',
          lambda: f"E4M3 at {fp8.max_value('e4m3'):.0f}"),
    Claim('prec-08', 'E5M2 (max 57,344)',
          lambda: f"E5M2 (max {fp8.max_value('e5m2'):,.0f})"),
    Claim('fp8-01', 'e4m3 spends 3 on the mantissa (largest 448, smallest subnormal 2^-9 = 0.001953125), e5m2 only 2 (largest 57,344, smallest subnormal 2^-16)',
          lambda: (f"e4m3 spends {fp8.MANTISSA_BITS['e4m3']} on the mantissa (largest {fp8.max_value('e4m3'):.0f}, smallest "
                   f"subnormal 2^-9 = {fp8.smallest_subnormal('e4m3')}), e5m2 only {fp8.MANTISSA_BITS['e5m2']} (largest "
                   f"{fp8.max_value('e5m2'):,.0f}, smallest subnormal 2^{math.log2(fp8.smallest_subnormal('e5m2')):.0f})")),
    Claim('fp8-01', 'e4m3 covers 448 / 2^-9 = 229,376',
          lambda: f"e4m3 covers 448 / 2^-9 = {fp8.max_value('e4m3') / fp8.smallest_subnormal('e4m3'):,.0f}"),
    Claim('fp8-01', 'e5m2 57,344 / 2^-16 = 3,758,096,384',
          lambda: f"e5m2 57,344 / 2^-16 = {fp8.max_value('e5m2') / fp8.smallest_subnormal('e5m2'):,.0f}"),
    Claim('fp8-02', 'half of that: 2^-4 = 6.25%',
          lambda: f"half of that: 2^-4 = {fp8.rounding_bound('e4m3'):.2%}"),
    Claim('fp8-02', 'u / (1 + u) = 1/17, 5.88%',
          lambda: "u / (1 + u) = 1/17, {:.2%}".format(fp8.rounding_bound('e4m3') / (1 + fp8.rounding_bound('e4m3')))),
    Claim('fp8-02', 'rounds within 2^-3 = 12.5%',
          lambda: f"rounds within 2^-3 = {fp8.rounding_bound('e5m2'):.1%}"),
    Claim('fp8-03', 'scale = 448 / 2.0 = 224',
          lambda: f"scale = 448 / 2.0 = {fp8.max_value('e4m3') / 2.0:.0f}"),
    Claim('fp8-03', '(2^-9 / 2 = 2^-10 = 0.0009765625)',
          lambda: f"(2^-9 / 2 = 2^-10 = {fp8.smallest_subnormal('e4m3') / 2})"),
    # --- fine-tuning: LoRA, NF4, quantized bases, low-bit optimizers --------------------------------
    Claim('mem2-12', '× 2 matrices × 32 layers = 8.39M',
          lambda: f"× 2 matrices × 32 layers = {planner.trainable_params(LLAMA2, 'lora', lora_rank=16) / 1e6:.2f}M"),
    Claim('mem2-12', 'the adapters 8.39M × 16 B ≈ 0.13 GB: about 14.1 GB',
          lambda: (f"the adapters 8.39M × 16 B ≈ {planner.trainable_params(LLAMA2, 'lora', lora_rank=16) * 16 / 1e9:.2f} GB: "
                   f"about {(2 * 7e9 + 16 * planner.trainable_params(LLAMA2, 'lora', lora_rank=16)) / 1e9:.1f} GB")),
    Claim('mem2-13', '4 + 8/64 + 32/(64 × 256) = 4 + 0.125 + 0.002 ≈ 4.127 bits, so 7e9 × 4.127 / 8 ≈ 3.61 GB',
          lambda: (f"4 + 8/64 + 32/(64 × 256) = 4 + 0.125 + 0.002 ≈ {nf4_bits():.3f} bits, so 7e9 × 4.127 / 8 ≈ "
                   f"{7e9 * nf4_bits() / 8 / 1e9:.2f} GB")),
    Claim('mem2-13', 'it would be 4.5 bits ≈ 3.94 GB',
          lambda: f"it would be {nf4_bits(False):.1f} bits ≈ {7e9 * nf4_bits(False) / 8 / 1e9:.2f} GB"),
    Claim('finetune-06', '0.5 - 0.127 = 0.373 bits per weight × 65e9 / 8 ≈ 3.03 GB',
          lambda: (f"0.5 - 0.127 = {nf4_bits(False) - nf4_bits():.3f} bits per weight × 65e9 / 8 ≈ "
                   f"{65e9 * (nf4_bits(False) - nf4_bits()) / 8 / 1e9:.2f} GB")),
    Claim('finetune-01', '= 13,631,488 (0.17% of the 8.0B base)',
          lambda: (f"= {planner.trainable_params(LLAMA3, 'lora', lora_rank=16, lora_targets='attn'):,} "
                   f"({planner.trainable_params(LLAMA3, 'lora', lora_rank=16, lora_targets='attn') / planner.num_params(LLAMA3):.2%} "
                   f"of the {planner.num_params(LLAMA3) / 1e9:.1f}B base)")),
    Claim('finetune-03', '= 4,194,304 adapter parameters',
          lambda: f"= {planner.trainable_params(LLAMA2, 'lora'):,} adapter parameters"),
    Claim('finetune-03', 'The base takes 6.74e9 × 2 B = 13.5 GB',
          lambda: f"The base takes {planner.num_params(LLAMA2) / 1e9:.2f}e9 × 2 B = {planner.param_bytes(LLAMA2, 'bfloat16') / 1e9:.1f} GB"),
    Claim('finetune-03', '4,194,304 × 16 B = 67 MB',
          lambda: f"{planner.trainable_params(LLAMA2, 'lora'):,} × 16 B = {planner.trainable_params(LLAMA2, 'lora') * 16 / 1e6:.0f} MB"),
    Claim('finetune-04', '2 × 4,194,304 = 8,388,608 FLOPs per token against about 2 × 6.74e9 = 13.5 GFLOPs, a 0.06% share',
          lambda: (f"2 × 4,194,304 = {2 * planner.trainable_params(LLAMA2, 'lora'):,} FLOPs per token against about "
                   f"2 × 6.74e9 = {2 * planner.num_params(LLAMA2) / 1e9:.1f} GFLOPs, a "
                   f"{planner.trainable_params(LLAMA2, 'lora') / planner.num_params(LLAMA2):.2%} share")),
    Claim('finetune-09', '6,476,005,376 weights, 12.06 GiB in bf16',
          lambda: (f"{planner.linear_weight_bytes(LLAMA2, 'lora', compute_dtype='bf16') // 2:,} weights, "
                   f"{planner.linear_weight_bytes(LLAMA2, 'lora', compute_dtype='bf16') / GIB:.2f} GiB in bf16")),
    Claim('finetune-09', '2,719,744 bytes more, 6,478,725,120 bytes = 6.03 GiB',
          lambda: (f"{planner.linear_weight_bytes(LLAMA2, 'lora_int8') - planner.linear_weight_bytes(LLAMA2, 'lora', compute_dtype='bf16') // 2:,} "
                   f"bytes more, {planner.linear_weight_bytes(LLAMA2, 'lora_int8'):,} bytes = "
                   f"{planner.linear_weight_bytes(LLAMA2, 'lora_int8') / GIB:.2f} GiB")),
    Claim('finetune-09', 'takes 3.39 GiB, NF4 3.11 GiB',
          lambda: (f"takes {planner.linear_weight_bytes(LLAMA2, 'lora_int4') / GIB:.2f} GiB, NF4 "
                   f"{planner.linear_weight_bytes(LLAMA2, 'qlora', compute_dtype='bf16') / GIB:.2f} GiB")),
    Claim('finetune-11', '58.71 GiB, where the bf16 tensor alone is the 19.57 GiB',
          lambda: (f"{81920 * LLAMA3.vocab_size * 6 / GIB:.2f} GiB, where the bf16 tensor alone is the "
                   f"{81920 * LLAMA3.vocab_size * 2 / GIB:.2f} GiB")),
    Claim('finetune-11', 'a tenth: 5.87 GiB',
          lambda: f"a tenth: {8192 * LLAMA3.vocab_size * 6 / GIB:.2f} GiB"),
    Claim('finetune-11', '39.14 GiB is the fp32 copy alone',
          lambda: f"{81920 * LLAMA3.vocab_size * 4 / GIB:.2f} GiB is the fp32 copy alone"),
    Claim('optim-01', '12.75 GiB for 6.74 billion parameters',
          lambda: f"{low_bit_gib(LLAMA2, 'adamw8bit'):.2f} GiB for {planner.num_params(LLAMA2) / 1e9:.2f} billion parameters"),
    Claim('optim-01', '2 × 4 bytes per parameter: 50.21 GiB',
          lambda: f"2 × 4 bytes per parameter: {planner.num_params(LLAMA2) * state_bytes('fp32')[2] / GIB:.2f} GiB"),
    Claim('optim-02', '2 × 4 × 2,048 = 16,384 bytes',
          lambda: f"2 × 4 × 2,048 = {planner.low_bit_state_bytes([8 * 256], 'adamw8bit'):,} bytes"),
    Claim('optim-05', '6.67 GiB (labkit.planner.low_bit_state_bytes), against 12.75 GiB for AdamW8bit and 50.21 GiB',
          lambda: (f"{low_bit_gib(LLAMA2, 'adamw4bit'):.2f} GiB (labkit.planner.low_bit_state_bytes), against "
                   f"{low_bit_gib(LLAMA2, 'adamw8bit'):.2f} GiB for AdamW8bit and "
                   f"{planner.num_params(LLAMA2) * 8 / GIB:.2f} GiB")),
    Claim('optim-03', '53 bytes per element of the largest tensor, the 4,096 × 256 embedding',
          lambda: (f"{EAGER_QUANTIZED_BYTES} bytes per element of the largest tensor, the "
                   f"{MODELS['tiny'].vocab_size:,} × {MODELS['tiny'].hidden_size} embedding")),
    Claim('optim-04', 'the 8-bit curve stays within 1% of fp32 AdamW\'s',
          lambda: f"the 8-bit curve stays within {optimizers.TOLERANCE['adamw8bit']:.0%} of fp32 AdamW's"),
    Claim('ledger-01', '4 × 33 × 8 = 1,056 bytes',
          lambda: f"4 × 33 × 8 = {planner.pipeline_token_bytes(4, 32):,} bytes"),
    Claim('ledger-02', '21 × 4 = 84 bytes',
          lambda: f"{len(planner.stage_tensors(TINY2))} × 4 = {4 * len(planner.stage_tensors(TINY2))} bytes"),
]
