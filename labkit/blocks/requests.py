"""Serving workloads: requests with arrival times, prompt and output lengths, and priority classes.

The batching experiment replays one of these against the real model, so every scheduler sees the
same requests. A workload is seeded and fully described by its `WorkloadSpec`:

- arrivals: `poisson` (exponential gaps at `rate_per_s`), `bursty` (bursts of `burst_size`
  requests at once, the bursts a Poisson process with the same mean rate), or `closed` (all at
  t = 0: a backlog, the usual offline benchmark);
- prompt and output lengths uniform on their [low, high] ranges (the default output range,
  [8, 256], makes static batching wait on its longest request);
- a priority class per request, drawn with the given shares;
- optionally a shared system prompt (`num_prefixes` of them, `shared_prefix_len` tokens each):
  every request starts with one of them, drawn uniformly (its `prefix_id`), then its own
  `prompt_len` tokens, as chat requests share a system prompt;
- optionally long prompts: a share `long_prompt_share` of the requests takes its prompt length from
  `long_prompt_len` instead (documents among chat turns: what chunked prefill is for).

Each file in `data/workloads/` is `make_requests(SHIPPED[name])` written by `save_workload`:

- `default`: 64 requests at 20 per second, outputs of 8 to 256 tokens (minutes of replays on one
  CPU thread; the GPU presets' workload).
- `short`: the tiny preset's: 32 requests, outputs of 4 to 80 tokens, arriving at 320 per second,
  faster than one CPU thread serves them (a backlog that builds and drains), so throughput measures
  the scheduler rather than the arrival rate, on any CPU.
- `shared_prefix`: `short`'s arrivals, each prompt one of 3 system prompts of 64 tokens (4 KV
  blocks of 16) followed by 8 to 32 tokens of its own, outputs of 4 to 32: most prompt tokens are
  a prefix an earlier request already computed (the prefix cache's workload).
- `long_prompts`: `short`'s arrivals, each prompt with probability 1/4 192 to 320 tokens long
  (5 of the 32), the others 8 to 32 tokens, outputs of 4 to 32: a long prefill stalls every
  running sequence's next token unless it is chunked.
"""
from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path

from labkit.config import ConfigError, check_choice

ARRIVALS = ("poisson", "bursty", "closed")


@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    priority: str
    prefix_id: int = -1  # which shared system prompt the prompt starts with (-1: none)
    prefix_len: int = 0  # its length in tokens (part of prompt_len)


@dataclass(frozen=True, kw_only=True)
class WorkloadSpec:
    num_requests: int = 64
    arrival: str = "poisson"
    rate_per_s: float = 20.0  # mean arrivals per second (poisson and bursty)
    burst_size: int = 8
    prompt_len: tuple[int, int] = (8, 32)  # uniform, inclusive
    output_len: tuple[int, int] = (8, 256)
    priorities: tuple[tuple[str, float], ...] = (("high", 0.25), ("low", 0.75))
    seed: int = 0
    num_prefixes: int = 0  # shared system prompts (0: none)
    shared_prefix_len: int = 0  # tokens of each, before the request's own prompt_len tokens
    long_prompt_share: float = 0.0  # share of requests whose prompt length is long_prompt_len's
    long_prompt_len: tuple[int, int] = (1, 1)  # uniform, inclusive

    def check(self) -> "WorkloadSpec":
        check_choice("arrival", self.arrival, ARRIVALS)
        for name in ("prompt_len", "output_len", "long_prompt_len"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ConfigError(f"{name}=({low}, {high}) must satisfy 1 <= low <= high")
        if self.num_requests < 1 or self.rate_per_s <= 0 or self.burst_size < 1:
            raise ConfigError("num_requests, rate_per_s and burst_size must be positive")
        if not self.priorities or any(share <= 0 for _, share in self.priorities):
            raise ConfigError("priorities need at least one class, each with a positive share")
        if self.num_prefixes < 0 or (self.num_prefixes > 0) != (self.shared_prefix_len > 0):
            raise ConfigError("num_prefixes and shared_prefix_len must both be 0 or both positive")
        if not 0.0 <= self.long_prompt_share <= 1.0:
            raise ConfigError(f"long_prompt_share={self.long_prompt_share} must lie in [0, 1]")
        return self


SHIPPED: dict[str, WorkloadSpec] = {
    "default": WorkloadSpec(),
    "short": WorkloadSpec(num_requests=32, rate_per_s=320.0, output_len=(4, 80)),
    "shared_prefix": WorkloadSpec(num_requests=32, rate_per_s=320.0, output_len=(4, 32),
                                  num_prefixes=3, shared_prefix_len=64),
    "long_prompts": WorkloadSpec(num_requests=32, rate_per_s=320.0, output_len=(4, 32),
                                 long_prompt_share=0.25, long_prompt_len=(192, 320)),
}


def arrival_times(spec: WorkloadSpec, rng: random.Random) -> list[float]:
    """Seconds from the start, non-decreasing, one per request."""
    if spec.arrival == "closed":
        return [0.0] * spec.num_requests
    group = spec.burst_size if spec.arrival == "bursty" else 1
    times, t = [], 0.0
    while len(times) < spec.num_requests:
        t += rng.expovariate(spec.rate_per_s / group)  # a burst every group / rate seconds on average
        times.extend([t] * min(group, spec.num_requests - len(times)))
    return times


def make_requests(spec: WorkloadSpec) -> list[Request]:
    """The seeded requests of `spec`, in arrival order."""
    spec.check()
    rng = random.Random(spec.seed)
    return [make_request(spec, rng, i, t) for i, t in enumerate(arrival_times(spec, rng))]


def make_request(spec: WorkloadSpec, rng: random.Random, i: int, t: float) -> Request:
    """Request i arriving at t. The draws a spec without prefixes or long prompts skips are made
    last, so the files written before those fields existed are still what their specs generate."""
    names = [name for name, _ in spec.priorities]
    shares = [share for _, share in spec.priorities]
    prompt_len, output_len = rng.randint(*spec.prompt_len), rng.randint(*spec.output_len)
    priority = rng.choices(names, weights=shares)[0]
    if spec.long_prompt_share and rng.random() < spec.long_prompt_share:
        prompt_len = rng.randint(*spec.long_prompt_len)
    prefix_id = rng.randrange(spec.num_prefixes) if spec.num_prefixes else -1
    prefix_len = spec.shared_prefix_len if spec.num_prefixes else 0
    return Request(id=i, arrival_s=t, prompt_len=prefix_len + prompt_len, output_len=output_len,
                   priority=priority, prefix_id=prefix_id, prefix_len=prefix_len)


def save_workload(spec: WorkloadSpec, path: str | Path) -> list[Request]:
    """Write the spec and its requests as JSON (readable, diffable); returns the requests."""
    requests = make_requests(spec)
    record = {"spec": dataclasses.asdict(spec), "requests": [dataclasses.asdict(r) for r in requests]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
    return requests


def load_workload(path: str | Path) -> tuple[WorkloadSpec, list[Request]]:
    """A saved workload; its requests must be what its spec generates (a hand-edited file is
    refused, so a workload's name always means the same requests)."""
    record = json.loads(Path(path).read_text())
    spec = record["spec"]
    pairs = {name: tuple(spec[name]) for name in ("prompt_len", "output_len", "long_prompt_len")
             if name in spec}  # JSON lists back to tuples; older files lack the newer fields
    spec = WorkloadSpec(**{**spec, **pairs, "priorities": tuple(map(tuple, spec["priorities"]))})
    requests = [Request(**r) for r in record["requests"]]
    if requests != make_requests(spec):
        raise ConfigError(f"{path}: its requests are not those its spec generates; regenerate it "
                          "with labkit.blocks.requests.save_workload")
    return spec, requests
