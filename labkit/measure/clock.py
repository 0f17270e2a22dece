"""One clock for everything a technique times by hand (the harness's step timing is `timer.py`).

- `clock(device)`: seconds on the host's monotonic `perf_counter`, read after the device has
  finished what was queued (CUDA runs asynchronously: without the wait, a span would hold the
  kernels' launch, not their run). On the CPU it is `perf_counter` itself.
- `seconds`, `repeat_seconds`, `timed_calls`: wall seconds of calls of a function, each call
  between two `clock` readings (so the device is drained before and after every call).
- `lined_up`, `fixed_repeats_timer`: the same clock across ranks, after a barrier.
- `CudaSpan`: CUDA events around a block, the GPU's own time for the work queued inside it (not
  the host's); for copies and steps whose host side is not the point.

Every figure here is seconds (`elapsed_time` reports ms: converted).
"""
from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist


def clock(device: str) -> float:
    """Seconds, after the device has finished what was queued (CUDA runs asynchronously)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter()


def seconds(fn: Callable[[], object], device: str) -> float:
    """Wall seconds of one call of `fn`, the device drained before and after."""
    start = clock(device)
    fn()
    return clock(device) - start


def repeat_seconds(fn: Callable[[], object], *, device: str, repeats: int,
                   warmup: int = 1) -> tuple[float, ...]:
    """Seconds of each of `repeats` calls, after `warmup` untimed calls; the caller picks the
    statistic (the median against outliers, the minimum where noise only adds time)."""
    for _ in range(warmup):
        fn()
    return tuple(seconds(fn, device) for _ in range(repeats))


def timed_calls(fn: Callable[[], object], *, device: str, warmup: int, min_run_time_s: float,
                min_repeats: int, max_calls: int) -> tuple[float, ...]:
    """Seconds of each call after `warmup` untimed ones: at least `min_repeats` calls and at least
    `min_run_time_s` of timing, at most `max_calls`. Unlike `timer.time_step` it touches no
    thread setting (for an experiment whose knob under test is the thread count)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = clock(device)
    while len(times) < max_calls and (len(times) < min_repeats
                                      or clock(device) - start < min_run_time_s):
        times.append(seconds(fn, device))
    return tuple(times)


def lined_up(device: str) -> float:
    """The ranks meet at a barrier; the clock right after it."""
    dist.barrier()
    return clock(device)


def fixed_repeats_timer(step: Callable[[], object], *, warmup: int, repeats: int,
                        device: str) -> tuple[float, ...]:
    """Seconds per step, the same number of steps on every rank (an adaptive count would let the
    ranks' collectives fall out of step); ranks line up at a barrier before each timed step."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = lined_up(device)
        step()
        times.append(clock(device) - start)
    return tuple(times)


class CudaSpan:
    """CUDA events recorded on the current stream at entry and exit of the block. `seconds`
    waits for the end event and returns the GPU time between the two: the work queued inside,
    without the host's launch gaps before it."""

    def __enter__(self) -> "CudaSpan":
        self.start = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)
        self.start.record()
        return self

    def __exit__(self, *exc) -> None:
        self.end.record()

    @property
    def seconds(self) -> float:
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3  # elapsed_time: ms
