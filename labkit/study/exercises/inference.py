"""Exercises on inference: KV-cache bytes (per token, int8, grouped-query attention, what fits on a
GPU), the cache's speed-up, prefill against decode FLOPs, decode's bandwidth bound, and static
against continuous batching (padding, decode steps)."""
from __future__ import annotations

import dataclasses
import heapq
import math

from labkit import hardware, planner
from labkit.config import DTYPE_BYTES, MODELS
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
            "kv_per_token", topic, "KV bytes per token of a real model",
            "Llama-3-8B serves in bf16 (2 bytes per value): 32 layers, 32 query heads sharing 8 kv "
            "heads (grouped-query attention), head_dim 128. The cache keeps one key and one value "
            "vector per kv head and layer for every token. (The run below measures the same formula "
            "on the tiny model.)", "How many KiB of KV cache does one token take?", "kv",
            answer=lambda s: planner.kv_bytes_per_token(LLAMA, "bfloat16") / KiB,
            evidence=lambda r, s: {"tiny": show(r.get("dynamic", "kv_bytes_per_token"), "bytes"),
                                   "tiny_formula": show(kv_bytes(s, "dynamic"), "bytes")},
            why="2 (K and V) x 32 layers x 8 kv heads x 128 x 2 bytes = 131,072 bytes = {answer} "
                "(1 KiB = 1024 bytes). The tiny model "
                "measured {tiny} per token, the formula {tiny_formula}.",
            level=1, hint="Per token and layer the cache holds a key and a value vector for each kv "
                          "head (not each query head). Multiply out, then divide by 1024.",
            mistake=lambda s: planner.kv_bytes_per_token(mha(LLAMA), "bfloat16") / KiB,
            mistake_why="that caches a key and a value for all 32 query heads; with grouped-query "
                        "attention 4 query heads share each of the 8 kv heads, and only those are cached.",
            supports=tiny_per_token, unit="KiB", rel_tol=0.01),
        Exercise(
            "kv_int8_ratio", topic, "An int8 KV cache",
            "The run's model (below) keeps its cache in fp32. It is quantized to int8: each key and "
            "value element takes 1 byte, and every token also keeps, per layer, one fp32 scale for "
            "its keys and one for its values (shared by the kv heads).",
            "What percentage of the fp32 cache's bytes per token does the int8 cache take (values "
            "and scales)?", "kv",
            answer=lambda s: 100 * kv_bytes(s, "quantized") / kv_bytes(s, "dynamic"),
            evidence=lambda r, s: {"q": show(r.get("quantized", "kv_bytes_per_token"), "bytes"),
                                   "f": show(r.get("dynamic", "kv_bytes_per_token"), "bytes"),
                                   "err": show(r.get("quantized", "attn_output_rel_error")),
                                   **int8_terms(s)},
            why="int8 values {values} bytes, scales 2 x {layers} layer(s) x 4 bytes = {scales} bytes, "
                "against {fp32} bytes in fp32: ({values} + {scales}) / {fp32} = {answer}. Measured "
                "{q} against {f} per token; attention output relative error {err}. The scales are "
                "small next to a large head_dim, but they are why int8 is not exactly a quarter.",
            level=2, hint="Count one token's bytes in each cache: 2 x layers x kv heads x head_dim "
                          "values at 4 or 1 bytes, plus, for int8, its scales.",
            mistake=lambda s: 25.0,
            mistake_why="1 byte instead of 4 makes the values 25%, but the int8 cache also stores "
                        "two fp32 scales per token and layer.",
            supports=int8_supports, details=decode_words, unit="%", abs_tol=0.3),
        Exercise(
            "kv_speedup", topic, "Does the KV cache pay off here?",
            "Generate 32 tokens after a 64-token prompt with the run's 1-layer model (below), once "
            "with no cache (every step recomputes the whole prefix) and once with a dynamic cache. "
            f"The two count as 'about the same' when the faster one's tokens/s is at most "
            f"{SAME_SPEED:g}x the slower one's.",
            "Which generates more tokens per second on this device?", "kv",
            choices=("the cached run", "the uncached run", "about the same"),
            answer=lambda s: faster(gen_flops(s, "none") / gen_flops(s, "dynamic")),
            graded_against="measurement", measured=lambda r: faster(speedup(r)),
            evidence=lambda r, s: {"speedup": show(speedup(r)),
                                   "flops": show(gen_flops(s, "none") / gen_flops(s, "dynamic"))},
            why="the uncached run recomputes the whole prefix for every new token: {flops} x the "
                "cached FLOPs (the textbook answer: {answer}). Measured speed-up {speedup} (above "
                f"{SAME_SPEED:g} counts as faster). A small model at small lengths is often bound by "
                "per-step overhead (kernel launches, Python), so the speed-up falls short of the "
                "FLOP ratio.", level=2, details=decode_words,
            hint="Compare the work of step t: the uncached run processes 64 + t tokens, the cached "
                 "one a single token. Then ask whether this device's steps are bound by that work or "
                 "by a fixed cost per step.",
            feedback={
                "the cached run": "the cache removes the prefix's recomputation, many times the "
                                  "FLOPs; it shows on the clock where the steps are bound by that "
                                  "work rather than by a fixed per-step cost.",
                "the uncached run": "the uncached run does all of the cached run's work and the "
                                    "prefix again at every step; it wins only if the cache's "
                                    "bookkeeping costs more than that recomputation.",
                "about the same": "that happens when every step costs about the same fixed time "
                                  "(kernel launches, Python, tiny matmuls) whatever its FLOPs, as "
                                  "for a tiny model on a GPU; the measurement decides."},
            supports=lambda r, s: None if close(r.get("none", "flops") / r.get("dynamic", "flops"),
                                                gen_flops(s, "none") / gen_flops(s, "dynamic"), 0.02)
            else "the counted FLOPs of the two runs do not differ by the recomputed prefix"),
        Exercise(
            "gqa_kv_saving", topic, "What grouped-query attention saves",
            "Llama-3-8B (32 layers, 32 query heads of head_dim 128) uses grouped-query attention "
            "with 8 kv heads; its cache is bf16 (2 bytes per value). Compare it with the same model "
            "with multi-head attention: a kv head per query head (32).",
            f"How many GiB of KV cache does grouped-query attention save on one {CONTEXT:,}-token "
            "sequence?", "kv",
            answer=lambda s: gqa_saving(LLAMA) / GiB,
            evidence=lambda r, s: {"tiny": show(r.get("dynamic", "kv_bytes_per_token"), "bytes"),
                                   "tiny_mha": show(planner.kv_bytes_per_token(
                                       mha(s.cfg("dynamic").model), s.cfg("dynamic").dtype), "bytes")},
            why=f"2 (K and V) x 32 layers x (32 - 8) kv heads x 128 x 2 bytes x {CONTEXT:,} tokens = "
                "{answer} (1 GiB = 2^30 bytes): the cache shrinks by heads / kv heads = 4x, from 4 "
                "GiB to 1 GiB. The tiny model (4 query heads, 2 kv heads) measured {tiny} per token; "
                "with a kv head per query head it would be {tiny_mha}.",
            level=1, hint="Bytes per token are proportional to the kv heads: compute them for 32 and "
                          "for 8, subtract, multiply by the tokens, divide by 2^30.",
            mistake=lambda s: gqa_saving(LLAMA) / 2 / GiB,
            mistake_why="that counts only the keys: the cache holds a key and a value per kv head.",
            supports=tiny_per_token, unit="GiB", rel_tol=0.05),
        Exercise(
            "prefill_decode_flops", topic, "FLOPs per token: prefill against decode",
            "With a cache, the run (below) prefills the 64-token prompt in one pass, then decodes "
            "one token per pass. The first decode step feeds the prefill's token at position 64; "
            "it attends to 65 keys (the prompt and itself).",
            "What is the prefill's FLOPs per prompt token divided by the first decode step's FLOPs?",
            "kv",
            answer=lambda s: pass_flops(s)[0] / s.cfg("dynamic").prompt_len / pass_flops(s)[1],
            evidence=lambda r, s: {"prefill": show(pass_flops(s)[0], "FLOP"),
                                   "decode": show(pass_flops(s)[1], "FLOP"),
                                   "measured": show(r.get("dynamic", "flops"), "FLOP"),
                                   "formula": show(gen_flops(s, "dynamic"), "FLOP")},
            why="per pass: 2 x tokens x (the block's weights) + 2 x hidden x vocabulary at the last "
                "position only + attention 4 x tokens x keys x head_dim x heads. The prefill pass "
                "costs {prefill} (64 tokens share one vocabulary projection), the first decode step "
                "{decode}: ratio {answer}. In this small model the vocabulary projection outweighs the "
                "block, so a decoded token costs more than a prefilled one; in both, each weight is "
                "used about twice per token. FlopCounterMode counted {measured} for the whole cached "
                "generation; the same formula gives {formula}.",
            level=3, details=flop_words,
            hint="Add up one pass's FLOPs: each weight matrix of the block once per token, the "
                 "vocabulary projection once per pass, attention per (token, key) pair. Divide the "
                 "prefill's by its 64 tokens.",
            mistake=lambda s: 1.0,
            mistake_why="'2 FLOPs per parameter per token' holds for the block's weights, but the "
                        "vocabulary projection runs once per pass: the prefill shares it among 64 "
                        "tokens, a decode step pays it for one.",
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
            "kv_concurrent_8k", topic, "How many long sequences fit on one GPU",
            f"Llama-3-8B serves {CONTEXT:,}-token sequences in bf16 (weights and KV cache 2 bytes "
            "per value) on one GPU (below). Count only the weights and the KV cache: no activations, "
            "no allocator reserve, no fragmentation.",
            f"How many {CONTEXT:,}-token sequences fit in the memory the weights leave?", "kv",
            answer=sequences_that_fit, details=gpu_words,
            evidence=lambda r, s: {"weights": show(planner.param_bytes(LLAMA, "bfloat16") / GiB, "GiB"),
                                   "per_seq": show(planner.kv_cache_bytes(LLAMA, batch_size=1,
                                                                          seq_len=CONTEXT) / GiB, "GiB"),
                                   "tiny": f"{r.get('dynamic', 'kv_bytes') or 0:,.0f} bytes",
                                   "tiny_held": kv_cache_held(s)},
            why="weights: 2 bytes x 8,030,261,248 = {weights}; one sequence: 131,072 bytes per token "
                f"(2 x 32 x 8 x 128 x 2) x {CONTEXT:,} = " "{per_seq}; floor((80 GiB - {weights}) / "
                "{per_seq}) = {answer}. The cache grows linearly with the tokens: the tiny run's cache "
                "held {tiny} for {tiny_held} positions, its bytes per token times the positions.",
            level=2, hint="Subtract the weights' bytes from the GPU's memory, then divide by one "
                          "sequence's cache: bytes per token (kv heads, not query heads) times tokens.",
            mistake=lambda s: (hardware.gpu_spec(GPU)["memory_gib"] * GiB
                               - planner.param_bytes(LLAMA, "bfloat16"))
            // planner.kv_cache_bytes(mha(LLAMA), batch_size=1, seq_len=CONTEXT),
            mistake_why="that sizes the cache for all 32 query heads (4 GiB a sequence); Llama-3 "
                        "caches only its 8 kv heads, 1 GiB a sequence.",
            supports=cache_grows_per_token, unit="sequences", abs_tol=1.0),
        Exercise(
            "decode_bandwidth_bound", topic, "Decode's bandwidth bound",
            "Llama-3-8B decodes one sequence at a time (batch 1) in bf16 on the GPU below. Every "
            "decode step reads every weight once from memory; at a short context the KV cache's "
            "reads are small enough to leave out.",
            "At most how many tokens per second can it generate?", "kv",
            answer=decode_bound, details=gpu_words,
            evidence=lambda r, s: {"compute": f"{compute_bound(s):,.0f} tokens/s",
                                   "measured": show(r.get("dynamic", "flops"), "FLOP"),
                                   "intensity": show(tiny_intensity(r, s))},
            why="bandwidth / bytes per step = 3.35 x 10^12 B/s / (2 x 8,030,261,248 B) = {answer}. "
                "Computing at peak would allow {compute}: at batch 1 each weight byte read does 1 FLOP, "
                "far below the GPU's ~295 FLOP/byte ridge point, so the bytes bind. Batching B "
                "sequences reuses each weight read B times. The tiny cached run counted {measured}, "
                "{intensity} FLOP per byte it reads: also far below the ridge point.",
            level=2, hint="Which runs out first at batch 1: the FLOPs (2 per parameter per token) or "
                          "the bytes (every weight once per step)? Compute the tokens/s each allows.",
            mistake=compute_bound,
            mistake_why="that is the compute bound (2 FLOPs per parameter at the bf16 peak); at "
                        "batch 1 a step must first read all 16 GB of weights, which takes far longer.",
            supports=intensity_supports, unit="tokens/s", rel_tol=0.05),
    ]


STATIC_WORDS = ("Static batching serves the requests below in arrival order, in batches of as many "
                "requests as there are rows. A batch is prefilled in one pass padded to its longest "
                "prompt, which yields every row's first output token; then it runs (its longest "
                "output - 1) decode steps, each computing one position per row, and a row whose "
                "request has finished still computes (padding) until the batch ends.")


def measured_is(variant: str, metric: str, predicted, r: Rows, tol: float = 0.0) -> str | None:
    value = r.get(variant, metric)
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
            "padding_waste", topic, "Padding in a static batch",
            STATIC_WORDS + " Padding is every computed position that is neither a prompt token nor a "
                           "fed-back output token of its own request.",
            "What percentage of the positions computed is padding?", "serve",
            answer=lambda s: 100 * static_plan(s)[2] / static_plan(s)[1],
            evidence=lambda r, s: {"pad": show(r.get("static", "padding_waste_pct"), "%"),
                                   "positions": static_plan(s)[1], "padding": static_plan(s)[2]},
            why="per batch rows x (longest prompt + longest output - 1) positions, {positions} in "
                "all; the real ones are every prompt token plus every output token but the last "
                "(sum of prompts + sum of (output - 1)); the rest, {padding}, is padding: {answer} "
                "of all positions. Measured padding {pad}. Continuous batching pads nothing: each "
                "prefill runs alone and a finished row is refilled.",
            level=2, details=requests_words,
            hint="Per batch: rows x (longest prompt + longest output - 1) positions are computed. "
                 "Subtract the real ones (prompts, and outputs minus their last token), divide by "
                 "all positions.",
            mistake=lambda s: 100 * static_plan(s)[2] / (static_plan(s)[1] - static_plan(s)[2]),
            mistake_why="that divides the padding by the real positions; the question asks for its "
                        "share of all positions computed (real + padding).",
            supports=lambda r, s: measured_is("static", "padding_waste_pct",
                                              100 * static_plan(s)[2] / static_plan(s)[1], r, 0.5),
            unit="%", abs_tol=3.0),
        Exercise(
            "static_steps", topic, "Decode steps under static batching",
            STATIC_WORDS, "How many decode steps does static batching take for all the requests?",
            "serve", answer=lambda s: static_plan(s)[0], details=requests_words,
            evidence=lambda r, s: {"steps": show(r.get("static", "decode_steps")),
                                   "full": full_rows_steps(s)},
            why="each batch runs (its longest output - 1) steps; summed over the batches: {answer}. "
                "Measured {steps}. With every row busy at every step it would take {full}: static "
                "batching holds each row until its batch's longest request is done.",
            level=2, hint="Split the requests into consecutive batches of `rows`; each batch costs "
                          "its longest output minus one steps.",
            mistake=full_rows_steps,
            mistake_why="that assumes every row stays busy at every step (rows refilled as requests "
                        "finish); a static batch waits for its longest request.",
            supports=lambda r, s: measured_is("static", "decode_steps", static_plan(s)[0], r),
            unit="steps", abs_tol=0.0),
        Exercise(
            "continuous_steps", topic, "Decode steps under continuous batching",
            "Continuous batching serves the same requests (below) on the same rows, first come, "
            "first served: a request that finishes leaves its row at once, and the next waiting "
            "request takes it at the next step (its prefill runs on its own and yields its first "
            "output token). Every decode step advances each running request by one token.",
            "How many decode steps does it take to serve all the requests?", "serve",
            answer=lambda s: continuous_decode_steps([q.output_len for q in serve_requests(s)[0]],
                                                     serve_requests(s)[1]),
            evidence=lambda r, s: {"steps": show(r.get("continuous", "decode_steps")),
                                   "static": show(r.get("static", "decode_steps")),
                                   "seq": show(r.get("sequential", "decode_steps")),
                                   "full": full_rows_steps(s)},
            why="a request holds a row for (output - 1) steps; give each request in turn to the row "
                "that frees first, and the last row finishes at step {answer}. Measured {steps} "
                "(static {static}, one request at a time {seq}). The ideal ceil(sum(output - 1) / "
                "rows) = {full} is not reached: at the end fewer requests are left than rows, and a "
                "long request that started late runs on alone.",
            level=3, details=requests_words,
            hint="Track when each row frees up. Every request holds a row for (output - 1) decode "
                 "steps, starting when a row frees; the answer is when the last row finishes.",
            mistake=full_rows_steps,
            mistake_why="that assumes every row is busy at every step until the end; near the end "
                        "fewer requests are left than rows, and the long ones that started late run alone.",
            supports=continuous_supports, unit="steps", abs_tol=0.0),
    ]
