"""A pipeline schedule replayed on measured durations: the bubble it predicts.

`schedule_order` gives each stage's forward ("F") and backward ("B") ops in the order torch's
`ScheduleGPipe` and `Schedule1F1B` issue them; `replay` runs them as a discrete-event simulation
on per-stage durations and one handoff time; `step_bubbles` reads a step's wall and each stage's
busy time off spans, measured or replayed alike, so the prediction and the measurement share one
definition of the bubble (1 - busy / wall). With equal stages and free handoffs the replay gives
(p-1)/(m+p-1) exactly.
"""
from __future__ import annotations


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


def replay(orders: list[list[tuple[str, int]]], fwd: list[float], bwd: list[float],
           handoff: float) -> list[list[tuple[float, float]]]:
    """A discrete-event replay: each stage runs its ops in order, one at a time; F(s, i) starts
    after F(s-1, i) plus one handoff, B(s, i) after B(s+1, i) plus one handoff (the last stage's
    after its own F(s, i)). fwd[s], bwd[s]: stage s's seconds per micro-batch. Returns each
    stage's (start, end) spans."""
    p, done = len(orders), {}  # (kind, stage, micro-batch) -> end; ints stay exact
    spans: list[list[tuple[float, float]]] = [[] for _ in range(p)]
    while any(len(spans[s]) < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while len(spans[s]) < len(orders[s]):
                kind, i = orders[s][len(spans[s])]
                peer = s - 1 if kind == "F" else s + 1
                dep = (kind, peer, i) if 0 <= peer < p else ("F", s, i) if kind == "B" else None
                if dep is not None and dep not in done:
                    break
                ready = 0 if dep is None else done[dep] + (handoff if dep[1] != s else 0)
                start = max(spans[s][-1][1] if spans[s] else 0, ready)
                done[(kind, s, i)] = start + (fwd[s] if kind == "F" else bwd[s])
                spans[s].append((start, done[(kind, s, i)]))
                progressed = True
        if not progressed:
            raise ValueError("the schedules wait on each other: no op can start")
    return spans


def replayed_bubbles(variant: str, m: int, fwd: list[float], bwd: list[float],
                     handoff: float) -> tuple[float, list[float]]:
    """The step's wall (seconds) and each stage's bubble, 1 - busy / wall as measured."""
    p = len(fwd)
    wall, busy = step_bubbles(replay([schedule_order(variant, s, p, m) for s in range(p)],
                                     fwd, bwd, handoff))
    return wall, [1 - b / wall for b in busy]


def ideal_bubble(p: int, m: int) -> float:
    """(p-1)/(m+p-1): the bubble of p equal stages, m micro-batches and free handoffs."""
    return (p - 1) / (m + p - 1)
