"""Replaying a request workload through the serving engine under one scheduler: what the
serving experiments (batching, sla) share.

- `ServingConfig`: the scheduler (`SCHEDULERS`, `sequential` the reference) and the knobs of the
  workload, the KV budget and the paging schedulers' tricks (prefix cache, chunked prefill);
- the workload: a shipped or given file (`labkit.blocks.requests`), cut and clipped as the config
  says (`workload`), its seeded tokens (`texts`), and `validate_replay`'s refusals;
- an `Engine` (`labkit.blocks.serving`) and its `Policy` for the config's scheduler
  (`make_engine`, `policy`), a budget that holds `num_slots` rows;
- what a replay measured (`summary`: throughput, latency percentiles, padding, recomputation,
  time shares, prefill and the prefix cache), and the check (`compare_replays`: each forced
  token's log-probability against the one-at-a-time reference's);
- the napkin math (`expected_replay`): decode steps, padding and prefill tokens, exact or a bound,
  and the decode step's bound from the device's ceilings.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit import hardware, planner
from labkit.config import ConfigError, RunConfig, knob, torch_dtype
from labkit.blocks.requests import Request, WorkloadSpec, load_workload
from labkit.blocks.serving import (BatchPolicy, Engine, IterationPolicy, Policy, Sequence, block_hashes,
                                   reusable_blocks)
from labkit.workload import Comparison

SCHEDULERS = ("sequential", "static", "dynamic", "continuous", "priority")
REFERENCE_SCHEDULER = "sequential"

WORKLOADS_DIR = hardware.DATA_DIR / "workloads"
# Largest difference of a token's log-probability from the reference's, same context: batching
# changes only the order of floating-point sums (about 1e-5 in fp32).
LOGPROB_TOLERANCE = {"float32": 1e-3}
LOGPROB_TOLERANCE_16BIT = 0.1
PERCENTILES = (50, 99)


def workload_names() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in WORKLOADS_DIR.glob("*.json")))


@dataclass(kw_only=True)
class ServingConfig(RunConfig):
    """A replay's knobs: the scheduler (`variant`), the workload, the KV budget, the paging
    schedulers' tricks and the timing (batching's `Config`; sla's extends it)."""

    variant: str = knob(REFERENCE_SCHEDULER, choices=SCHEDULERS, help="scheduler")
    workload: str = knob("default", help="a workload in data/workloads (its name) or a JSON file")
    num_requests: int = knob(0, min=0, help="serve the first N requests (0: all)")
    max_output_len: int = knob(0, min=0, help="clip every output length to this (0: as given)")
    arrival: str = knob("workload", choices=("workload", "closed"),
                        help="the workload's arrival times, or all queued at t = 0")
    kv_budget_tokens: int = knob(2048, min=1, help="KV positions the pool holds, all requests together")
    block_size: int = knob(16, min=1, help="continuous, priority: positions per KV block")
    bucket_width: int = knob(8, min=1, help="dynamic: prompt-length bucket width")
    batch_timeout_ms: float = knob(50.0, min=0.0, help="dynamic: start a partial bucket after this wait")
    prefix_cache: bool = knob(False, help="continuous, priority: reuse cached KV blocks of a shared "
                                          "prompt prefix (vLLM's automatic prefix caching)")
    prefill_chunk: int = knob(0, min=0, help="continuous, priority: prefill at most this many "
                                             "positions per iteration (0: whole prompts)")
    warmup: int = knob(0, min=0, help="untimed replays before timing (the check already warmed up)")
    min_run_time_s: float = knob(0.0, min=0.0, help="timing: least total time (a replay is long)")
    uses_seq_len = False  # lengths come from the workload; batch_size is the most rows per step


# --- the workload ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=8)
def _load(path: str) -> tuple[WorkloadSpec, tuple[Request, ...]]:
    spec, requests = load_workload(path)
    return spec, tuple(requests)


def _loaded(cfg: ServingConfig) -> tuple[WorkloadSpec, tuple[Request, ...]]:
    """The workload file `cfg` names (a shipped name or a path), read once per process."""
    path = Path(cfg.workload)
    if cfg.workload in workload_names():
        path = WORKLOADS_DIR / f"{cfg.workload}.json"
    elif not path.is_file():
        raise ConfigError(f"unknown workload {cfg.workload!r}; valid: {', '.join(workload_names())} "
                          "or the path of a workload file")
    return _load(str(path))


def workload_spec(cfg: ServingConfig) -> WorkloadSpec:
    """The spec the workload was drawn from (its seed redraws arrivals at another rate)."""
    return _loaded(cfg)[0]


def workload(cfg: ServingConfig) -> tuple[tuple[str, ...], list[Request]]:
    """The priority classes (most urgent first) and the requests as this config serves them."""
    spec, requests = _loaded(cfg)
    classes = tuple(name for name, _ in spec.priorities)
    requests = list(requests[:cfg.num_requests or None])
    if cfg.max_output_len:
        requests = [dataclasses.replace(r, output_len=min(r.output_len, cfg.max_output_len))
                    for r in requests]
    return classes, requests


def longest(requests: list[Request]) -> int:
    """The longest sequence a reserving scheduler must plan for: longest prompt + longest output
    (a request's output length is unknown until it ends)."""
    return max(r.prompt_len for r in requests) + max(r.output_len for r in requests)


def num_slots(cfg: ServingConfig, requests: list[Request]) -> int:
    """Rows per step: one for `sequential`; for reserving schedulers what the budget holds."""
    if cfg.variant == "sequential":
        return 1
    if cfg.variant in ("static", "dynamic"):
        return min(cfg.batch_size, cfg.kv_budget_tokens // longest(requests))
    return cfg.batch_size


def validate_replay(cfg: ServingConfig) -> None:
    _, requests = workload(cfg)
    need = longest(requests)
    if need > cfg.model.max_seq_len:
        raise ConfigError(f"the workload's longest sequence ({need} tokens) exceeds the model's "
                          f"context ({cfg.model.max_seq_len}); set max_output_len")
    if cfg.kv_budget_tokens < need:
        raise ConfigError(f"kv_budget_tokens={cfg.kv_budget_tokens} cannot hold one request "
                          f"(longest prompt + longest output = {need} tokens)")


# --- the engine and its policy for a scheduler -----------------------------------------------------

def policy(cfg: ServingConfig, classes: tuple[str, ...], slots: int) -> Policy:
    if cfg.variant in ("static", "dynamic"):
        dynamic = cfg.variant == "dynamic"
        return BatchPolicy(slots, cfg.bucket_width if dynamic else None, cfg.batch_timeout_ms / 1e3)
    ranks = {name: i for i, name in enumerate(classes)}
    return IterationPolicy(ranks if cfg.variant == "priority" else None)


def texts(cfg: ServingConfig, requests: list[Request]) -> list[torch.Tensor]:
    """Per request, seeded tokens: its prompt, then the continuation the check forces. A request
    with a shared prefix starts with that prefix's tokens (the same for every request naming it)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    out = [torch.randint(0, cfg.model.vocab_size, (r.prompt_len + r.output_len,), generator=gen)
           for r in requests]
    for r, t in zip(requests, out):
        if r.prefix_id >= 0:  # its own stream per prefix: the requests' tokens stay as they were
            prefix = torch.Generator().manual_seed(cfg.seed + 1000 + r.prefix_id)
            t[:r.prefix_len] = torch.randint(0, cfg.model.vocab_size, (r.prefix_len,), generator=prefix)
    return out


def pages(cfg: ServingConfig) -> bool:
    """Whether the variant takes the prefix cache and chunked prefill: the paging schedulers. The
    reference stays plain (the check's log-probabilities), reserving ones prefill padded batches."""
    return cfg.variant in ("continuous", "priority")


def make_engine(cfg: ServingConfig, model, requests: list[Request], tokens: list[torch.Tensor], *,
                forced: bool, closed: bool) -> Engine:
    slots = num_slots(cfg, requests)
    reserving = cfg.variant in ("static", "dynamic")
    block = longest(requests) if reserving else cfg.block_size
    seqs = [Sequence(req=r, prompt=t[:r.prompt_len].tolist(),
                     forced=t[r.prompt_len:].tolist() if forced else None)
            for r, t in zip(requests, tokens)]
    return Engine(model, seqs, num_slots=slots, num_blocks=cfg.kv_budget_tokens // block,
                  block_size=block, reserve=block if reserving else 0,
                  kv_dtype=torch_dtype(cfg.dtype), closed=closed,
                  prefix_cache=cfg.prefix_cache and pages(cfg),
                  prefill_chunk=cfg.prefill_chunk if pages(cfg) else 0)


# --- what a replay measured --------------------------------------------------------------------------

def quantile(values: list[float], q: float) -> float:
    return torch.tensor(values, dtype=torch.float64).quantile(q / 100).item()


def latency_rows(eng: Engine, classes: tuple[str, ...]) -> dict[str, float]:
    """ttft (arrival to first token) and tpot (the time per output token after the first), p50 and
    p99, over all requests and per class."""
    out = {}
    for name in ("all",) + classes:
        chosen = [s for s in eng.seqs if name in ("all", s.req.priority)]
        ttft = [s.first_token_s - eng.arrival(s) for s in chosen]
        tpot = [(s.finish_s - s.first_token_s) / (s.req.output_len - 1)
                for s in chosen if s.req.output_len > 1]
        suffix = "" if name == "all" else f"_{name}"
        for metric, values in (("ttft", ttft), ("tpot", tpot)):
            for p in PERCENTILES if values else ():
                out[f"{metric}_p{p}{suffix}_ms"] = 1e3 * quantile(values, p)
    return out


def summary(eng: Engine, cfg: ServingConfig, classes: tuple[str, ...]) -> dict[str, float]:
    seqs = eng.seqs
    makespan = max(s.finish_s for s in seqs)
    decode = [st for st in eng.steps if st.kind == "decode"]
    positions = sum(st.positions for st in eng.steps)
    out = {"useful_tokens_per_s": sum(s.req.output_len for s in seqs) / makespan,
           "requests_per_s": len(seqs) / makespan, "makespan_ms": 1e3 * makespan,
           **latency_rows(eng, classes),
           "padding_waste_pct": 100 * sum(st.padding for st in eng.steps) / positions,
           "recomputed_pct": 100 * sum(st.recomputed for st in eng.steps) / positions,
           "preemptions": sum(s.preemptions for s in seqs),
           "decode_steps": len(decode), "max_concurrent": max(st.live for st in decode),
           "slot_occupancy_pct": 100 * sum(st.live for st in decode) / (len(decode) * cfg.batch_size),
           **time_shares(eng, makespan), **prefill_rows(eng, cfg)}
    return out


def prefill_rows(eng: Engine, cfg: ServingConfig) -> dict[str, float]:
    """Positions prefill computed (padding included), the workload's shared-prefix fraction and,
    with the cache, the share of looked-up blocks reused."""
    out = {"prefill_tokens": sum(st.positions for st in eng.steps if st.kind == "prefill"),
           "shared_prefix_fraction": shared_prefix_fraction([s.prompt for s in eng.seqs],
                                                            cfg.block_size)}
    if eng.prefix_cache:
        out["prefix_hit_rate"] = eng.num_hit_blocks / max(eng.num_lookup_blocks, 1)
    return out


def time_shares(eng: Engine, makespan: float) -> dict[str, float]:
    """Where a replay's time went, from its step records: decode and prefill forward passes,
    waiting with nothing to run (arrivals, timeouts), and the rest, the engine's host work between
    passes (scheduling, block tables, slot indices); and the median decode pass."""
    passes = {kind: [st.end_s - st.start_s for st in eng.steps if st.kind == kind]
              for kind in ("decode", "prefill")}
    spent = {kind: sum(durations) for kind, durations in passes.items()}
    host = makespan - spent["decode"] - spent["prefill"] - eng.idle_s
    return {"decode_step_ms": 1e3 * quantile(passes["decode"], 50),
            "decode_time_pct": 100 * spent["decode"] / makespan,
            "prefill_time_pct": 100 * spent["prefill"] / makespan,
            "idle_time_pct": 100 * eng.idle_s / makespan, "host_time_pct": 100 * host / makespan}


def compare_replays(reference: dict, outputs: dict, cfg: ServingConfig) -> Comparison:
    """Every request served in full; each forced token's log-probability within the tolerance of
    the one-at-a-time reference's; greedy (top-1) agreement at the same contexts reported."""
    ids = reference["logprobs"]
    diff = max((outputs["logprobs"][i] - reference["logprobs"][i]).abs().max().item() for i in ids)
    same = sum((outputs["top1"][i] == reference["top1"][i]).sum().item() for i in ids)
    total = sum(len(reference["top1"][i]) for i in ids)
    metrics = {"logprob_max_abs_diff": diff, "token_agreement": same / total}
    tolerance = LOGPROB_TOLERANCE.get(cfg.dtype, LOGPROB_TOLERANCE_16BIT)
    if outputs["served"] != len(ids):
        return Comparison(metrics, False, f"{outputs['served']} of {len(ids)} requests served in full")
    ok = diff <= tolerance
    return Comparison(metrics, ok, "" if ok else f"log-probabilities off by {diff:.2e} "
                                                 f"(tolerance {tolerance:.0e})")


# --- napkin math -----------------------------------------------------------------------------------

def batches(cfg: ServingConfig, requests: list[Request]) -> list[list[Request]]:
    """Static's batches: consecutive groups of its slots, in arrival order (whatever the timing)."""
    slots = num_slots(cfg, requests)
    return [requests[i:i + slots] for i in range(0, len(requests), slots)]


def predicted_steps(cfg: ServingConfig, requests: list[Request]) -> tuple[int, int, int]:
    """(decode steps, positions computed, of which padding). Exact for sequential and static;
    for continuous and priority a lower bound (every step full, no padding or preemption)."""
    prompts, tokens = sum(r.prompt_len for r in requests), sum(r.output_len - 1 for r in requests)
    if cfg.variant == "static":
        steps = positions = 0
        for batch in batches(cfg, requests):
            longest_out = max(r.output_len for r in batch) - 1
            steps += longest_out
            positions += len(batch) * (max(r.prompt_len for r in batch) + longest_out)
        return steps, positions, positions - prompts - tokens
    rows = num_slots(cfg, requests)
    return math.ceil(tokens / rows), prompts + tokens, 0


def prefix_savings(prompts: list[list[int]], block_size: int) -> tuple[int, int]:
    """(full blocks reusable, full blocks looked up) over the prompts in arrival order: a request
    reuses its leading full blocks that an earlier prompt holds (`block_hashes`: the same tokens
    after the same prefix), at most `reusable_blocks` of them. From the tokens alone: exact for a
    replay without preemption or eviction."""
    held: set[int] = set()
    reused = looked_up = 0
    for prompt in prompts:
        hashes = block_hashes(prompt, block_size)
        limit = reusable_blocks(prompt, block_size)
        looked_up += limit
        reused += next((i for i, h in enumerate(hashes[:limit]) if h not in held), limit)
        held.update(hashes)
    return reused, looked_up


def shared_prefix_fraction(prompts: list[list[int]], block_size: int) -> float:
    """The share of all prompt tokens lying in full blocks of a prefix an earlier request holds."""
    return prefix_savings(prompts, block_size)[0] * block_size / sum(len(p) for p in prompts)


def prompts_of(cfg: ServingConfig, requests: list[Request]) -> list[list[int]]:
    return [t[:r.prompt_len].tolist() for r, t in zip(requests, texts(cfg, requests))]


def predicted_prefill(cfg: ServingConfig, requests: list[Request]) -> dict[str, float]:
    """prefill_tokens: static's padded batches exactly; one at a time, every prompt token less
    the blocks the cache can reuse (preemption's recomputation left out); dynamic: not predicted."""
    if cfg.variant == "dynamic":
        return {}
    if cfg.variant == "static":
        return {"prefill_tokens": sum(len(b) * max(r.prompt_len for r in b)
                                      for b in batches(cfg, requests))}
    total = sum(r.prompt_len for r in requests)
    if not (cfg.prefix_cache and pages(cfg)):
        return {"prefill_tokens": total}
    reused, looked_up = prefix_savings(prompts_of(cfg, requests), cfg.block_size)
    return {"prefill_tokens": total - reused * cfg.block_size,
            "prefix_hit_rate": reused / max(looked_up, 1)}


def expected_replay(cfg: ServingConfig) -> dict[str, float]:
    """The KV pool's bytes and the rows per step; but for `dynamic`, the decode steps and padding
    (`predicted_steps`), the prefill tokens (`predicted_prefill`) and, where the device's ceilings
    are known, the decode step's bound and the throughput it allows (`decode_bound_s`)."""
    _, requests = workload(cfg)
    block = longest(requests) if cfg.variant in ("static", "dynamic") else cfg.block_size
    per_token = planner.kv_bytes_per_token(cfg.model, cfg.dtype)
    out: dict[str, float] = {"kv_bytes": (cfg.kv_budget_tokens // block) * block * per_token,
                             "max_concurrent": num_slots(cfg, requests),
                             "token_agreement": 1.0, "logprob_max_abs_diff": 0.0,
                             **predicted_prefill(cfg, requests)}
    if cfg.variant == "dynamic":
        return out
    steps, positions, padding = predicted_steps(cfg, requests)
    out.update(decode_steps=steps, padding_waste_pct=100 * padding / positions)
    if cfg.variant in ("sequential", "static"):
        out["preemptions"] = 0
    step_s = decode_bound_s(cfg, requests)
    if step_s:
        last = 0.0 if cfg.arrival == "closed" else max(r.arrival_s for r in requests)
        out["decode_step_ms"] = 1e3 * step_s
        out["useful_tokens_per_s"] = sum(r.output_len for r in requests) / max(steps * step_s, last)
    return out


def decode_bound_s(cfg: ServingConfig, requests: list[Request]) -> float | None:
    """A full decode step at best: the slower of reading every weight once at the device's
    bandwidth and the rows' FLOPs at its peak (None where the device's ceilings are unknown)."""
    ceil = hardware.ceilings(cfg.device, num_threads=cfg.num_threads)
    peak = ceil.peak_tflops.get(cfg.dtype)
    if not (peak and ceil.bandwidth_gbps):
        return None
    flops = planner.forward_flops(cfg.model, batch=num_slots(cfg, requests), new=1, keys=0, logits=1)
    return max(flops / (peak * 1e12),
               planner.param_bytes(cfg.model, cfg.dtype) / (ceil.bandwidth_gbps * 1e9))
