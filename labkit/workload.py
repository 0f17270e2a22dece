"""The experiment contract's types: what a technique hands the harness, and how it says no.

An experiment module offers `Config` (a `RunConfig` subclass whose `variant` chooses the line;
`labkit.blocks.distributed.DistConfig` for a multi-process one, which also sets `DISTRIBUTED = True` and
may set `CPU_RANKS`, its rank count without GPUs),
`VARIANTS`, `REFERENCE`, `build(cfg) -> Workload`, `compare(reference, outputs, cfg) ->
Comparison`, and `expected(cfg) -> {metric: predicted value}` (the napkin math); optionally
`validate(cfg)`, which raises `ConfigError` for settings the experiment cannot take, and
`skip_reason(cfg)`, why a variant cannot run on this device (the harness records it as `skipped`
before building anything; `build` may also raise `SkipVariant`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


class SkipVariant(Exception):
    """This variant cannot run here; the message is the reason (a `skipped` row)."""


@dataclass
class Workload:
    """One variant at one sweep point, built and ready to run.

    `check()` runs first (it doubles as warm-up) and returns the outputs compared with the
    reference's. `step()` is what is timed and whose peak memory is measured. `tensors` maps a
    `*_bytes` metric to the tensors whose storage it is measured from; `per_token` turns such a
    metric into `*_bytes_per_token` given the number of tokens those tensors hold; `per_second`
    turns an amount per step into a rate by the timed step (`busbw_gbps`: GB moved per step).
    `forward()`, when given, is one forward pass (with grad) in which the tensors saved for
    backward are measured, leaving out `resident` (the parameters). `report()`, called after
    timing, gives values only the technique knows (a loss scale, a measured bubble); `predicted()`
    adds predictions that depend on what `check()` found (a batch size). `timed` gives calls
    timed like the step, right after it (`fwd_ms`: a forward alone).

    In a multi-process experiment every one of these runs on every rank, in the same order, so
    each may use collectives (`report()` may gather what the timed steps recorded).
    """

    step: Callable[[], Any]
    check: Callable[[], dict[str, Any]]
    tokens_per_step: int = 0
    tensors: dict[str, Callable[[], Iterable[torch.Tensor]]] = field(default_factory=dict)
    per_token: dict[str, Callable[[], int]] = field(default_factory=dict)  # `x_bytes` -> tokens held
    per_second: dict[str, float] = field(default_factory=dict)  # `x_gbps` -> amount per step
    forward: Callable[[], Any] | None = None
    resident: Callable[[], Iterable[torch.Tensor]] = tuple
    report: Callable[[], dict[str, float]] = dict
    predicted: Callable[[], dict[str, float]] = dict  # predictions known only after check()
    notes: dict[str, str] = field(default_factory=dict)
    compute_dtype: str = "float32"  # the dtype the matmuls run in: picks the roofline's peak
    count_flops: bool = True
    min_repeats: int = 3  # timed calls at least; 1 for a step that is itself a long run (a replay)
    timed: dict[str, Callable[[], Any]] = field(default_factory=dict)  # `x_ms` -> another call, timed as step
    energy_tokens: int = 0  # tokens one step serves: measure its energy, `joules_per_token` (0: not)
    skipped: dict[str, str] = field(default_factory=dict)  # metric -> why it is not measured here
    # (a `skipped` row of its own; the variant's other rows stand)


@dataclass(frozen=True)
class Comparison:
    """A variant against the reference: quality metrics, whether it passes, and why not."""

    metrics: dict[str, float]
    ok: bool
    message: str = ""
