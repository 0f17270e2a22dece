"""A pipeline schedule replayed on measured durations: the bubble and the activations it predicts.

An action is (stage, kind, micro-batch), kind "F" (forward), "B" (full backward), "I" (the
backward to the stage's input) or "W" (the backward to its weights). `torch_orders` gives every
rank's actions in the order torch's schedules issue them (`schedule_order` for ScheduleGPipe and
Schedule1F1B; the looped and zero-bubble schedules' own `pipeline_order`); `replay_actions` runs
them as a discrete-event simulation on per-stage durations and one handoff time; `step_bubbles`
reads a step's wall and each rank's busy time off spans, measured or replayed alike, so the
prediction and the measurement share one definition of the bubble (1 - busy / wall).
`in_flight` walks the same actions: the micro-batches each rank holds saved for backward.
"""
from __future__ import annotations

from typing import Callable

from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

Action = tuple[int, str, int]  # (stage, "F" | "B" | "I" | "W", micro-batch)
LOOPED = {"interleaved_1f1b": ScheduleInterleaved1F1B, "zero_bubble": ScheduleInterleavedZeroBubble,
          "zbv": ScheduleZBVZeroBubble}  # several stages per rank
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, **LOOPED}  # by variant name
SPLIT = ("zero_bubble", "zbv")  # the backward split into I and W


def step_bubbles(spans: list[list[tuple[float, float, float]]]) -> tuple[float, list[float]]:
    """spans[rank] = that rank's (start, end, ...) in one step -> the step's wall (first start to
    last end on any rank: one host, one clock) and each rank's busy time, both in seconds."""
    wall = max(s[1] for rank in spans for s in rank) - min(s[0] for rank in spans for s in rank)
    return wall, [sum(s[1] - s[0] for s in rank) for rank in spans]


def schedule_order(variant: str, stage: int, p: int, m: int) -> list[tuple[str, int]]:
    """The ("F" | "B", micro-batch) ops stage `stage` of p runs in one step, in the order torch's
    ScheduleGPipe / Schedule1F1B issue them."""
    if variant == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, p - stage)
    steady = [op for i in range(m - warmup) for op in (("B", i), ("F", warmup + i))]
    return ([("F", i) for i in range(warmup)] + steady
            + [("B", i) for i in range(m - warmup, m)])


def stages_per_rank(variant: str, v: int) -> int:
    """Stage modules each rank holds: v for the looped schedules, 2 for ZBV's V, else 1."""
    return 2 if variant == "zbv" else v if variant in LOOPED else 1


def rank_of(variant: str, p: int) -> Callable[[int], int]:
    """Stage index -> its rank: looped (stage s on rank s mod p), or ZBV's V (stages r and
    2p-1-r on rank r, so rank p-1 holds the two middle stages and rank 0 the ends)."""
    if variant == "zbv":
        return lambda s: s if s < p else 2 * p - 1 - s
    return lambda s: s % p


def local_stages(variant: str, rank: int, p: int, v: int) -> list[int]:
    """The stage indices rank `rank` holds, in increasing order."""
    owner = rank_of(variant, p)
    return sorted(s for s in range(p * stages_per_rank(variant, v)) if owner(s) == rank)


def actions_of(pipeline_order: dict[int, list]) -> list[list[Action]]:
    """A torch schedule's `pipeline_order` (rank -> its _Action list, None for an idle slot) as
    labkit's actions, rank by rank."""
    return [[(a.stage_index, a.computation_type.value, a.microbatch_index)
             for a in pipeline_order[r] if a is not None] for r in sorted(pipeline_order)]


def torch_orders(variant: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's actions in one step, as torch's schedule for `variant` issues them, computed
    without ranks: the looped schedules' own order methods, run on an unbuilt instance given the
    few sizes they read (the experiment replays its live schedule's `pipeline_order`, which the
    tests hold equal to this)."""
    if variant not in LOOPED:
        return [[(s, kind, i) for kind, i in schedule_order(variant, s, p, m)] for s in range(p)]
    cls = LOOPED[variant]
    sched = cls.__new__(cls)
    n = stages_per_rank(variant, v)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, n, m
    sched.num_stages = p * n
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    if variant != "zbv" and m % sched.number_of_rounds:
        raise ValueError(f"{cls.__name__} needs m a multiple of max(1, m // p) (m={m}, p={p})")
    sched.pipeline_order = {r: sched._calculate_single_rank_operations(r) for r in range(p)}
    if variant == "zero_bubble":
        sched.pipeline_order = sched._add_bubbles_to_actions(p * n)
    return actions_of(sched.pipeline_order)


def _dependency(action: Action, last: int) -> tuple[str, int, int] | None:
    """The op `action` waits for: the previous stage's forward; the next stage's backward (the
    last stage's own forward); a W its own I."""
    s, kind, i = action
    if kind == "F":
        return ("F", s - 1, i) if s > 0 else None
    if kind == "W":
        return ("I", s, i)
    return ("F", s, i) if s == last else ("I", s + 1, i)  # B and I both pass the input gradient


def replay_actions(orders: list[list[Action]], seconds: Callable[[int, str], float], handoff: float,
                   rank: Callable[[int], int]) -> list[list[tuple[float, float]]]:
    """A discrete-event replay: each rank runs its actions in order, one at a time, each as soon
    as the op it waits for has ended, plus one handoff where that op ran on another rank.
    seconds(stage, kind): one op's duration. Returns each rank's (start, end) spans."""
    last = max(s for order in orders for s, _, _ in order)
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> end
    spans: list[list[tuple[float, float]]] = [[] for _ in orders]
    while any(len(spans[r]) < len(order) for r, order in enumerate(orders)):
        progressed = False
        for r, order in enumerate(orders):
            while len(spans[r]) < len(order):
                s, kind, i = order[len(spans[r])]
                dep = _dependency((s, kind, i), last)
                if dep is not None and dep not in done:
                    break
                ready = 0 if dep is None else done[dep] + (handoff if rank(dep[1]) != r else 0)
                start = max(spans[r][-1][1] if spans[r] else 0, ready)
                # a full backward also stands for the I a previous stage waits on
                key = ("I" if kind == "B" else kind, s, i)
                done[key] = start + seconds(s, kind)
                spans[r].append((start, done[key]))
                progressed = True
        if not progressed:
            raise ValueError("the schedules wait on each other: no op can start")
    return spans


def replay(orders: list[list[tuple[str, int]]], fwd: list[float], bwd: list[float],
           handoff: float) -> list[list[tuple[float, float]]]:
    """`replay_actions` for one stage per rank (stage s on rank s): orders[s] = its ("F" | "B",
    micro-batch) ops, fwd[s] and bwd[s] its seconds per micro-batch."""
    actions = [[(s, kind, i) for kind, i in order] for s, order in enumerate(orders)]
    return replay_actions(actions, lambda s, kind: fwd[s] if kind == "F" else bwd[s], handoff,
                          lambda s: s)


def bubbles(spans: list[list[tuple[float, float]]]) -> tuple[float, list[float]]:
    """The step's wall (seconds) and each rank's bubble, 1 - busy / wall as measured."""
    wall, busy = step_bubbles(spans)
    return wall, [1 - b / wall for b in busy]


def replayed_bubbles(variant: str, m: int, fwd: list[float], bwd: list[float],
                     handoff: float) -> tuple[float, list[float]]:
    """GPipe or 1F1B replayed, one stage per rank: the step's wall and each stage's bubble."""
    p = len(fwd)
    return bubbles(replay([schedule_order(variant, s, p, m) for s in range(p)], fwd, bwd, handoff))


def in_flight(orders: list[list[Action]], weight: Callable[[int], float] = lambda s: 1, *,
              early: Callable[[int], float] = lambda s: 0, shared: float = 0,
              sharing: tuple[tuple[int, str], ...] = ()) -> list[float]:
    """Each rank's peak, over its actions in order, of the micro-batches it holds saved for
    backward, each weighted by weight(stage) (1: a count; a stage's bytes per micro-batch: its
    activation bytes). A micro-batch is held from its forward to its full backward or, split,
    to its W: the I keeps the graph the W still walks, all but `early(stage)` of it (torch frees
    what lies above the stage's first weight, the loss, once the input gradient is out).
    `shared`: one storage the micro-batches of the stages in `sharing` view, held while any
    does; (stage, "I" | "W"): which op of a split backward ends that stage's view."""
    peaks = []
    for order in orders:
        split = any(kind == "W" for _, kind, _ in order)
        held, peak, viewing = 0, 0, {s: 0 for s, _ in sharing}
        ends = {s: end if split else "B" for s, end in sharing}
        for s, kind, _ in order:
            held += {"F": weight(s), "B": -weight(s), "I": -early(s),
                     "W": early(s) - weight(s)}[kind]
            if s in viewing:
                viewing[s] += 1 if kind == "F" else -1 if kind == ends[s] else 0
            peak = max(peak, held + (shared if any(viewing.values()) else 0))
        peaks.append(peak)
    return peaks


def timeline(variant: str, p: int, m: int, v: int = 1, handoff: float = 0.0) -> list[dict]:
    """One step of `variant` replayed on equal stage modules (a module's F, I and W each 1/n of
    a stage's third, B = I + W; n modules per rank), as rows: rank, stage, kind, micro_batch,
    start, end (in units of one stage's forward)."""
    n = stages_per_rank(variant, v)
    orders = torch_orders(variant, p, m, v)
    spans = replay_actions(orders, lambda s, kind: (2 if kind == "B" else 1) / n, handoff,
                           rank_of(variant, p))
    return [{"variant": variant, "rank": r, "stage": s, "kind": kind, "micro_batch": i,
             "start": start, "end": end}
            for r, (order, times) in enumerate(zip(orders, spans))
            for (s, kind, i), (start, end) in zip(order, times)]
