"""Exercises on speculative decoding: Leviathan et al.'s expected tokens per target forward, and
the speed-up once the draft's cost is paid. They name RUNS["spec"]: the tiny preset, whose random draft agrees by
chance and whose prompt lookup finds the loops greedy decoding falls into.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit.blocks import speculative as spec
from labkit.study.exercises.core import TOPICS, Exercise, Rows, Setup, show

ALPHA = 0.8  # the per-guess acceptance both scenarios give
COST_RATIO = 0.5  # the draft's forward over the target's in the speed-up scenario


def k(s: Setup) -> int:
    return s.cfg("draft").num_speculative


def tokens_words(s: Setup) -> str:
    return (f"The run proposes k = {k(s)} tokens per step (num_speculative). Each guess is "
            f"accepted with probability {ALPHA}, independently, and a step stops at its first "
            "rejection; the target's own next token is always emitted.")


def measured(r: Rows, variant: str) -> dict[str, str]:
    return {"alpha": show(r.get(variant, "alpha")),
            "per_step": show(r.get(variant, "tokens_per_step")),
            "speedup": show(r.get(variant, "speedup"), "x"),
            "c": show(r.get(variant, "cost_ratio"))}


def tokens_supported(r: Rows, s: Setup) -> str | None:
    """Prompt lookup emitted 1 to k + 1 tokens per target forward, and exactly the reference's."""
    per_step, same = r.get("prompt_lookup", "tokens_per_step"), r.get("prompt_lookup", "token_agreement")
    if per_step is None or not 1 <= per_step <= k(s) + 1:
        return f"prompt lookup measured {show(per_step)} tokens per forward, outside 1 to k + 1"
    return None if same == 1 else f"prompt lookup's tokens agree {show(same)} with greedy decoding's, not 1"


def draft_cost_supported(r: Rows, s: Setup) -> str | None:
    """The draft's forwards are time too: its speed-up falls below its tokens per forward."""
    speedup, per_step = r.get("draft", "speedup"), r.get("draft", "tokens_per_step")
    if speedup is None or per_step is None or not r.get("draft", "cost_ratio"):
        return "the run measured no draft speed-up, tokens per forward or cost ratio"
    return None if speedup < per_step else \
        f"the draft's speed-up {show(speedup, 'x')} is not below its {show(per_step)} tokens per forward"


def build_exercises() -> list[Exercise]:
    topic = TOPICS[5]
    return [
        Exercise(
            "spec_tokens_per_step", topic, "spec",
            answer=lambda s: spec.expected_tokens_per_step(ALPHA, k(s)), details=tokens_words,
            evidence=lambda r, s: {f"pl_{m}": v for m, v in measured(r, "prompt_lookup").items()},
            level=1, mistake=lambda s: 1 + ALPHA * k(s),
            supports=tokens_supported, rel_tol=0.01),
        Exercise(
            "spec_draft_speedup", topic, "spec",
            answer=lambda s: spec.expected_speedup(ALPHA, k(s), COST_RATIO), details=tokens_words,
            evidence=lambda r, s: {f"d_{m}": v for m, v in measured(r, "draft").items()},
            level=2, mistake=lambda s: spec.expected_tokens_per_step(ALPHA, k(s)),
            supports=draft_cost_supported, unit="x", rel_tol=0.01, words={"cost_ratio": COST_RATIO}),
    ]
