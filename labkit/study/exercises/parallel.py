"""Exercises on parallelism and distributed training: the pipeline bubble, ZeRO's per-rank
states, the ring all-reduce, what DDP replicates.

Both Runs behind them ("pipe", "zero") are two CPU processes talking over gloo on any machine,
a GPU's included (they pin device "cpu"): per-rank bytes and the schedule's shape do not depend
on the device, so every answer here is the same for "cpu" and "cuda".

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit import planner
from labkit.blocks.layout import ZERO_MODES
from labkit.study.exercises.core import MiB, TOPICS, Exercise, Rows, Setup, mib, model_words, show
from labkit.study.exercises.formulas import ring_allreduce_bytes

DIST_WORDS = ("Measured on two CPU processes over gloo on any machine, a GPU's included: the "
              "answer (per-rank bytes, the schedule's shape) does not depend on the device.")
RING_RANKS = 8  # the ring all-reduce scenario's N: at N = 2 its 2 (N - 1) / N factor is 1
STATES = ("param_bytes", "grad_bytes", "optimizer_bytes")  # the zero Run's per-rank metrics


def _psi(s: Setup) -> int:
    return planner.num_params(s.cfg().model)


def _zero_state(s: Setup, stage: int, which: int) -> float:
    """Per-rank bytes of params (0), grads (1) or AdamW states (2) at ZeRO `stage`, in MiB."""
    return planner.zero_model_state_bytes(_psi(s), stage=stage, dp=s.cfg().nproc, precision="fp32",
                                          optimizer="adamw")[which] / MiB


def _zero_total(s: Setup, stage: int) -> float:
    return sum(_zero_state(s, stage, i) for i in range(3))


def _zero_words(s: Setup) -> str:
    return f"{model_words(s)} N = {s.cfg().nproc} data-parallel ranks. {DIST_WORDS}"


def _measured_mib(r: Rows, stage: int, which: int) -> float | None:
    value = r.get(ZERO_MODES[stage], STATES[which])
    return None if value is None else value / MiB


def _close(measured: float | None, predicted: float, rel: float = 0.02) -> bool:
    return measured is not None and abs(measured - predicted) <= rel * abs(predicted)


def _zero_supports(stage: int, which: int, contrast: int):
    """The measured per-rank bytes of `stage` match the formula within 2%, and so do those of
    `contrast` (the other side of the comparison the explanation draws)."""
    def check(r: Rows, s: Setup) -> str | None:
        for st in (stage, contrast):
            got, want = _measured_mib(r, st, which), _zero_state(s, st, which)
            if not _close(got, want):
                return (f"rank 0's {STATES[which]} under {ZERO_MODES[st]} is {mib((got or 0) * MiB)}, "
                        f"not the predicted {mib(want * MiB)}")
        return None
    return check


def _pipe(s: Setup) -> tuple[int, int]:
    cfg = s.cfg("gpipe")
    return cfg.nproc, cfg.micro_batches


def _bubble_supports(r: Rows, s: Setup) -> str | None:
    """A stage cannot start before its inputs exist, so the stages' mean bubble is at least
    (p - 1) / (m + p - 1) whatever the stage costs (the critical-path bound); 0.02 of clock slack.
    The pipeline must also train the reference's step (the same loss)."""
    p, m = _pipe(s)
    mean = r.get("gpipe", "bubble_fraction_mean", stage_delay_ms=0.0)
    loss = r.get("gpipe", "loss_rel_diff", stage_delay_ms=0.0)
    if mean is None or mean < (p - 1) / (m + p - 1) - 0.02:
        return f"the measured mean bubble {show(mean)} is below the schedule's bound"
    if loss is None or loss > 1e-6:
        return f"the pipeline's loss differs from the single-process step's ({show(loss)})"
    return None


def _ring_supports(r: Rows, s: Setup) -> str | None:
    """The size the ring starts from: the gradient bytes DDP reduced (its buckets) are the fp32
    parameter bytes. The bytes a rank sends are not counted by gloo, so not measured here."""
    want = planner.param_bytes(s.cfg().model, "float32")
    got = r.get("ddp", "grad_bytes")
    return None if _close(got, want) else f"DDP's gradient buckets hold {mib(got)}, not {mib(want)}"


def _saving_supports(r: Rows, s: Setup) -> str | None:
    got = [sum(_measured_mib(r, st, i) or 0.0 for i in range(3)) for st in (1, 3)]
    want = _zero_total(s, 1) - _zero_total(s, 3)
    return None if _close(got[0] - got[1], want) else (
        f"the measured totals differ by {show(got[0] - got[1], 'MiB')}, not {show(want, 'MiB')}")


def build_exercises() -> list[Exercise]:
    return [*_pipeline_and_ring(), *_zero_states()]


def _pipeline_and_ring() -> list[Exercise]:
    par, dist = TOPICS[2], TOPICS[3]
    return [
        Exercise(
            "pipeline_bubble", par, "pipe",
            answer=lambda s: (_pipe(s)[0] - 1) / (_pipe(s)[1] + _pipe(s)[0] - 1),
            evidence=lambda r, s: {"bubble": show(r.get("gpipe", "bubble_fraction_mean", stage_delay_ms=0.0)),
                                   "busy": show(r.get("gpipe", "stage_busy_ms", stage_delay_ms=0.0), "ms"),
                                   "wall": show(r.get("gpipe", "schedule_wall_ms", stage_delay_ms=0.0), "ms")},
            level=1, abs_tol=0.02,
            mistake=lambda s: (_pipe(s)[0] - 1) / _pipe(s)[1],
            supports=_bubble_supports,
            details=lambda s: f"p = {_pipe(s)[0]} stages, m = {_pipe(s)[1]} micro-batches."),
        Exercise(
            "ring_allreduce", dist, "zero",
            answer=lambda s: ring_allreduce_bytes(planner.param_bytes(s.cfg().model, "float32"),
                                                  RING_RANKS) / MiB,
            evidence=lambda r, s: {"grads": mib(r.get("ddp", "grad_bytes")),
                                   "step": show(r.get("ddp", "step_ms"), "ms")},
            level=2, unit="MiB", rel_tol=0.02,
            mistake=lambda s: planner.param_bytes(s.cfg().model, "float32") / MiB,
            supports=_ring_supports, details=model_words, words={"ring_ranks": RING_RANKS}),
    ]


def _zero_states() -> list[Exercise]:
    par, dist = TOPICS[2], TOPICS[3]
    return [
        Exercise(
            "zero3_params", par, "zero",
            answer=lambda s: _zero_state(s, 3, 0),
            evidence=lambda r, s: {"z3": mib(r.get("zero3", "param_bytes")),
                                   "z0": mib(r.get("ddp", "param_bytes"))},
            level=2, unit="MiB", rel_tol=0.02,
            mistake=lambda s: _zero_state(s, 0, 0),
            supports=_zero_supports(3, 0, 0), details=_zero_words),
        Exercise(
            "zero3_grads", dist, "zero",
            answer=lambda s: _zero_state(s, 3, 1),
            evidence=lambda r, s: {"z3": mib(r.get("zero3", "grad_bytes")),
                                   "z0": mib(r.get("ddp", "grad_bytes"))},
            level=2, unit="MiB", rel_tol=0.02,
            mistake=lambda s: _zero_state(s, 0, 1),
            supports=_zero_supports(3, 1, 0), details=_zero_words),
        Exercise(
            "zero1_optimizer", par, "zero",
            answer=lambda s: _zero_state(s, 1, 2),
            evidence=lambda r, s: {"z1": mib(r.get("zero1", "optimizer_bytes")),
                                   "z0": mib(r.get("ddp", "optimizer_bytes"))},
            level=2, unit="MiB", rel_tol=0.02,
            mistake=lambda s: _zero_state(s, 1, 2) / 2,
            supports=_zero_supports(1, 2, 0), details=_zero_words),
        Exercise(
            "ddp_optimizer", dist, "zero",
            answer=lambda s: _zero_state(s, 0, 2),
            evidence=lambda r, s: {"z0": mib(r.get("ddp", "optimizer_bytes")),
                                   "z3": mib(r.get("zero3", "optimizer_bytes"))},
            level=2, unit="MiB", rel_tol=0.02,
            mistake=lambda s: _zero_state(s, 1, 2),
            supports=_zero_supports(0, 2, 3), details=_zero_words),
        Exercise(
            "zero_state_saving", par, "zero",
            answer=lambda s: _zero_total(s, 1) - _zero_total(s, 3),
            evidence=lambda r, s: {"z1": show(sum(_measured_mib(r, 1, i) or 0 for i in range(3)), "MiB"),
                                   "z3": show(sum(_measured_mib(r, 3, i) or 0 for i in range(3)), "MiB")},
            level=3, unit="MiB", rel_tol=0.02,
            mistake=lambda s: _zero_state(s, 1, 0) - _zero_state(s, 3, 0),
            supports=_saving_supports, details=_zero_words),
    ]
