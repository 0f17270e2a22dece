"""Exercises on padding-free packing: the padding fraction of a padded batch, and the attention
pairs a packed row needs with a document mask against what a causal row allows. They name
RUNS["packing"]: its seeded documents' lengths are in every scenario.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit.blocks import packing
from labkit.study.exercises.core import TOPICS, Exercise, Setup, percent, show
from labkit.study.exercises.inference import measured_is


def lengths(s: Setup) -> list[int]:
    from labkit.techniques import packing as experiment

    return experiment.lengths(s.cfg("packed"))


def rows(s: Setup) -> int:
    """Rows first-fit decreasing packs the documents into."""
    return len(packing.first_fit(lengths(s), s.cfg("packed").seq_len))


def lengths_words(s: Setup) -> str:
    n = lengths(s)
    return (f"The step's {len(n)} documents have {', '.join(map(str, n))} tokens "
            f"({sum(n)} in all; the longest {max(n)}).")


def packed_words(s: Setup) -> str:
    T = s.cfg("packed").seq_len
    return (lengths_words(s) + f" First-fit decreasing packs them whole into {rows(s)} rows of "
            f"{T} tokens; the rest of each row is pads, which form a block of their own.")


def padding(s: Setup) -> float:
    n = lengths(s)
    return 100 * packing.padding_fraction(n, len(n), max(n))


def pads_over_real(s: Setup) -> float:
    n = lengths(s)
    return 100 * (len(n) * max(n) - sum(n)) / sum(n)


def pair_share(s: Setup, per_row: int | None = None) -> float:
    """The documents' pairs over the rows' causal pairs (or `per_row` pairs a row), in %."""
    T = s.cfg("packed").seq_len
    return 100 * packing.document_pairs(lengths(s)) / (rows(s) * (per_row or packing.causal_pairs(T)))


def build_exercises() -> list[Exercise]:
    topic = TOPICS[0]
    return [
        Exercise(
            "packing_padding", topic, "packing", answer=padding, details=lengths_words,
            evidence=lambda r, s: {"pad": percent(r.get("padded", "padding_fraction")),
                                   "packed_pad": percent(r.get("packed", "padding_fraction")),
                                   "total": sum(lengths(s)), "computed": len(lengths(s)) * max(lengths(s))},
            level=1, mistake=pads_over_real, unit="%", abs_tol=0.5,
            supports=lambda r, s: measured_is("padded", "padding_fraction", padding(s) / 100, r, 1e-9)),
        Exercise(
            "packing_attention_pairs", topic, "packing", answer=pair_share, details=packed_words,
            evidence=lambda r, s: {"needed": packing.document_pairs(lengths(s)),
                                   "allowed": rows(s) * packing.causal_pairs(s.cfg("packed").seq_len),
                                   "measured": show(r.get("packed", "attention_pairs")),
                                   "naive": show(r.get("packed_naive", "attention_pairs"))},
            level=2, unit="%", abs_tol=0.5,
            mistake=lambda s: pair_share(s, s.cfg("packed").seq_len ** 2),
            supports=lambda r, s: measured_is("packed", "attention_pairs",
                                              packing.document_pairs(lengths(s)), r)),
    ]
