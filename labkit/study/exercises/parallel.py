"""Exercises on parallelism and distributed training: the pipeline bubble, ZeRO's per-rank
states, the ring all-reduce, what DDP replicates.

Both Runs behind them ("pipe", "zero") are two CPU processes talking over gloo on any machine,
a GPU's included (they pin device "cpu"): per-rank bytes and the schedule's shape do not depend
on the device, so every answer here is the same for "cpu" and "cuda"."""
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
            "pipeline_bubble", par, "The GPipe bubble",
            "The 2-layer model is split into p = 2 pipeline stages (one rank each) and each step's batch "
            "of 4 into m = 4 micro-batches, scheduled by GPipe (all forwards, then all backwards). "
            "Assume equal stages and free sends. " + DIST_WORDS,
            "What fraction of each stage's step is idle (the bubble)?", "pipe",
            answer=lambda s: (_pipe(s)[0] - 1) / (_pipe(s)[1] + _pipe(s)[0] - 1),
            evidence=lambda r, s: {"bubble": show(r.get("gpipe", "bubble_fraction_mean", stage_delay_ms=0.0)),
                                   "busy": show(r.get("gpipe", "stage_busy_ms", stage_delay_ms=0.0), "ms"),
                                   "wall": show(r.get("gpipe", "schedule_wall_ms", stage_delay_ms=0.0), "ms")},
            why="the first micro-batch reaches the last stage after p - 1 forwards and the last one "
                "leaves the first stage p - 1 backwards after the others; of the m + p - 1 slots a "
                "stage's schedule spans it is busy in m: idle (p - 1) / (m + p - 1) = {answer}. "
                "Measured from each rank's compute timestamps: a mean bubble of {bubble} (rank 0 busy "
                "{busy} of a {wall} schedule). The formula is a lower bound: on a CPU sends, wake-ups "
                "of the other process and a shared core add idle time. More micro-batches shrink it.",
            level=1, abs_tol=0.02,
            hint="Count the schedule in micro-batch slots: how many slots does a stage span from the "
                 "first forward to the last backward, and in how many is it busy?",
            mistake=lambda s: (_pipe(s)[0] - 1) / _pipe(s)[1],
            mistake_why="(p - 1) / m is the bubble relative to the busy time (the GPipe and Megatron "
                        "papers' overhead ratio); the idle share of the whole step divides by "
                        "m + p - 1.",
            supports=_bubble_supports,
            details=lambda s: f"p = {_pipe(s)[0]} stages, m = {_pipe(s)[1]} micro-batches."),
        Exercise(
            "ring_allreduce", dist, "Bytes a rank sends in a ring all-reduce",
            f"DDP all-reduces the fp32 gradients of the 2-layer tiny model with a ring (NCCL's and "
            f"gloo's algorithm for large messages) over N = {RING_RANKS} ranks. (The measurement "
            f"below runs the same DDP step over 2 CPU ranks with gloo, on any machine.)",
            "How many MiB does each rank send per step?", "zero",
            answer=lambda s: ring_allreduce_bytes(planner.param_bytes(s.cfg().model, "float32"),
                                                  RING_RANKS) / MiB,
            evidence=lambda r, s: {"grads": mib(r.get("ddp", "grad_bytes")),
                                   "step": show(r.get("ddp", "step_ms"), "ms")},
            why="a ring all-reduce is a reduce-scatter then an all-gather, each N - 1 steps in which "
                "a rank sends one 1/N chunk: 2 (N - 1) / N x gradient bytes (4 bytes x params) = "
                "{answer}. Measured: the gradients DDP reduced (its buckets) hold {grads}, the size "
                "the formula starts from; gloo does not count the bytes it sends, so the sends "
                "themselves are not measured (the 2-rank DDP step took {step}). nccl-tests' bus "
                "bandwidth uses the same 2 (N - 1) / N factor.",
            level=2, unit="MiB", rel_tol=0.02,
            hint="Split the all-reduce into a reduce-scatter and an all-gather; in each, how many "
                 "chunks of what size does one rank send?",
            mistake=lambda s: planner.param_bytes(s.cfg().model, "float32") / MiB,
            mistake_why="each rank does not send its gradients once: it sends N - 1 chunks of 1/N "
                        "in the reduce-scatter and N - 1 more in the all-gather, 2 (N - 1) / N of "
                        "the gradients, approaching twice their size as N grows.",
            supports=_ring_supports, details=model_words),
    ]


def _zero_states() -> list[Exercise]:
    par, dist = TOPICS[2], TOPICS[3]
    return [
        Exercise(
            "zero3_params", par, "ZeRO-3 parameters per rank",
            "Two data-parallel ranks train the 2-layer tiny model in fp32 with ZeRO-3 (FSDP2 "
            "fully_shard).", "How many MiB of parameters does each rank hold at rest?", "zero",
            answer=lambda s: _zero_state(s, 3, 0),
            evidence=lambda r, s: {"z3": mib(r.get("zero3", "param_bytes")),
                                   "z0": mib(r.get("ddp", "param_bytes"))},
            why="ZeRO-3 shards the weights too: 4 bytes x params / N = {answer}. Measured from rank 0's "
                "local shards: {z3} (DDP holds all of them: {z0}).", level=2, unit="MiB", rel_tol=0.02,
            hint="fp32 weights are 4 bytes each; which of the three model states does stage 3 add to "
                 "the sharded ones?",
            mistake=lambda s: _zero_state(s, 0, 0),
            mistake_why="that is DDP's (and ZeRO-1's and -2's) full copy: stage 3 is the one that "
                        "shards the parameters, gathering each block only while it computes.",
            supports=_zero_supports(3, 0, 0), details=_zero_words),
        Exercise(
            "zero3_grads", dist, "ZeRO gradients per rank",
            "Same two ranks, ZeRO-3, fp32 gradients.", "How many MiB of gradients does each rank "
            "keep after the backward (reduce-scattered)?", "zero",
            answer=lambda s: _zero_state(s, 3, 1),
            evidence=lambda r, s: {"z3": mib(r.get("zero3", "grad_bytes")),
                                   "z0": mib(r.get("ddp", "grad_bytes"))},
            why="from stage 2 on, each rank keeps only its shard of the reduced gradients: 4 x params / "
                "N = {answer}. Measured: {z3} (DDP: {z0}, its all-reduce buckets).", level=2,
            unit="MiB", rel_tol=0.02,
            hint="A reduce-scatter leaves each rank the sum of one 1/N slice, not of everything.",
            mistake=lambda s: _zero_state(s, 0, 1),
            mistake_why="that is an all-reduce's result (DDP): a reduce-scatter leaves each rank only "
                        "its 1/N shard of the summed gradients.",
            supports=_zero_supports(3, 1, 0), details=_zero_words),
        Exercise(
            "zero1_optimizer", par, "ZeRO-1 optimizer states per rank",
            "Same two ranks, ZeRO-1 (ZeroRedundancyOptimizer around AdamW), fp32.",
            "How many MiB of AdamW state does each rank hold?", "zero",
            answer=lambda s: _zero_state(s, 1, 2),
            evidence=lambda r, s: {"z1": mib(r.get("zero1", "optimizer_bytes")),
                                   "z0": mib(r.get("ddp", "optimizer_bytes"))},
            why="AdamW keeps two fp32 moments (8 bytes/param); stage 1 shards them: 8 x params / N = "
                "{answer}. Measured: {z1} against DDP's {z0} (plus a 4-byte step counter per tensor).",
            level=2, unit="MiB", rel_tol=0.02,
            hint="How many fp32 values per parameter does AdamW keep, and over how many ranks are "
                 "they split?",
            mistake=lambda s: _zero_state(s, 1, 2) / 2,
            mistake_why="AdamW keeps two moments per parameter (exp_avg and exp_avg_sq), 8 bytes in "
                        "fp32, not one.",
            supports=_zero_supports(1, 2, 0), details=_zero_words),
        Exercise(
            "ddp_optimizer", dist, "What plain DDP replicates",
            "Same two ranks with plain DDP (ZeRO stage 0), AdamW in fp32.",
            "How many MiB of AdamW state does each rank hold?", "zero",
            answer=lambda s: _zero_state(s, 0, 2),
            evidence=lambda r, s: {"z0": mib(r.get("ddp", "optimizer_bytes")),
                                   "z3": mib(r.get("zero3", "optimizer_bytes"))},
            why="DDP replicates everything: 8 bytes x params on every rank = {answer}, however many "
                "ranks. Measured: {z0}; ZeRO-3 on the same ranks: {z3}.", level=2, unit="MiB",
            rel_tol=0.02,
            hint="DDP shares the gradients (an all-reduce), not the optimizer: every rank steps the "
                 "whole model.",
            mistake=lambda s: _zero_state(s, 1, 2),
            mistake_why="DDP does not split the optimizer across ranks: each rank runs the full AdamW "
                        "step on all parameters; sharding the moments is ZeRO-1.",
            supports=_zero_supports(0, 2, 3), details=_zero_words),
        Exercise(
            "zero_state_saving", par, "What ZeRO-3 saves over ZeRO-1",
            "Same two ranks, fp32 with AdamW: ZeRO-1 (ZeroRedundancyOptimizer) against ZeRO-3 (FSDP2 "
            "fully_shard). Count every model state a rank keeps at rest after a step: parameters, "
            "gradients and AdamW's moments.",
            "How many MiB of model state per rank does ZeRO-3 save against ZeRO-1?", "zero",
            answer=lambda s: _zero_total(s, 1) - _zero_total(s, 3),
            evidence=lambda r, s: {"z1": show(sum(_measured_mib(r, 1, i) or 0 for i in range(3)), "MiB"),
                                   "z3": show(sum(_measured_mib(r, 3, i) or 0 for i in range(3)), "MiB")},
            why="ZeRO-1 keeps whole parameters and gradients and 1/N of the moments: 4Ψ + 4Ψ + 8Ψ/N; "
                "ZeRO-3 keeps 1/N of all three: 16Ψ/N; the difference is (4 + 4) Ψ (N - 1) / N = "
                "{answer}. Measured per rank: {z1} under ZeRO-1 against {z3} under ZeRO-3. The price is "
                "communication: ZeRO-3 gathers each block's weights in the forward and again in the "
                "backward.",
            level=3, unit="MiB", rel_tol=0.02,
            hint="Write each stage's per-rank bytes as params + grads + moments (4, 4 and 8 bytes per "
                 "parameter, whole or / N), then subtract.",
            mistake=lambda s: _zero_state(s, 1, 0) - _zero_state(s, 3, 0),
            mistake_why="ZeRO-3 does not only shard the parameters: its gradients are reduce-scattered "
                        "into shards too (ZeRO-1 keeps them whole), which doubles the saving.",
            supports=_saving_supports, details=_zero_words),
    ]
