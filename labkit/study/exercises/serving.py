"""Exercises on the serving engine's prefix cache (`labkit.techniques.batching`, `prefix_cache`):
the prefill tokens it saves on a shared-system-prompt workload and its block hit rate.

Both share one Run (RUNS["serve_prefix"] in `labkit.study.exercises.runs`):
the first 8 requests of `shared_prefix` (each prompt one of 3 system prompts of 64 tokens, then
8 to 32 tokens of its own), all queued at t = 0, a pool that never runs out, `continuous` with the
prefix cache. The answers come from the tokens alone (`batching.prefix_savings`), before the
replay; with no preemption and no eviction the measured rows equal them exactly.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit.study.exercises.core import TOPICS, Exercise, Rows, Setup, show
from labkit.techniques import batching

VARIANT = "continuous"


def requests_of(s: Setup):
    cfg = s.cfg(VARIANT)
    return cfg, batching.workload(cfg)[1]


def savings(s: Setup) -> tuple[int, int]:
    """(blocks reused, blocks looked up), from the requests' tokens."""
    cfg, requests = requests_of(s)
    return batching.prefix_savings(batching.prompts_of(cfg, requests), cfg.block_size)


def prefill_with_cache(s: Setup) -> int:
    cfg, requests = requests_of(s)
    return sum(r.prompt_len for r in requests) - savings(s)[0] * cfg.block_size


def all_share(s: Setup) -> int:
    """The common mistake: every request, the first of each system prompt too, skips its prefix."""
    _, requests = requests_of(s)
    return sum(r.prompt_len - r.prefix_len for r in requests)


def touched_blocks(s: Setup) -> int:
    """The hit rate's common wrong denominator: every block a prompt touches, partial ones too."""
    cfg, requests = requests_of(s)
    return sum(-(-r.prompt_len // cfg.block_size) for r in requests)


def prefix_words(s: Setup) -> str:
    cfg, requests = requests_of(s)
    listed = ", ".join(f"({r.prompt_len}, prompt {r.prefix_id})" for r in requests)
    return (f"The {len(requests)} requests in arrival order as (prompt tokens, which system prompt), "
            f"all queued at t = 0: {listed}. Each prompt is its system prompt ({requests[0].prefix_len} "
            f"tokens, the same tokens for every request naming it) followed by tokens of its own, "
            f"which match no other prompt. KV blocks hold {cfg.block_size} positions; the pool holds "
            f"{cfg.kv_budget_tokens} positions (nothing is preempted or evicted); {cfg.batch_size} rows.")


def measured_is(metric: str, predicted: float, r: Rows) -> str | None:
    value = r.get(VARIANT, metric)
    if value is None or abs(value - predicted) > 1e-9:
        return f"{VARIANT} measured {metric} = {show(value)}, not the predicted {show(predicted)}"
    return None


def build_exercises() -> list[Exercise]:
    topic = TOPICS[5]
    return [
        Exercise(
            "prefix_prefill_tokens", topic, "serve_prefix", answer=prefill_with_cache, details=prefix_words,
            evidence=lambda r, s: {"measured": show(r.get(VARIANT, "prefill_tokens")),
                                   "total": sum(q.prompt_len for q in requests_of(s)[1]),
                                   "saved": savings(s)[0] * requests_of(s)[0].block_size,
                                   "fraction": show(r.get(VARIANT, "shared_prefix_fraction"))},
            level=2, mistake=all_share,
            supports=lambda r, s: measured_is("prefill_tokens", prefill_with_cache(s), r),
            unit="tokens", abs_tol=0.0),
        Exercise(
            "prefix_hit_rate", topic, "serve_prefix",
            answer=lambda s: savings(s)[0] / savings(s)[1], details=prefix_words,
            evidence=lambda r, s: {"measured": show(r.get(VARIANT, "prefix_hit_rate")),
                                   "reused": savings(s)[0], "looked_up": savings(s)[1]},
            level=2, mistake=lambda s: savings(s)[0] / touched_blocks(s),
            supports=lambda r, s: measured_is("prefix_hit_rate", savings(s)[0] / savings(s)[1], r),
            unit="", abs_tol=0.01),
    ]
