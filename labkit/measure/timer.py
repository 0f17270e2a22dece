"""Step timing: CUDA events after warm-up on GPUs, `torch.utils.benchmark` at a fixed thread count
on the CPU. Both report the median and the interquartile range over repeats."""
from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from labkit.measure.clock import seconds

MAX_REPEATS = 1000


@contextlib.contextmanager
def cpu_threads(num_threads: int) -> Iterator[None]:
    """torch's intra-op thread count for the block (two threads on two shared cores stall)."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass(frozen=True)
class Timing:
    """Seconds per call of one step: every repeat, and their median and IQR."""

    times_s: tuple[float, ...]
    warmup: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def iqr_s(self) -> float:
        if len(self.times_s) < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.times_s, n=4, method="inclusive")
        return q3 - q1

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3


def time_step(step: Callable[[], object], *, device: str = "cpu", warmup: int = 1,
              min_run_time_s: float = 0.5, min_repeats: int = 3, num_threads: int = 1) -> Timing:
    """Call `step` `warmup` times untimed, then time it for at least `min_run_time_s` seconds
    and at least `min_repeats` calls. `num_threads` applies to the CPU (restored afterwards)."""
    if device.startswith("cuda"):
        for _ in range(warmup):
            step()
        return Timing(_time_cuda(step, min_run_time_s, min_repeats), warmup)
    with cpu_threads(num_threads):
        for _ in range(warmup):
            step()
        # blocked_autorange sizes its blocks with an untimed call first; with no minimum time (the
        # tests' sizes) only the repeats run, one call each (Timer.timeit(1) would warm up with
        # two more calls every time)
        times = _autorange(step, min_run_time_s, num_threads) if min_run_time_s > 0 else []
        while len(times) < min_repeats:
            times.append(seconds(step, "cpu"))
    return Timing(tuple(times), warmup)


def _autorange(step: Callable[[], object], min_run_time_s: float, num_threads: int) -> list[float]:
    from torch.utils import benchmark  # imported here: it pulls in setuptools (0.14 s)

    timer = benchmark.Timer(stmt="step()", globals={"step": step}, num_threads=num_threads)
    return list(timer.blocked_autorange(min_run_time=min_run_time_s).times)


def _time_cuda(step: Callable[[], object], min_run_time_s: float, min_repeats: int) -> tuple[float, ...]:
    """CUDA events around each call; the number of calls comes from a first timed call."""
    first = _cuda_events(step, 1)
    repeats = max(min_repeats, math.ceil(min_run_time_s / max(first[0], 1e-6)))
    return _cuda_events(step, min(repeats, MAX_REPEATS))


def _cuda_events(step: Callable[[], object], repeats: int) -> tuple[float, ...]:
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    torch.cuda.synchronize()
    for start, end in zip(starts, ends):
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return tuple(s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends))  # ms -> s
