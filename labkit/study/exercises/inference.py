"""Exercises on inference: KV-cache bytes (per token, int8, grouped-query attention, what fits on a
GPU), the cache's speed-up, prefill against decode FLOPs, decode's bandwidth bound, and static
against continuous batching (padding, decode steps).

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

import dataclasses
import heapq
import math

from labkit import hardware, planner
from labkit.config import DTYPE_BYTES, MODELS
from labkit.study.exercises import h200
from labkit.study.exercises.core import KiB, TOPICS, Exercise, Rows, Setup, close, show
from labkit.study.exercises.formulas import faster

GiB = 2**30
LLAMA = MODELS["llama-3-8b"]
CONTEXT = 8192  # Llama-3-8B's context (its max_seq_len)
GPU = "H100 SXM5"  # the 80 GiB GPU of the sizing exercises (data/gpus.json)
SAME_SPEED = 1.2  # formulas.faster: within 1.2x either way is "about the same"


# --- what the learner is shown ---------------------------------------------------------------------

def decode_words(s: Setup) -> str:
    """The kv run's model and generation, every number its exercises need."""
    c, m = s.cfg("dynamic"), s.cfg("dynamic").model
    return (f"Model: {m.num_layers} layer, hidden {m.hidden_size}, {m.num_heads} query heads and "
            f"{m.num_kv_heads} kv heads of head_dim {m.head_dim}, MLP (SwiGLU: 3 matrices) "
            f"{m.hidden_size} x {m.ffn_size}, vocabulary {m.vocab_size} (untied output projection), "
            f"dtype {c.dtype} ({DTYPE_BYTES[c.dtype]} bytes per value). Generation: batch "
            f"{c.batch_size}, a {c.prompt_len}-token prompt, {c.new_tokens} new tokens (the cache "
            f"ends holding {c.prompt_len + c.new_tokens - 1} positions: the last token is never fed back).")


def flop_words(s: Setup) -> str:
    m = s.cfg("dynamic").model
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return (decode_words(s) + f"\nThe block's weights: q and o {m.hidden_size} x {q}, k and v "
            f"{m.hidden_size} x {kv}, the MLP's three {m.hidden_size} x {m.ffn_size}; the vocabulary "
            f"projection {m.hidden_size} x {m.vocab_size}.\n"
            "FLOP conventions (as torch's FlopCounterMode counts): a "
            "multiply-add is 2 FLOPs, so a k x n weight costs 2·k·n FLOPs per token; attention "
            "costs 4 x (new tokens) x (keys) x head_dim per query head and layer (scores and "
            "weighted sum, the full matrix: causal masking does not halve it); the vocabulary "
            "projection runs only at each pass's last position; norms, RoPE and softmax are not counted.")


def gpu_words(s: Setup) -> str:
    spec = hardware.gpu_spec(GPU)
    return (f"Llama-3-8B: {planner.num_params(LLAMA):,} parameters, {LLAMA.num_layers} layers, "
            f"{LLAMA.num_heads} query heads, {LLAMA.num_kv_heads} kv heads, head_dim {LLAMA.head_dim}. "
            f"{spec['name']}: {spec['memory_gib']} GiB of memory (1 GiB = 2^30 bytes), "
            f"{spec['bandwidth_gbps']:,} GB/s "
            f"(10^9 bytes/s), {spec['peak_tflops']['bfloat16']} dense bf16 TFLOP/s.")


def requests_words(s: Setup) -> str:
    from labkit.techniques import batching

    cfg = s.cfg("static")
    _, requests = batching.workload(cfg)
    listed = ", ".join(f"({r.prompt_len}, {r.output_len})" for r in requests)
    need = batching.longest(requests)
    return (f"The {len(requests)} requests in arrival order as (prompt tokens, output tokens), all "
            f"queued at t = 0: {listed}. Rows per step (batch_size): {cfg.batch_size}. The KV pool "
            f"holds {cfg.kv_budget_tokens} positions: static reserves {need} per row (the longest "
            f"prompt + the longest output), room for {cfg.kv_budget_tokens // need} rows, so the "
            f"{cfg.batch_size} rows bind; continuous takes blocks of {cfg.block_size} as sequences "
            "grow and never runs out here (no preemption).")


# --- closed forms ------------------------------------------------------------------------------------

def continuous_decode_steps(output_lens: list[int], rows: int) -> int:
    """Decode steps of first-come-first-served continuous batching, all queued at t = 0, no
    preemption: a request holds a row for (output - 1) steps (the prefill makes its first token)
    and the next request takes the row that frees first."""
    free_at = [0] * rows  # the step at which each row is free again
    for n in output_lens:
        heapq.heappush(free_at, heapq.heappop(free_at) + n - 1)
    return max(free_at)


def serve_requests(s: Setup) -> tuple[list, int]:
    from labkit.techniques import batching

    cfg = s.cfg("static")
    _, requests = batching.workload(cfg)
    return requests, batching.num_slots(cfg, requests)


def static_plan(s: Setup) -> tuple[int, int, int]:
    """Static batching's (decode steps, positions computed, of which padding): exact."""
    from labkit.techniques import batching

    cfg = s.cfg("static")
    return batching.predicted_steps(cfg, batching.workload(cfg)[1])


def full_rows_steps(s: Setup) -> int:
    """The lower bound: every row busy at every step."""
    requests, rows = serve_requests(s)
    return math.ceil(sum(r.output_len - 1 for r in requests) / rows)


def gen_flops(s: Setup, variant: str) -> int:
    c = s.cfg(variant)
    return planner.generate_flops(c.model, batch=c.batch_size, prompt_len=c.prompt_len,
                                  new_tokens=c.new_tokens, cached=variant != "none")


def pass_flops(s: Setup) -> tuple[int, int]:
    """FLOPs of the prefill pass and of the first decode step (keys: the prompt and itself)."""
    c = s.cfg("dynamic")
    prefill = planner.forward_flops(c.model, batch=1, new=c.prompt_len, keys=c.prompt_len, logits=1)
    decode = planner.forward_flops(c.model, batch=1, new=1, keys=c.prompt_len + 1, logits=1)
    return prefill, decode


def mha(m):
    """The same model with a kv head per query head (multi-head attention)."""
    return dataclasses.replace(m, num_kv_heads=m.num_heads)


def kv_bytes(s: Setup, variant: str) -> int:
    from labkit.techniques import kv_cache

    return kv_cache.bytes_per_token(s.cfg(variant))


# --- the exercises -----------------------------------------------------------------------------------

def build_exercises() -> list[Exercise]:
    topic = TOPICS[5]
    return [*cache_exercises(topic), *sizing_exercises(topic), *serving_exercises(topic)]


def tiny_per_token(r: Rows, s: Setup) -> str | None:
    """The tiny cache measures the formula's bytes per token, kv heads (not query heads) counted."""
    m, dtype = s.cfg("dynamic").model, s.cfg("dynamic").dtype
    measured = r.get("dynamic", "kv_bytes_per_token")
    if measured != planner.kv_bytes_per_token(m, dtype):
        return (f"the tiny cache measured {show(measured, 'bytes')} per token, not the formula's "
                f"{planner.kv_bytes_per_token(m, dtype)} bytes")
    if m.num_kv_heads != m.num_heads and measured == planner.kv_bytes_per_token(mha(m), dtype):
        return "the tiny cache stores a key and value per query head, not per kv head"
    return None


def kv_cache_held(s: Setup) -> int:
    """Positions the dynamic cache holds at the end (the last token is never fed back)."""
    c = s.cfg("dynamic")
    return c.batch_size * (c.prompt_len + c.new_tokens - 1)


def cache_grows_per_token(r: Rows, s: Setup) -> str | None:
    """The cache holds bytes per token x positions: what sizing a long context extrapolates."""
    c, held = s.cfg("dynamic"), kv_cache_held(s)
    measured, predicted = r.get("dynamic", "kv_bytes"), planner.kv_bytes_per_token(c.model, c.dtype) * held
    if measured != predicted:
        return f"the tiny cache held {show(measured, 'bytes')}, not {held} positions x bytes per token"
    return tiny_per_token(r, s)


def cache_exercises(topic: str) -> list[Exercise]:
    return [
        Exercise(
            "kv_per_token", topic, "kv",
            answer=lambda s: planner.kv_bytes_per_token(LLAMA, "bfloat16") / KiB,
            evidence=lambda r, s: {"tiny": show(r.get("dynamic", "kv_bytes_per_token"), "bytes"),
                                   "tiny_formula": show(kv_bytes(s, "dynamic"), "bytes")},
            level=1, mistake=lambda s: planner.kv_bytes_per_token(mha(LLAMA), "bfloat16") / KiB,
            supports=tiny_per_token, unit="KiB", rel_tol=0.01),
        Exercise(
            "kv_int8_ratio", topic, "kv",
            answer=lambda s: 100 * kv_bytes(s, "quantized") / kv_bytes(s, "dynamic"),
            evidence=lambda r, s: {"q": show(r.get("quantized", "kv_bytes_per_token"), "bytes"),
                                   "f": show(r.get("dynamic", "kv_bytes_per_token"), "bytes"),
                                   "err": show(r.get("quantized", "attn_output_rel_error")),
                                   **int8_terms(s)},
            level=2, mistake=lambda s: 25.0,
            supports=int8_supports, details=decode_words, unit="%", abs_tol=0.3),
        Exercise(
            "kv_speedup", topic, "kv",
            choices=("the cached run", "the uncached run", "about the same"),
            answer=lambda s: faster(gen_flops(s, "none") / gen_flops(s, "dynamic")),
            graded_against="measurement", measured=lambda r: faster(speedup(r)),
            evidence=lambda r, s: {"speedup": show(speedup(r)),
                                   "flops": show(gen_flops(s, "none") / gen_flops(s, "dynamic"))},
            level=2, details=decode_words,
            supports=lambda r, s: None if close(r.get("none", "flops") / r.get("dynamic", "flops"),
                                                gen_flops(s, "none") / gen_flops(s, "dynamic"), 0.02)
            else "the counted FLOPs of the two runs do not differ by the recomputed prefix",
            words={"same_speed": SAME_SPEED}),
        Exercise(
            "gqa_kv_saving", topic, "kv",
            answer=lambda s: gqa_saving(LLAMA) / GiB,
            evidence=lambda r, s: {"tiny": show(r.get("dynamic", "kv_bytes_per_token"), "bytes"),
                                   "tiny_mha": show(planner.kv_bytes_per_token(
                                       mha(s.cfg("dynamic").model), s.cfg("dynamic").dtype), "bytes")},
            level=1, mistake=lambda s: gqa_saving(LLAMA) / 2 / GiB,
            supports=tiny_per_token, unit="GiB", rel_tol=0.05, words={"context": CONTEXT}),
        Exercise(
            "prefill_decode_flops", topic, "kv",
            answer=lambda s: pass_flops(s)[0] / s.cfg("dynamic").prompt_len / pass_flops(s)[1],
            evidence=lambda r, s: {"prefill": show(pass_flops(s)[0], "FLOP"),
                                   "decode": show(pass_flops(s)[1], "FLOP"),
                                   "measured": show(r.get("dynamic", "flops"), "FLOP"),
                                   "formula": show(gen_flops(s, "dynamic"), "FLOP")},
            level=3, details=flop_words,
            mistake=lambda s: 1.0,
            supports=lambda r, s: None if close(r.get("dynamic", "flops"), gen_flops(s, "dynamic"), 0.01)
            else "the counted FLOPs of the cached generation differ from the per-pass formula",
            rel_tol=0.05),
    ]


def speedup(r: Rows) -> float:
    return r.get("dynamic", "tokens_per_s") / r.get("none", "tokens_per_s")


def gqa_saving(m) -> int:
    return planner.kv_cache_bytes(mha(m), batch_size=1, seq_len=CONTEXT) - \
        planner.kv_cache_bytes(m, batch_size=1, seq_len=CONTEXT)


def int8_terms(s: Setup) -> dict[str, int]:
    m = s.cfg("quantized").model
    values = 2 * m.num_layers * m.num_kv_heads * m.head_dim
    return {"values": values, "scales": kv_bytes(s, "quantized") - values,
            "fp32": kv_bytes(s, "dynamic"), "layers": m.num_layers}


def int8_supports(r: Rows, s: Setup) -> str | None:
    q, f = r.get("quantized", "kv_bytes_per_token"), r.get("dynamic", "kv_bytes_per_token")
    if q is None or f is None or q != kv_bytes(s, "quantized") or f != kv_bytes(s, "dynamic"):
        return f"the caches measured {show(q)} and {show(f)} bytes per token, not the formula's"
    if q * 4 <= f:
        return "the int8 cache measured no bytes for its scales"
    return None


def sequences_that_fit(s: Setup) -> int:
    """8k-token bf16 sequences of Llama-3-8B in the GPU memory its bf16 weights leave."""
    left = hardware.gpu_spec(GPU)["memory_gib"] * GiB - planner.param_bytes(LLAMA, "bfloat16")
    return left // planner.kv_cache_bytes(LLAMA, batch_size=1, seq_len=CONTEXT)


def decode_bound(s: Setup) -> float:
    """Tokens/s at batch 1 when every decode step reads every bf16 weight once."""
    return hardware.gpu_spec(GPU)["bandwidth_gbps"] * 1e9 / planner.param_bytes(LLAMA, "bfloat16")


def compute_bound(s: Setup) -> float:
    """Tokens/s if decode ran at the bf16 peak, 2 FLOPs per parameter per token."""
    return hardware.gpu_spec(GPU)["peak_tflops"]["bfloat16"] * 1e12 / (2 * planner.num_params(LLAMA))


def tiny_intensity(r: Rows, s: Setup) -> float | None:
    """The cached generation's counted FLOPs per byte it must read (every weight once per pass,
    and the cache held at each step)."""
    from labkit.techniques import kv_cache

    flops = r.get("dynamic", "flops")
    return flops / kv_cache.bytes_read(s.cfg("dynamic")) if flops else None


def intensity_supports(r: Rows, s: Setup) -> str | None:
    """The tiny cached generation's FLOPs per byte read sit far below the GPU's ridge point:
    decode is bound by bytes."""
    spec = hardware.gpu_spec(GPU)
    ridge = spec["peak_tflops"]["bfloat16"] * 1e12 / (spec["bandwidth_gbps"] * 1e9)
    intensity = tiny_intensity(r, s)
    if intensity is None or intensity > ridge / 10:
        return f"the cached generation counted {show(intensity)} FLOP per byte read, not far below " \
               f"the ridge point ({ridge:.0f})"
    return None


def sizing_exercises(topic: str) -> list[Exercise]:
    return [
        Exercise(
            "kv_concurrent_8k", topic, "kv",
            answer=sequences_that_fit, details=gpu_words,
            evidence=lambda r, s: {"weights": show(planner.param_bytes(LLAMA, "bfloat16") / GiB, "GiB"),
                                   "per_seq": show(planner.kv_cache_bytes(LLAMA, batch_size=1,
                                                                          seq_len=CONTEXT) / GiB, "GiB"),
                                   "tiny": f"{r.get('dynamic', 'kv_bytes') or 0:,.0f} bytes",
                                   "tiny_held": kv_cache_held(s)},
            level=2, mistake=lambda s: (hardware.gpu_spec(GPU)["memory_gib"] * GiB
                               - planner.param_bytes(LLAMA, "bfloat16"))
            // planner.kv_cache_bytes(mha(LLAMA), batch_size=1, seq_len=CONTEXT),
            supports=cache_grows_per_token, unit="sequences", abs_tol=1.0, words={"context": CONTEXT}),
        Exercise(
            "decode_bandwidth_bound", topic, "kv",
            answer=decode_bound, details=gpu_words,
            evidence=lambda r, s: {"compute": f"{compute_bound(s):,.0f} tokens/s",
                                   "measured": show(r.get("dynamic", "flops"), "FLOP"),
                                   "intensity": show(tiny_intensity(r, s))},
            level=2, mistake=compute_bound,
            supports=intensity_supports, unit="tokens/s", rel_tol=0.05,
            words={"h200_copy": h200.copy_words()}),
    ]


def measured_is(variant: str, metric: str, predicted, r: Rows, tol: float = 0.0, **point) -> str | None:
    """None when the run measured `predicted` within `tol` (at the Run's `point`), else why not."""
    value = r.get(variant, metric, **point)
    if value is None or abs(value - predicted) > tol:
        return f"{variant} measured {metric} = {show(value)}, not the predicted {show(predicted)}"
    return None


def continuous_supports(r: Rows, s: Setup) -> str | None:
    requests, rows = serve_requests(s)
    steps = continuous_decode_steps([q.output_len for q in requests], rows)
    return (measured_is("continuous", "preemptions", 0, r)
            or measured_is("continuous", "max_concurrent", rows, r)
            or measured_is("continuous", "decode_steps", steps, r))


def serving_exercises(topic: str) -> list[Exercise]:
    return [
        Exercise(
            "padding_waste", topic, "serve",
            answer=lambda s: 100 * static_plan(s)[2] / static_plan(s)[1],
            evidence=lambda r, s: {"pad": show(r.get("static", "padding_waste_pct"), "%"),
                                   "positions": static_plan(s)[1], "padding": static_plan(s)[2]},
            level=2, details=requests_words,
            mistake=lambda s: 100 * static_plan(s)[2] / (static_plan(s)[1] - static_plan(s)[2]),
            supports=lambda r, s: measured_is("static", "padding_waste_pct",
                                              100 * static_plan(s)[2] / static_plan(s)[1], r, 0.5),
            unit="%", abs_tol=3.0),
        Exercise(
            "static_steps", topic, "serve", answer=lambda s: static_plan(s)[0], details=requests_words,
            evidence=lambda r, s: {"steps": show(r.get("static", "decode_steps")),
                                   "full": full_rows_steps(s)},
            level=2, mistake=full_rows_steps,
            supports=lambda r, s: measured_is("static", "decode_steps", static_plan(s)[0], r),
            unit="steps", abs_tol=0.0),
        Exercise(
            "continuous_steps", topic, "serve",
            answer=lambda s: continuous_decode_steps([q.output_len for q in serve_requests(s)[0]],
                                                     serve_requests(s)[1]),
            evidence=lambda r, s: {"steps": show(r.get("continuous", "decode_steps")),
                                   "static": show(r.get("static", "decode_steps")),
                                   "seq": show(r.get("sequential", "decode_steps")),
                                   "full": full_rows_steps(s)},
            level=3, details=requests_words,
            mistake=full_rows_steps,
            supports=continuous_supports, unit="steps", abs_tol=0.0),
    ]
