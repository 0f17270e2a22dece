"""Exercises on compressed gradients: the bytes the int8 hook hands to the gradient all-reduces
(one byte an element and one fp32 scale per bucket), and PowerSGD's P and Q with the tensors it
sends as they are. They name RUNS["compression"]: two gloo ranks, DDP with each hook.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

import math

from labkit import planner
from labkit.planner import compression as formulas
from labkit.study.exercises.core import TOPICS, Exercise, Setup, show
from labkit.study.exercises.inference import measured_is

KIB = 2**10


def shapes(s: Setup) -> list[tuple[int, ...]]:
    from labkit.techniques import grad_compression

    return grad_compression.grad_shapes(s.cfg("int8"))


def buckets(s: Setup) -> list[int]:
    from labkit.techniques import grad_compression

    return grad_compression.predicted_buckets(s.cfg("int8"))


def int8_bytes(s: Setup) -> int:
    return formulas.int8_reduce_bytes(buckets(s))


def int8_words(s: Setup) -> str:
    cfg = s.cfg("int8")
    return (f"The model has {planner.num_params(cfg.model):,} parameters, all trained, fp32. DDP "
            f"groups their gradients into {len(buckets(s))} buckets of at most "
            f"{cfg.bucket_cap_mb:g} MiB; {cfg.nproc} ranks.")


def powersgd_kib(s: Setup, vectors: bool = True) -> float:
    n = formulas.powersgd_numel(shapes(s), s.cfg("powersgd").powersgd_rank)
    return 4 * (n["p"] + n["q"] + (n["uncompressed"] if vectors else 0)) / KIB


def powersgd_words(s: Setup) -> str:
    cfg = s.cfg("powersgd")
    matrices = [sh for sh in shapes(s) if len(sh) > 1]
    vectors = sum(math.prod(sh) for sh in shapes(s) if len(sh) == 1)
    listed = ", ".join(f"{a} x {b}" for a, b in sorted(set(matrices), reverse=True))
    return (f"PowerSGD at rank r = {cfg.powersgd_rank}, every matrix worth compressing. The model's "
            f"{len(matrices)} weight matrices have the shapes {listed} (some repeated: "
            f"{cfg.model.num_layers} blocks, the embedding and the head); its norms hold "
            f"{vectors:,} more numbers. Everything is fp32.")


def ratio(value: float | None) -> str:
    """int8's ratio to 5 decimals: 4 less the scales' sliver, which 4 significant digits hide."""
    return "none" if value is None else f"{value:.5f}"


def build_exercises() -> list[Exercise]:
    topic = TOPICS[3]  # multi-GPU and distributed setups
    return [
        Exercise(
            "gc_int8_bytes", topic, "compression", answer=int8_bytes, details=int8_words,
            evidence=lambda r, s: {"fp32": show(4 * planner.num_params(s.cfg("int8").model), "bytes"),
                                   "measured": show(r.get("int8", "grad_comm_bytes"), "bytes"),
                                   "ratio": ratio(r.get("int8", "compression_ratio"))},
            level=2, unit="bytes", abs_tol=0.5,
            mistake=lambda s: planner.num_params(s.cfg("int8").model),
            supports=lambda r, s: measured_is("int8", "grad_comm_bytes", int8_bytes(s), r)),
        Exercise(
            "gc_powersgd_bytes", topic, "compression", answer=powersgd_kib, details=powersgd_words,
            evidence=lambda r, s: {"measured": show((r.get("powersgd", "grad_comm_bytes") or 0) / KIB, "KiB"),
                                   "ratio": show(r.get("powersgd", "compression_ratio")),
                                   "loss_delta": show(r.get("powersgd", "loss_delta"))},
            level=2, unit="KiB", abs_tol=0.01,
            mistake=lambda s: powersgd_kib(s, vectors=False),
            supports=lambda r, s: measured_is("powersgd", "grad_comm_bytes", powersgd_kib(s) * KIB, r)),
    ]
