"""Exercises on context parallelism: the bytes a rank sends in one ring-attention step, and the
share of the causal work the last rank does when the sequence is split into contiguous blocks.
They name RUNS["context"]: one attention layer on two CPU ranks (gloo), whose shapes are in every
scenario; the answers are the same on any device.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit import planner
from labkit.study.exercises.core import KiB, TOPICS, Exercise, Rows, Setup, show
from labkit.study.exercises.inference import measured_is


def _shape(s: Setup) -> dict[str, int]:
    c, m = s.cfg("ring"), s.cfg("ring").model
    return {"batch": c.batch_size, "kv_heads": m.num_kv_heads, "seq_len": c.seq_len,
            "head_dim": m.head_dim, "n": c.nproc}


def shape_words(s: Setup) -> str:
    c, m = s.cfg("ring"), s.cfg("ring").model
    return (f"One attention layer: q of shape (B, H, S, D) = ({c.batch_size}, {m.num_heads}, "
            f"{c.seq_len}, {m.head_dim}), k and v of shape (B, KV, S, D) with KV = {m.num_kv_heads}, "
            f"fp32 (4 bytes), split over n = {c.nproc} ranks, {c.seq_len // c.nproc} tokens each.")


def block_kib(s: Setup) -> float:
    """One k (or v) block of S/n tokens, in KiB."""
    d = _shape(s)
    return planner.cp_block_bytes(d["batch"], d["kv_heads"], d["seq_len"], d["head_dim"], d["n"]) / KiB


def ring_kib(s: Setup, backward: bool = True) -> float:
    return planner.ring_sent_bytes(**_shape(s), backward=backward) / KiB


def pairs(s: Setup) -> list[int]:
    c = s.cfg("ring")
    return planner.causal_pairs(c.seq_len, c.nproc, "contiguous")


def last_share(s: Setup) -> float:
    return 100 * pairs(s)[-1] / sum(pairs(s))


def _measured_kib(r: Rows) -> str:
    value = r.get("ring", "comm_bytes")
    return show(None if value is None else value / KiB, "KiB")


def build_exercises() -> list[Exercise]:
    topic = TOPICS[2]  # parallelism
    return [
        Exercise(
            "cp_ring_bytes", topic, "context", answer=ring_kib, details=shape_words,
            evidence=lambda r, s: {"block": show(block_kib(s), "KiB"), "n": s.cfg("ring").nproc,
                                   "n_1": s.cfg("ring").nproc - 1,
                                   "hops": 3 * s.cfg("ring").nproc - 2, "measured": _measured_kib(r),
                                   "forward": show(ring_kib(s, backward=False), "KiB")},
            level=2, unit="KiB", abs_tol=0.5, mistake=lambda s: ring_kib(s, backward=False),
            supports=lambda r, s: measured_is("ring", "comm_bytes", ring_kib(s) * KiB, r)),
        Exercise(
            "cp_causal_share", topic, "context", answer=last_share, details=shape_words,
            evidence=lambda r, s: {"first": pairs(s)[0], "last": pairs(s)[-1], "total": sum(pairs(s)),
                                   "measured_first": show(r.get("ring", "attended_pairs")),
                                   "measured_last": show(r.get("ring", "attended_pairs", rank=1)),
                                   "zigzag": show(r.get("ring_zigzag", "attended_pairs"))},
            level=1, unit="%", abs_tol=0.5, mistake=lambda s: 100 / s.cfg("ring").nproc,
            supports=lambda r, s: (measured_is("ring", "attended_pairs", pairs(s)[0], r)
                                   or measured_is("ring", "attended_pairs", pairs(s)[-1], r, rank=1))),
    ]
