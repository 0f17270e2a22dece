"""The claims table (issue 30): every number in a question's text (stem, choices, explanation,
feedback) or a notebook's Markdown that labkit measures or computes, beside the computation that
produces it at the settings the text states. A claim is (where: a question id or a notebook
text's path; the words as written; how labkit makes them). `check()` names the claims whose
words labkit no longer makes, or that the text no longer holds; `counts()` says how many come
from each source; `python -m labkit.study.claims` prints the table.

The tables, by the texts they hold: `parallel` (the cp-, moe-, gc-, zb- questions), `training`
(memory, parallelism, multi-GPU, precision, fine-tuning), `serving` (inference, profiling, the
GPUs of data/gpus.json, quantization, packing), `notebooks` (notebooks/text/*.md and the typed
numbers of notebooks/exercises/text/*.md). What is left out, and why, is data/quiz_conventions.md's
last section."""
from __future__ import annotations

from collections import Counter

from labkit.hardware import REPO_DIR
from labkit.study.claims import notebooks, parallel, serving, training
from labkit.study.claims.base import Claim

CLAIMS: list[Claim] = [*parallel.CLAIMS, *training.CLAIMS, *serving.CLAIMS, *notebooks.CLAIMS]
SOURCES = ("question", "feedback", "notebook", "exercise text")


def texts() -> dict[str, dict[str, str]]:
    """Every text a claim may name, by source: a question's words in its stem, choices and
    explanation (`question`) and in its feedback (`feedback`); a notebook text's Markdown."""
    from labkit.study.quiz import load_bank

    out: dict[str, dict[str, str]] = {}
    for q in load_bank():
        out[q.id] = {"question": " ".join([q.question, *q.choices, q.explanation]),
                     "feedback": " ".join(q.feedback)}
    for folder, source in (("notebooks/text", "notebook"), ("notebooks/exercises/text", "exercise text")):
        for path in sorted((REPO_DIR / folder).glob("*.md")):
            out[f"{folder}/{path.name}"] = {source: path.read_text(encoding="utf-8")}
    return out


def source(claim: Claim, words: dict[str, dict[str, str]]) -> str | None:
    """Where the claim's words stand in its text (the stem first), or None when nowhere."""
    fields = words.get(claim.text, {})
    return next((name for name in SOURCES if claim.number in fields.get(name, "")), None)


def check(claims: list[Claim] = CLAIMS) -> list[str]:
    """One line per claim that fails: labkit makes other words, or the text lacks them."""
    words, failed = texts(), []
    for claim in claims:
        try:
            made = claim.make()
        except Exception as e:  # a renamed function or setting: the claim fails, the others still run
            failed.append(f"{claim.text}: labkit cannot make {claim.number!r}: {type(e).__name__}: {e}")
            continue
        if made != claim.number:
            failed.append(f"{claim.text}: labkit makes {made!r}, the table says {claim.number!r}")
        elif source(claim, words) is None:
            failed.append(f"{claim.text}: its text no longer says {claim.number!r}")
    return failed


def counts(claims: list[Claim] = CLAIMS) -> Counter:
    """Claims by source (question, feedback, notebook, exercise text)."""
    words = texts()
    return Counter(source(claim, words) for claim in claims)
