"""Claims of the inference, profiling and GPU questions: the KV cache per token and per GPU,
weight-only and NF4 bytes, speculative decoding, serving's saturation and cost, packing, the
roofline on data/gpus.json's GPUs, and what the tiny preset's runs hold at their defaults."""
from __future__ import annotations

from labkit import planner
from labkit.blocks import packing, slo, speculative
from labkit.config import MODELS, resolve
from labkit.measure.roofline import roofline
from labkit.study.claims.base import (A100, GIB, H100, H200, LLAMA2, LLAMA3, LLAMA70, MIB, Claim,
                                       bf16_peak, ridge, sig, tbps)
from labkit.study.exercises.formulas import TENSOR_CORE_ALIGN_BYTES, TENSOR_CORE_BEST_BYTES

KIB = 2**10
BEST_BF16 = TENSOR_CORE_BEST_BYTES // 2  # elements of a 2-byte dtype in the 128-byte alignment


def kv_kib(m, dtype: str = "float16") -> float:
    return planner.kv_bytes_per_token(m, dtype) / KIB


def saved_mib(seq_len: int, variant: str) -> float:
    """What the attention experiment keeps for backward on tiny at `seq_len` (its formula)."""
    from labkit.techniques import attention

    cfg = resolve(attention.Config, "tiny", {"seq_len": seq_len, "variant": variant, "device": "cpu"},
                  experiment="attention")
    return attention.saved_bytes(cfg) / MIB


def kv_run(**overrides):
    """The kv_cache experiment's config on tiny at its defaults plus `overrides`."""
    from labkit.techniques import kv_cache

    return kv_cache, resolve(kv_cache.Config, "tiny", {"device": "cpu", **overrides}, experiment="kv_cache")


def int8_kv_ratio(scales: str) -> float:
    """The quantized cache's bytes per token over a bf16 cache's, on tiny, with `scales`."""
    kv, cfg = kv_run(variant="quantized", kv_dtype="bfloat16", quant_scales=scales)
    return kv.bytes_per_token(cfg) / planner.kv_bytes_per_token(cfg.model, "bfloat16")


def static_waste() -> tuple[float, int, int]:
    """(waste %, positions held, context) of the kv_cache experiment's static cache on tiny."""
    kv, cfg = kv_run(variant="static")
    e = kv.expected(cfg)
    return e["kv_waste_pct"], e["kv_used_bytes"] // (e["kv_bytes_per_token"] * cfg.batch_size), kv.cache_len(cfg)


def wo_bytes(n: int, k: int, scheme: str, group: int = 64) -> int:
    return planner.weight_only_bytes(n, k, scheme, group)


def bits_int4(group: int = 64) -> float:
    return wo_bytes(4096, 4096, "int4", group) * 8 / 4096**2


def aligned(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


CLAIMS = [
    # --- the KV cache -----------------------------------------------------------------------
    Claim('inf-01', '= 524,288 bytes = 512 KiB',
          lambda: f"= {planner.kv_bytes_per_token(LLAMA2, 'float16'):,} bytes = {kv_kib(LLAMA2):.0f} KiB"),
    Claim('inf-01', "128 KiB is Llama-3-8B's value",
          lambda: f"{kv_kib(LLAMA3):.0f} KiB is Llama-3-8B's value"),
    Claim('inf-01', "16 KiB is one layer's K and V",
          lambda: f"{kv_kib(LLAMA2) / LLAMA2.num_layers:.0f} KiB is one layer's K and V"),
    Claim('inf-02', '= 131,072 bytes = 128 KiB',
          lambda: f"= {planner.kv_bytes_per_token(LLAMA3, 'float16'):,} bytes = {kv_kib(LLAMA3):.0f} KiB"),
    Claim('inf-03', '512 KiB × 8 × 4096 = 16 GiB, more than the 13.5 GB of fp16 weights',
          lambda: (f"512 KiB × 8 × 4096 = {planner.kv_cache_bytes(LLAMA2, batch_size=8, seq_len=4096, precision='fp16') / GIB:.0f} GiB, "
                   f"more than the {planner.param_bytes(LLAMA2, 'float16') / 1e9:.1f} GB of fp16 weights")),
    Claim('inf2-01', '= 320 KiB, split over 2 GPUs: 160 KiB on each',
          lambda: (f"= {kv_kib(LLAMA70, 'bfloat16'):.0f} KiB, split over 2 GPUs: "
                   f"{planner.kv_cache_bytes(LLAMA70, batch_size=1, seq_len=1, tp=2) / KIB:.0f} KiB on each")),
    Claim('inf2-01', '16 GiB / 160 KiB ≈ 104,858 tokens',
          lambda: f"16 GiB / 160 KiB ≈ {16 * GIB / planner.kv_cache_bytes(LLAMA70, batch_size=1, seq_len=1, tp=2):,.0f} tokens"),
    Claim('inf2-04', '12,000 tokens × 128 KiB ≈ 1.46 GiB, against 50 × 2,200 × 128 KiB ≈ 13.4 GiB',
          lambda: (f"12,000 tokens × 128 KiB ≈ {12000 * planner.kv_bytes_per_token(LLAMA3, 'bfloat16') / GIB:.2f} GiB, "
                   f"against 50 × 2,200 × 128 KiB ≈ {50 * 2200 * planner.kv_bytes_per_token(LLAMA3, 'bfloat16') / GIB:.1f} GiB")),
    Claim('inf-06', '93% waste for 143 of 2,048',
          lambda: "{:.0f}% waste for {} of {:,}".format(*static_waste())),
    Claim('inf-06', '(93% for the 143 positions of labkit\'s run in a 2,048 context)',
          lambda: "({:.0f}% for the {} positions of labkit's run in a {:,} context)".format(*static_waste())),
    Claim('inf-09', '0.516× at tiny\'s head_dim 64 (its default, one scale per token shared by the kv heads, takes 0.508×)',
          lambda: (f"{int8_kv_ratio('per_head'):.3f}× at tiny's head_dim {MODELS['tiny'].head_dim} (its default, one "
                   f"scale per token shared by the kv heads, takes {int8_kv_ratio('per_token'):.3f}×)")),
    Claim('inf-12', 'labkit measures 76 MiB against 12 MiB at S = 1024 on the tiny preset and 280 against 24 MiB at 2048: naive\'s whole grows 3.7×',
          lambda: (f"labkit measures {saved_mib(1024, 'naive'):.0f} MiB against {saved_mib(1024, 'sdpa'):.0f} MiB at S = 1024 on "
                   f"the tiny preset and {saved_mib(2048, 'naive'):.0f} against {saved_mib(2048, 'sdpa'):.0f} MiB at 2048: "
                   f"naive's whole grows {saved_mib(2048, 'naive') / saved_mib(1024, 'naive'):.1f}×")),
    Claim('inf-12', '(labkit: 12 → 24 MiB for flash from S = 1024 to 2048)',
          lambda: f"(labkit: {saved_mib(1024, 'sdpa'):.0f} → {saved_mib(2048, 'sdpa'):.0f} MiB for flash from S = 1024 to 2048)"),
    # --- decode's bandwidth bound and the roofline on data/gpus.json's GPUs -----------------------
    Claim('inf-05', '3.35e12 / 14e9 ≈ 240 steps/s',
          lambda: f"{tbps(H100)}e12 / 14e9 ≈ {sig(tbps(H100) * 1e12 / 14e9)} steps/s"),
    Claim('prec2-11', '7e9 × 4.5 / 8 ≈ 3.94 GB, so at most 3.35e12 / 3.94e9 ≈ 850 steps',
          lambda: (f"7e9 × {bits_int4():.1f} / 8 ≈ {7e9 * bits_int4() / 8 / 1e9:.2f} GB, so at most {tbps(H100)}e12 / 3.94e9 ≈ "
                   f"{sig(tbps(H100) * 1e12 / (7e9 * bits_int4() / 8))} steps")),
    Claim('prof-01', 'peak FLOP/s ÷ bandwidth = 989.5e12 / 3.35e12 ≈ 295 FLOP/byte',
          lambda: f"peak FLOP/s ÷ bandwidth = {bf16_peak(H100)}e12 / {tbps(H100)}e12 ≈ {ridge(H100):.0f} FLOP/byte"),
    Claim('prof-01', 'its ceiling is 20 × 3.35 TB/s = 67 TFLOP/s',
          lambda: f"its ceiling is 20 × {tbps(H100)} TB/s = {20 * tbps(H100):.0f} TFLOP/s"),
    Claim('prof-01', '(67 TFLOP/s / 3.35 TB/s)',
          lambda: f"({H100['peak_tflops']['float32']} TFLOP/s / {tbps(H100)} TB/s)"),
    Claim('prof-07', '126 / 989.5 ≈ 12.7%',
          lambda: f"126 / {bf16_peak(H100)} ≈ {6 * 7e9 * 3000 / (bf16_peak(H100) * 1e12):.1%}"),
    Claim('prof-07', 'about 494.5 TFLOP/s (the dense TF32 peak)',
          lambda: f"about {H100['peak_tflops']['tf32']} TFLOP/s (the dense TF32 peak)"),
    Claim('prof-07', 'the 1,979 TFLOP/s sparse figure',
          lambda: f"the {2 * bf16_peak(H100):,.0f} TFLOP/s sparse figure"),
    Claim('prof-13', '(H100 SXM: 67 TFLOP/s fp32 against 989.5 dense bf16)',
          lambda: f"(H100 SXM: {H100['peak_tflops']['float32']} TFLOP/s fp32 against {bf16_peak(H100)} dense bf16)"),
    Claim('prec-05', '(H100 SXM: about 494.5 dense TF32 against 67 fp32)',
          lambda: f"(H100 SXM: about {H100['peak_tflops']['tf32']} dense TF32 against {H100['peak_tflops']['float32']} fp32)"),
    Claim('prof2-01', 'H100 989.5/3.35 ≈ 295, H200 989.5/4.8 ≈ 206, A100 312/2.039 ≈ 153 FLOP/byte',
          lambda: (f"H100 {bf16_peak(H100)}/{tbps(H100)} ≈ {ridge(H100):.0f}, H200 {bf16_peak(H200)}/{tbps(H200)} ≈ "
                   f"{ridge(H200):.0f}, A100 {bf16_peak(A100):.0f}/{tbps(A100)} ≈ {ridge(A100):.0f} FLOP/byte")),
    Claim('prof2-02', 'H100: 50 × 3.35 = 167.5 TFLOP/s; H200: 50 × 4.8 = 240 TFLOP/s',
          lambda: f"H100: 50 × {tbps(H100)} = {50 * tbps(H100):.1f} TFLOP/s; H200: 50 × {tbps(H200)} = {50 * tbps(H200):.0f} TFLOP/s"),
    Claim('prof2-02', 'the bandwidth ratio 4.8/3.35 ≈ 1.43×',
          lambda: f"the bandwidth ratio {tbps(H200)}/{tbps(H100)} ≈ {tbps(H200) / tbps(H100):.2f}×"),
    Claim('prof2-03', 'about 295 (about 320',
          lambda: f"about {ridge(H100):.0f} (about 320"),
    Claim('inf2-13', 'the ridge is 989.5e12 / 3.35e12 ≈ 295 FLOP/byte',
          lambda: f"the ridge is {bf16_peak(H100)}e12 / {tbps(H100)}e12 ≈ {ridge(H100):.0f} FLOP/byte"),
    Claim('prof2-07', '42e9 × 2,800 / 989.5e12 ≈ 11.9%, and 54.9e9 × 2,800 / 989.5e12 ≈ 15.5%',
          lambda: (f"42e9 × 2,800 / {bf16_peak(H100)}e12 ≈ {42e9 * 2800 / (bf16_peak(H100) * 1e12):.1%}, and 54.9e9 × 2,800 / "
                   f"{bf16_peak(H100)}e12 ≈ {(42e9 + 12 * 32 * 4096 * 8192) * 2800 / (bf16_peak(H100) * 1e12):.1%}")),
    Claim('prec2-08', 'On the H100 fp8 doubles the dense peak, 1,979 against 989.5 TFLOP/s',
          lambda: f"On the H100 fp8 doubles the dense peak, {H100['peak_tflops']['float8']:,} against {bf16_peak(H100)} TFLOP/s"),
    Claim('prec2-08', 'bf16/fp16 (312 dense TFLOP/s)',
          lambda: f"bf16/fp16 ({bf16_peak(A100):.0f} dense TFLOP/s)"),
    Claim('prec2-10', '(19.5 TFLOP/s peak instead of TF32\'s 156)',
          lambda: f"({A100['peak_tflops']['float32']} TFLOP/s peak instead of TF32's {A100['peak_tflops']['tf32']})"),
    Claim('fp8-04', "H100 SXM's dense fp8 peak (1,979 TFLOP/s) is twice its bf16 peak (989.5)",
          lambda: f"H100 SXM's dense fp8 peak ({H100['peak_tflops']['float8']:,} TFLOP/s) is twice its bf16 peak ({bf16_peak(H100)})"),
    Claim('ops-06', '1 busy SM of 132 gives 1/132, about 0.76%',
          lambda: f"1 busy SM of {H100['sms']} gives 1/{H100['sms']}, about {1 / H100['sms']:.2%}"),
    Claim('dist-10', "NVLink 4 gives 900 GB/s total (450 GB/s each way) per H100 SXM",
          lambda: f"NVLink 4 gives {2 * H100['interconnect_gbps']} GB/s total ({H100['interconnect_gbps']} GB/s each way) per H100 SXM"),
    Claim('dist-10', "3.35 TB/s is the H100 SXM's HBM bandwidth",
          lambda: f"{tbps(H100)} TB/s is the H100 SXM's HBM bandwidth"),
    Claim('dist2-01', "far below NVLink's 450 GB/s per direction",
          lambda: f"far below NVLink's {H100['interconnect_gbps']} GB/s per direction"),
    Claim('ops-14', "NVLink's 450 GB/s per direction",
          lambda: f"NVLink's {H100['interconnect_gbps']} GB/s per direction"),
    Claim('prec-09', '2n³ / (3n² × 4 bytes) = n / 6 = 85 FLOP/byte at n = 512',
          lambda: (f"2n³ / (3n² × 4 bytes) = n / 6 = "
                   f"{roofline(2 * 512**3, 1.0, bytes_moved=3 * 512**2 * 4).intensity:.0f} FLOP/byte at n = 512")),
    # --- tensor-core alignment ------------------------------------------------------------------
    Claim('prec-04', 'nanoGPT pads GPT-2\'s vocabulary 50,257 → 50,304 (a multiple of 64)',
          lambda: f"nanoGPT pads GPT-2's vocabulary 50,257 → {aligned(50257, BEST_BF16):,} (a multiple of {BEST_BF16})"),
    Claim('prof2-09', 'tf32 4, bf16 8, fp8 16; for 128 bytes: 32, 64 and 128',
          lambda: ("tf32 {}, bf16 {}, fp8 {}; for 128 bytes: {}, {} and {}".format(
              *(TENSOR_CORE_ALIGN_BYTES // w for w in (4, 2, 1)), *(TENSOR_CORE_BEST_BYTES // w for w in (4, 2, 1))))),
    Claim('prof2-10', 'ceil(5,460 / 64) = 86, and 86 × 64 = 5,504',
          lambda: f"ceil(5,460 / {BEST_BF16}) = {aligned(5460, BEST_BF16) // BEST_BF16}, and 86 × 64 = {aligned(5460, BEST_BF16):,}"),
    # --- weight-only quantization -------------------------------------------------------------
    Claim('wq-01', 'Total 8,912,896 bytes = 8.5 MiB: 4 + 32/128 = 4.25 bits per weight',
          lambda: (f"Total {wo_bytes(4096, 4096, 'int4', 128):,} bytes = {wo_bytes(4096, 4096, 'int4', 128) / MIB} MiB: "
                   f"4 + 32/128 = {bits_int4(128)} bits per weight")),
    Claim('wq-01', '9 MiB is group_size 64',
          lambda: f"{wo_bytes(4096, 4096, 'int4', 64) / MIB:.0f} MiB is group_size 64"),
    Claim('wq-02', '(4096 + 2) / (2 x 4096) = 0.50',
          lambda: f"(4096 + 2) / (2 x 4096) = {wo_bytes(4096, 4096, 'int8') / (2 * 4096**2):.2f}"),
    Claim('wq-03', 'reads about 0.56 bytes (4.5 bits)',
          lambda: f"reads about {bits_int4() / 8:.2f} bytes ({bits_int4()} bits)"),
    Claim('wq-04', 'ceil(344 / 64) = 6',
          lambda: f"ceil(344 / 64) = {(wo_bytes(1, 344, 'int4') - 172) // 4}"),
    Claim('wq-05', '(7e9 x 4.5 / 8 = 3.9 GB',
          lambda: f"(7e9 x {bits_int4()} / 8 = {7e9 * bits_int4() / 8 / 1e9:.1f} GB"),
    Claim('calib-01', 'in all 9,437,184 bytes, 4.5 bits per weight',
          lambda: f"in all {wo_bytes(4096, 4096, 'int4'):,} bytes, {bits_int4()} bits per weight"),
    # --- speculative decoding, serving, packing -----------------------------------------------
    Claim('inf2-10', '(1 − 0.8^5) / 0.2 = (1 − 0.328) / 0.2 ≈ 3.36',
          lambda: f"(1 − 0.8^5) / 0.2 = (1 − 0.328) / 0.2 ≈ {speculative.expected_tokens_per_step(0.8, 4):.2f}"),
    Claim('inf2-11', '3.36 / 1.4 ≈ 2.4×',
          lambda: f"3.36 / 1.4 ≈ {speculative.expected_speedup(0.8, 4, 0.1):.1f}×"),
    Claim('spec-01', '(1 - 0.6561) / 0.1 = 3.439',
          lambda: f"(1 - 0.6561) / 0.1 = {speculative.expected_tokens_per_step(0.9, 3):.3f}"),
    Claim('spec-03', '(1 - 0.32768) / 0.2 = 3.3616',
          lambda: f"(1 - 0.32768) / 0.2 = {speculative.expected_tokens_per_step(0.8, 4):.4f}"),
    Claim('spec-03', '3.3616 / 2 = 1.68x',
          lambda: f"3.3616 / 2 = {speculative.expected_speedup(0.8, 4, 0.25):.2f}x"),
    Claim('spec-03', '1.12x = 3.3616 / 3',
          lambda: f"{speculative.expected_speedup(0.8, 4, 0.5):.2f}x = 3.3616 / 3"),
    Claim('sla-02', '32 / (400 x 0.04 s) = 2 requests/s',
          lambda: f"32 / (400 x 0.04 s) = {slo.saturation_rate(32, 400, 0.04):.0f} requests/s"),
    Claim('sla-03', '500 x 4 / 3600 = 0.556 USD',
          lambda: f"500 x 4 / 3600 = {slo.usd_per_million_tokens(4, 2000):.3f} USD"),
    Claim('packing-01', '1 - 160 / 400 = 60% are pads',
          lambda: f"1 - 160 / 400 = {packing.padding_fraction([100, 20, 20, 20], 4, 100):.0%} are pads"),
    Claim('packing-02', '2 rows x 128 = 256 slots for 160 document tokens: 1 - 160 / 256 = 37.5% pads',
          lambda: (f"{len(packing.first_fit([100, 20, 20, 20], 128))} rows x 128 = 256 slots for 160 document tokens: "
                   f"1 - 160 / 256 = {packing.padding_fraction([100, 20, 20, 20], len(packing.first_fit([100, 20, 20, 20], 128)), 128):.1%} pads")),
    Claim('packing-04', '131,584 / 524,800 = 0.251',
          lambda: (f"{packing.document_pairs([256] * 4):,} / {packing.causal_pairs(1024):,} = "
                   f"{packing.document_pairs([256] * 4) / packing.causal_pairs(1024):.3f}")),
]
