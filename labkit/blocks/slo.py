"""Serving under a latency SLO: attainment, goodput, the request-rate search, the Pareto front.

Pure functions over the serving engine's sequences and plain numbers; nothing here runs a model.

- A request meets the SLO when its TTFT (arrival to first token) is at most `ttft_s` AND its TPOT
  (the time per output token after the first) at most `tpot_s`; a one-token output has no TPOT
  and is judged on its TTFT alone.
- `slo_attainment`: the fraction of requests that met both. `goodput_requests_per_s`: those
  requests per second of the replay (its start to its last token), the definition of DistServe's
  announcement (hao-ai-lab's "goodput, the number of completed requests per second adhering to the
  SLOs") and of vLLM's benchmark `--goodput`. DistServe's paper then asks for the highest request
  rate at which a target attainment (90%) still holds, per device: `bisect_rate` finds it.
- The search bisects the rate geometrically (its midpoints are geometric means): the rates of
  interest span a factor of ten or more, and each step divides the bracket's ratio hi / lo by its
  square root, whatever the outcome. It assumes attainment falls as the rate rises (more
  queueing); a scheduler that waits to fill batches breaks that at low rates, and its tried rates
  show it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence as Seq

from labkit.blocks.requests import Request, WorkloadSpec, make_requests
from labkit.blocks.serving import Sequence


@dataclass(frozen=True)
class Slo:
    """Latency objectives, seconds: time to first token, and time per output token after it."""

    ttft_s: float
    tpot_s: float


def request_latencies(seqs: Iterable[Sequence], arrival: Callable[[Sequence], float]
                      ) -> list[tuple[float, float | None]]:
    """(ttft_s, tpot_s) per served sequence; tpot None for a one-token output. `arrival`: the
    engine's (`Engine.arrival`: 0 for a backlog replay, else the request's arrival time)."""
    out = []
    for s in seqs:
        n = s.req.output_len
        tpot = (s.finish_s - s.first_token_s) / (n - 1) if n > 1 else None
        out.append((s.first_token_s - arrival(s), tpot))
    return out


def slo_met(latencies: Iterable[tuple[float, float | None]], slo: Slo) -> list[bool]:
    """Per request: both objectives met (a missing TPOT meets its objective)."""
    return [ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s) for ttft, tpot in latencies]


def slo_summary(latencies: Seq[tuple[float, float | None]], slo: Slo, duration_s: float
                ) -> dict[str, float]:
    """`slo_attainment` (the share meeting both), `goodput_requests_per_s` (those per second of
    `duration_s`), and the share meeting each objective alone (which one binds)."""
    met = slo_met(latencies, slo)
    n = len(met)
    return {"slo_attainment": sum(met) / n, "goodput_requests_per_s": sum(met) / duration_s,
            "ttft_attainment": sum(t <= slo.ttft_s for t, _ in latencies) / n,
            "tpot_attainment": sum(p is None or p <= slo.tpot_s for _, p in latencies) / n}


def at_rate(spec: WorkloadSpec, requests: Seq[Request], rate_per_s: float) -> list[Request]:
    """`requests` with open-loop Poisson arrivals at `rate_per_s`, drawn from `spec`'s seed; their
    lengths and classes kept. Every rate draws the same exponential gaps (a Poisson stream's gaps
    scale as 1 / rate), so rates differ only in how fast the same requests arrive."""
    spec = dataclasses.replace(spec, arrival="poisson", rate_per_s=rate_per_s,
                               num_requests=max(spec.num_requests, len(requests)))
    times = [r.arrival_s for r in make_requests(spec)]
    return [dataclasses.replace(r, arrival_s=t) for r, t in zip(requests, times)]


def certain_misses(seqs: Iterable[Sequence], arrival: Callable[[Sequence], float], now_s: float,
                   slo: Slo) -> int:
    """Requests already sure to miss the SLO at time `now_s` of a replay (those arrived): no first
    token past the TTFT objective, or (unfinished too) more time since the first token than TPOT
    objective x the tokens after it; finished ones judged as `slo_met` does. A replay can stop once
    these exceed what the target attainment allows: its verdict is known."""
    missed = 0
    for s in seqs:
        start, n = arrival(s), s.req.output_len
        if start > now_s:
            continue
        if s.first_token_s is None:
            missed += now_s - start > slo.ttft_s
            continue
        late_first = s.first_token_s - start > slo.ttft_s
        end = s.finish_s if s.finish_s is not None else now_s
        missed += late_first or (n > 1 and end - s.first_token_s > slo.tpot_s * (n - 1))
    return missed


@dataclass(frozen=True)
class RateSearch:
    """A search's outcome: `max_requests_per_s`, the highest rate tried that met the target (0.0 when
    none did: the answer lies below the bracket), its measurements `at_max` (the lowest rate's when
    none passed), the final bracket [`low_per_s`, `high_per_s`], and every (rate, measurements)
    tried, in order."""

    max_requests_per_s: float
    at_max: Mapping[str, float]
    low_per_s: float
    high_per_s: float
    tried: tuple[tuple[float, Mapping[str, float]], ...]

    @property
    def found(self) -> bool:
        return self.max_requests_per_s > 0


def bisect_rate(measure: Callable[[float], Mapping[str, float]], low_per_s: float,
                high_per_s: float, *, target: float, steps: int) -> RateSearch:
    """The highest rate in [low, high] whose `measure(rate)["slo_attainment"]` is at least
    `target`, by `steps` geometric bisections (each one call of `measure`, a replay). The
    threshold of a falling attainment lies in the final bracket, whose ratio high / low is the
    first one's to the power 2**-steps; the ends themselves are not measured."""
    if not 0 < low_per_s < high_per_s:
        raise ValueError(f"a rate bracket needs 0 < low < high, got [{low_per_s}, {high_per_s}]")
    tried: list[tuple[float, Mapping[str, float]]] = []
    low, high = low_per_s, high_per_s
    for _ in range(steps):
        rate = math.sqrt(low * high)
        result = measure(rate)
        tried.append((rate, result))
        if result["slo_attainment"] >= target:
            low = rate
        else:
            high = rate
    passing = [(r, m) for r, m in tried if m["slo_attainment"] >= target]
    lowest = min(tried, key=lambda t: t[0], default=(0.0, {}))
    best = max(passing, key=lambda t: t[0]) if passing else (0.0, lowest[1])
    return RateSearch(best[0], best[1], low, high, tuple(tried))


def saturation_rate(num_slots: int, mean_output_tokens: float, step_s: float) -> float:
    """Requests per second a server finishes when every one of its `num_slots` rows decodes one
    token per step of `step_s`: a request holds a row for `mean_output_tokens` steps (prefill,
    host work and waiting left out, so a bound)."""
    return num_slots / (mean_output_tokens * step_s)


def usd_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    """What a million output tokens cost on a device rented at `price_per_hour` (USD per
    device-hour) producing `tokens_per_s`: price / 3600 s per hour / tokens per second * 1e6."""
    return price_per_hour / 3600 / tokens_per_s * 1e6


def pareto_front(points: Seq[tuple[float, float]]) -> list[bool]:
    """Per point (x, y), both to maximise: True when no other point is at least as good on both
    and better on one. Equal points are all on the front."""
    return [not any(a >= x and b >= y and (a > x or b > y) for a, b in points) for x, y in points]
