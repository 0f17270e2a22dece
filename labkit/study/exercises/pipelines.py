"""Exercises on the pipelines with fewer bubbles: the interleaved schedule's bubble as a share of
the step, and the micro-batches a zero-bubble rank holds for backward. They name RUNS["zb"]:
two gloo ranks, m = 4, v = 2 modules per rank, every schedule checked against one process.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit.planner import pipeline as plan
from labkit.study.exercises.core import TOPICS, Exercise, Setup, percent, show
from labkit.study.exercises.inference import measured_is

RANK = 1  # the rank the in-flight exercise asks about: the last stage's, where ZB1P and 1F1B differ most


def sizes(s: Setup, variant: str) -> tuple[int, int, int]:
    """(p, m, v) of the run's `variant`."""
    from labkit.techniques import pipeline_parallel as experiment

    cfg = s.cfg(variant)
    return experiment.num_stages(cfg), cfg.micro_batches, cfg.virtual_stages


def sizes_words(s: Setup) -> str:
    p, m, v = sizes(s, "interleaved_1f1b")
    return f"p = {p} ranks, m = {m} micro-batches a step, v = {v} stage modules per rank."


def interleaved_pct(s: Setup) -> float:
    return 100 * plan.interleaved_bubble_fraction(*sizes(s, "interleaved_1f1b"))


def interleaved_ratio_pct(s: Setup) -> float:
    """The mistake: the paper's ratio to the ideal time, (p-1)/(v·m), taken for the step's share."""
    p, m, v = sizes(s, "interleaved_1f1b")
    return 100 * (p - 1) / (v * m)


def held(s: Setup, variant: str) -> int:
    p, m, v = sizes(s, variant)
    return plan.in_flight_micro_batches(variant, p, m, RANK, v)


def build_exercises() -> list[Exercise]:
    topic = TOPICS[2]
    return [
        Exercise(
            "interleaved_bubble", topic, "zb", answer=interleaved_pct, details=sizes_words,
            evidence=lambda r, s: {
                "ideal_1f1b": percent(r.get("1f1b", "ideal_bubble_fraction")),
                "measured": percent(r.get("interleaved_1f1b", "bubble_fraction_mean")),
                "replayed": percent(r.predicted("interleaved_1f1b", "bubble_fraction_mean")),
                "sends": show(r.get("interleaved_1f1b", "send_count")),
                "sends_1f1b": show(r.get("1f1b", "send_count"))},
            level=1, unit="%", abs_tol=0.5, mistake=interleaved_ratio_pct,
            supports=lambda r, s: measured_is("interleaved_1f1b", "ideal_bubble_fraction",
                                              interleaved_pct(s) / 100, r, 1e-9)),
        Exercise(
            "zb_in_flight", topic, "zb", answer=lambda s: held(s, "zero_bubble"), details=sizes_words,
            evidence=lambda r, s: {
                "zb": show(r.get("zero_bubble", "in_flight_micro_batches", rank=RANK)),
                "f1b": show(r.get("1f1b", "in_flight_micro_batches", rank=RANK)),
                "interleaved": show(r.get("interleaved_1f1b", "in_flight_micro_batches", rank=RANK)),
                "saved_zb": show(r.get("zero_bubble", "activation_bytes", rank=RANK), "B"),
                "saved_1f1b": show(r.get("1f1b", "activation_bytes", rank=RANK), "B")},
            level=2, abs_tol=0, mistake=lambda s: held(s, "1f1b") * sizes(s, "zero_bubble")[2],
            supports=lambda r, s: _held_is(r, held(s, "zero_bubble")),
            words={"rank": RANK}),
    ]


def _held_is(r, count: int) -> str | None:
    value = r.get("zero_bubble", "in_flight_micro_batches", rank=RANK)
    if value != count:
        return f"zero_bubble measured {show(value)} micro-batches held on rank {RANK}, not {count}"
    return None
