"""SLA search: the highest request rate each scheduler serves within a TTFT and a TPOT objective.

The schedulers are batching's (`sequential`, the reference, `static`, `dynamic`, `continuous`,
`priority`), on the same engine and workload, replayed as batching replays them
(`labkit.blocks.replay`). For each:

- the check: the workload replayed with every continuation forced, all queued at once; each
  token's log-probability must match the one-at-a-time reference's (batching's check);
- the timed step: the workload as a backlog (all queued at t = 0), the closed loop. Its requests
  per second are the scheduler's saturation rate; its output tokens per second the tokens/s per
  device, and the median request's 1 / TPOT the tokens/s per user: with a `batch_size` sweep, one
  point each of the Pareto figure (`labkit.views.serving`); `usd_per_million_tokens` prices it at
  `price_per_hour`;
- the search: `search_steps` open-loop replays, each with Poisson arrivals re-drawn at one rate
  (the same seed, the same requests), bisecting geometrically between saturation / RATE_BRACKET
  and the saturation rate for the highest rate at which at least `slo_attainment` of the requests
  meet both objectives (`labkit.blocks.slo`). A static list of rates is too coarse (vllm#35086).

The objectives: `ttft_slo_ms` and `tpot_slo_ms`, or (0, the default) `ttft_slo_scale` times a
request's TTFT alone (the workload served one request at a time) and `tpot_slo_scale` times the
decode step of a full batch of `batch_size` rows, both measured on this device: objectives that
mean the same on any machine, never sized from one machine's speed. `goodput_requests_per_s`: the requests that met
both, per second of the replay.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass

import torch

from labkit.config import knob
from labkit.blocks import slo as slos
from labkit.blocks.requests import Request, WorkloadSpec
from labkit.blocks.decoding import load_model
from labkit.blocks.replay import (REFERENCE_SCHEDULER, SCHEDULERS, ServingConfig, compare_replays,
                                  expected_replay, make_engine, num_slots, policy, quantile,
                                  summary, texts, validate_replay, workload, workload_spec)
from labkit.blocks.serving import Engine, Policy, Sequence
from labkit.workload import Workload

VARIANTS = SCHEDULERS
REFERENCE = REFERENCE_SCHEDULER
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"search_steps": 3, "num_requests": 12}, {"search_steps": 2, "num_requests": 8, "max_output_len": 16},
             {"search_steps": 1, "num_requests": 6, "max_output_len": 8, "num_layers": 2})

# batching's tiny sizes; the workload (its first 16 requests, outputs clipped to 32) is the Config's
SIZES = {"tiny": {"batch_size": 8, "kv_budget_tokens": 576}}
RATE_BRACKET = 8  # the search's first bracket: [saturation / 8, saturation]
# Fields that change the baselines' replays (`baselines`): measured once per process for each
# combination, so every scheduler meets the same SLO.
PROBE_FIELDS = ("preset", "device", "dtype", "attention", "seed", "num_threads", "workload",
                "num_requests", "max_output_len", "model", "batch_size", "kv_budget_tokens",
                "block_size")


@dataclass(kw_only=True)
class Config(ServingConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="scheduler")
    workload: str = knob("short", help="a workload in data/workloads (its name) or a JSON file")
    num_requests: int = knob(16, min=0, help="serve the first N requests (0: all)")
    max_output_len: int = knob(32, min=0, help="clip every output length to this (0: as given)")
    arrival: str = knob("closed", choices=("closed",),
                        help="the timed replay is a backlog; the search draws Poisson arrivals")
    ttft_slo_ms: float = knob(0.0, min=0.0, help="time-to-first-token objective (0: "
                                                 "ttft_slo_scale x a request's TTFT alone)")
    tpot_slo_ms: float = knob(0.0, min=0.0, help="time-per-output-token objective (0: "
                                                 "tpot_slo_scale x a full batch's decode step)")
    ttft_slo_scale: float = knob(10.0, min=1.0, help="ttft_slo_ms=0: times a request's TTFT alone")
    tpot_slo_scale: float = knob(2.0, min=1.0, help="tpot_slo_ms=0: times a full batch's decode step")
    slo_attainment: float = knob(0.9, min=0.01, max=1.0,
                                 help="share of requests that must meet both objectives")
    search_steps: int = knob(4, min=0, help="bisection steps, one replay each (0: no search)")
    price_per_hour: float = knob(2.0, min=0.0, help="USD per device-hour, for the cost per token "
                                                    "(a placeholder: enter yours)")


validate = validate_replay  # slo_attainment's range is its knob's


# --- the workload's spec and the objectives ---------------------------------------------------------

_BASELINES: dict[str, tuple[float, float]] = {}  # probe key -> (ttft_s, full_step_s)


def baselines(cfg: Config, model, requests: list[Request], tokens) -> tuple[float, float]:
    """(ttft_s, step_s): the median TTFT of a request served alone (the workload one request at a
    time, TTFT from its start: no queueing), and the median decode step of a full batch (the
    workload as a backlog under `continuous` on `batch_size` rows). Measured once per process for
    each `PROBE_FIELDS` combination, so every scheduler is held to the same objectives."""
    params = cfg.params()
    key = json.dumps({k: params[k] for k in PROBE_FIELDS}, sort_keys=True, default=str)
    if key not in _BASELINES:
        alone = dataclasses.replace(cfg, variant="sequential")
        eng = make_engine(alone, model, requests, tokens, forced=False, closed=True)
        eng.serve(policy(alone, (), 1))
        ttft = quantile([t for t, _ in slos.request_latencies(eng.seqs, eng.started.get)], 50)
        full = dataclasses.replace(cfg, variant="continuous")
        eng = make_engine(full, model, requests, tokens, forced=False, closed=True)
        eng.serve(policy(full, (), num_slots(full, requests)))
        _BASELINES[key] = (ttft, summary(eng, full, ())["decode_step_ms"] / 1e3)
    return _BASELINES[key]


def objectives(cfg: Config, base: tuple[float, float]) -> slos.Slo:
    """The SLO: each objective as set, or where left at 0 its scale x its baseline (`baselines`)."""
    ttft, step = base
    return slos.Slo(ttft_s=cfg.ttft_slo_ms / 1e3 or cfg.ttft_slo_scale * ttft,
                    tpot_s=cfg.tpot_slo_ms / 1e3 or cfg.tpot_slo_scale * step)


# --- building, replaying, searching ----------------------------------------------------------------

def build(cfg: Config) -> Workload:
    classes, requests = workload(cfg)
    model, tokens = load_model(cfg), texts(cfg, requests)
    slots = num_slots(cfg, requests)
    replays: list[Engine] = []
    found: dict[str, float] = {}

    def serve(reqs: list[Request], *, forced: bool = False, closed: bool = True,
              watch: slos.Slo | None = None) -> Engine:
        eng = make_engine(cfg, model, reqs, tokens, forced=forced, closed=closed)
        chosen = policy(cfg, classes, slots)
        allowed = len(reqs) - math.ceil(round(cfg.slo_attainment * len(reqs), 9))
        return eng.serve(chosen if watch is None else SloWatch(chosen, watch, allowed))

    def check() -> dict:
        eng = serve(requests, forced=True)  # batching's check: the fullest batches, forced
        return {"logprobs": {s.req.id: torch.tensor(s.logprobs) for s in eng.seqs},
                "top1": {s.req.id: torch.tensor(s.top1) for s in eng.seqs},
                "served": sum(len(s.out) == s.req.output_len for s in eng.seqs)}

    def step() -> None:
        replays.append(serve(requests))

    def report() -> dict[str, float]:
        """The closed-loop replay with the median throughput (the first, under the memory
        meter, left out), then the search; both outside the meter."""
        closed = closed_loop_rows(cfg, classes, replays[1:] or replays)
        base = baselines(cfg, model, requests, tokens)
        slo = objectives(cfg, base)
        out = {**closed, "ttft_slo_ms": 1e3 * slo.ttft_s, "tpot_slo_ms": 1e3 * slo.tpot_s,
               "alone_ttft_ms": 1e3 * base[0], "full_batch_step_ms": 1e3 * base[1]}
        mean_out = sum(r.output_len for r in requests) / len(requests)
        found["max_requests_per_s"] = slos.saturation_rate(slots, mean_out, closed["decode_step_ms"] / 1e3)
        if cfg.search_steps:
            measure = functools.partial(open_loop, cfg, workload_spec(cfg), requests, serve, slo)
            out.update(search_rows(cfg, measure, closed["saturation_requests_per_s"]))
        return out

    return Workload(step=step, check=check, report=report, predicted=lambda: dict(found),
                    count_flops=False, min_repeats=1,
                    tensors={"kv_bytes": lambda: replays[-1].pool.tensors()},
                    energy_tokens=sum(r.output_len for r in requests), notes=notes(cfg),
                    compute_dtype=cfg.dtype)


def closed_loop_rows(cfg: Config, classes: tuple[str, ...], replays: list[Engine]) -> dict[str, float]:
    """The median-throughput backlog replay: tokens/s per device (`useful_tokens_per_s`), per user
    (the median request's 1 / TPOT), the cost per million tokens, the saturation rate."""
    ranked = sorted((summary(e, cfg, classes) for e in replays),
                    key=lambda m: m["useful_tokens_per_s"])
    m = ranked[len(ranked) // 2]
    device = m["useful_tokens_per_s"]
    return {"useful_tokens_per_s": device, "user_tokens_per_s": 1e3 / m["tpot_p50_ms"],
            "usd_per_million_tokens": slos.usd_per_million_tokens(cfg.price_per_hour, device),
            "saturation_requests_per_s": m["requests_per_s"], "decode_step_ms": m["decode_step_ms"],
            "ttft_p50_ms": m["ttft_p50_ms"], "tpot_p50_ms": m["tpot_p50_ms"],
            "max_concurrent": m["max_concurrent"]}


class ReplayDecided(Exception):
    """A replay stopped early: more requests are sure to miss the SLO than the target allows."""

    def __init__(self, misses: int):
        super().__init__(f"{misses} requests missed the SLO")
        self.misses = misses


class SloWatch(Policy):
    """`inner`'s schedule, unchanged, with a referee: before each admission it counts the requests
    sure to miss `slo` (`certain_misses`) and stops the replay (`ReplayDecided`) once they exceed
    `allowed`; it wakes an idle engine at the next TTFT deadline, so a miss is seen when it
    happens (a static batch waiting to fill). A passing replay never stops: it runs to the end."""

    def __init__(self, inner: Policy, slo: slos.Slo, allowed: int):
        self.inner, self.slo, self.allowed = inner, slo, allowed
        self.pad_prefill = inner.pad_prefill

    def key(self, s: Sequence) -> tuple:
        return self.inner.key(s)

    def admit(self, eng: Engine, *, more_coming: bool) -> list[Sequence]:
        misses = slos.certain_misses(eng.seqs, eng.arrival, eng.now(), self.slo)
        if misses > self.allowed:
            raise ReplayDecided(misses)
        return self.inner.admit(eng, more_coming=more_coming)

    def release(self, eng: Engine) -> None:
        self.inner.release(eng)

    def wake_s(self, eng: Engine) -> float | None:
        now = eng.now()
        deadlines = [eng.arrival(s) + self.slo.ttft_s + 1e-4 for s in eng.waiting
                     if s.first_token_s is None and eng.arrival(s) + self.slo.ttft_s >= now]
        times = [t for t in (self.inner.wake_s(eng), min(deadlines, default=None)) if t is not None]
        return min(times, default=None)


def open_loop(cfg: Config, spec: WorkloadSpec, requests: list[Request], serve, slo: slos.Slo,
              rate_per_s: float) -> dict[str, float]:
    """One real replay with Poisson arrivals at `rate_per_s`: attainment and goodput; or, for a
    replay stopped once its verdict was sure, `slo_attainment` as an upper bound (`stopped`)."""
    try:
        eng = serve(slos.at_rate(spec, requests, rate_per_s), closed=False, watch=slo)
    except ReplayDecided as e:
        return {"slo_attainment": 1 - e.misses / len(requests), "stopped": 1.0}
    makespan = max(s.finish_s for s in eng.seqs)
    return slos.slo_summary(slos.request_latencies(eng.seqs, eng.arrival), slo, makespan)


def search_rows(cfg: Config, measure, saturation_per_s: float) -> dict[str, float]:
    """The bisection between saturation / RATE_BRACKET and saturation, as rows."""
    search = slos.bisect_rate(measure, saturation_per_s / RATE_BRACKET, saturation_per_s,
                              target=cfg.slo_attainment, steps=cfg.search_steps)
    at = {k: v for k, v in search.at_max.items() if k != "stopped"}  # none passed: a bound only
    return {"max_requests_per_s": search.max_requests_per_s, **at,
            "slo_capacity_pct": 100 * search.max_requests_per_s / saturation_per_s,
            "rates_tried": len(search.tried),
            "replays_stopped": sum(m.get("stopped", 0) for _, m in search.tried),
            "bracket_width_per_s": search.high_per_s - search.low_per_s,
            "bracket_ratio": search.high_per_s / search.low_per_s}


# --- napkin math -----------------------------------------------------------------------------------

def expected(cfg: Config) -> dict[str, float]:
    """batching's bounds for the backlog replay (its decode step and throughput), the cost at
    that throughput, the saturation rate it implies, and the search's exact shape."""
    _, requests = workload(cfg)
    out = {k: v for k, v in expected_replay(cfg).items()
           if k in ("kv_bytes", "max_concurrent", "token_agreement", "logprob_max_abs_diff",
                    "decode_step_ms", "useful_tokens_per_s")}
    if "useful_tokens_per_s" in out:
        tokens_per_s = out["useful_tokens_per_s"]
        out["usd_per_million_tokens"] = slos.usd_per_million_tokens(cfg.price_per_hour, tokens_per_s)
        out["saturation_requests_per_s"] = tokens_per_s * len(requests) / sum(r.output_len for r in requests)
    if cfg.search_steps:
        out["rates_tried"] = cfg.search_steps
        out["bracket_ratio"] = RATE_BRACKET ** (2.0 ** -cfg.search_steps)
    return out


compare = compare_replays


def notes(cfg: Config) -> dict[str, str]:
    return {"max_requests_per_s": "the highest open-loop Poisson rate tried at which at least "
                              f"{cfg.slo_attainment:g} of the requests met both objectives "
                              "(0: none in the bracket). Predicted: the capacity, every slot "
                              "decoding at the measured closed-loop step (slots / (mean output "
                              "tokens x decode_step_ms)). The gap is queueing: requests wait "
                              "past the TTFT objective (and prefills stretch TPOT) well before "
                              "the server saturates.",
            "goodput_requests_per_s": "requests that met both objectives per second of the replay "
                                      "at max_requests_per_s (at the lowest rate tried when none "
                                      "passed).",
            "saturation_requests_per_s": "requests per second of the backlog replay (all queued at "
                                     "once): the search's upper end. Predicted: batching's "
                                     "throughput bound in requests.",
            "slo_capacity_pct": "max_requests_per_s as a share of the saturation rate: what the SLO "
                                "leaves of the capacity.",
            "bracket_ratio": "the final bracket's high / low; predicted exactly: "
                             f"{RATE_BRACKET} ** (2 ** -search_steps).",
            "user_tokens_per_s": "tokens/s per user: 1 / the median request's TPOT, backlog replay.",
            "useful_tokens_per_s": "tokens/s per device: output tokens over the backlog replay; "
                                   "predicted: batching's bound (full decode steps at the "
                                   "decode bound).",
            "usd_per_million_tokens": f"at price_per_hour={cfg.price_per_hour:g} USD per "
                                      "device-hour: price / 3600 / useful_tokens_per_s x 1e6.",
            "ttft_slo_ms": "the TTFT objective: as set, or ttft_slo_scale x alone_ttft_ms (the "
                           "median TTFT with the workload served one request at a time here).",
            "tpot_slo_ms": "the TPOT objective: as set, or tpot_slo_scale x full_batch_step_ms "
                           "(the median decode step of batch_size rows, continuous backlog "
                           "replay): a pace a full batch keeps when nothing else runs, so "
                           "prefills between steps are what misses it; on a CPU a full batch's "
                           "step is a few times one row's, on a GPU about the same."}
