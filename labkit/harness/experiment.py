"""The harness: the only place where techniques and measurement meet.

For every sweep point: the reference runs first, then each variant is built, checked against the
reference, measured (peak memory, bytes at rest, bytes saved for backward, FLOPs) and only then
timed. Every outcome is a row: `ok`, `oom` (memory freed, the sweep goes on), `error` (a mismatch
or an exception) or `skipped` (with the reason). Rows are stored after every point.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable

from labkit import hardware
from labkit.blocks import distributed
from labkit.harness import budget, launch, ranks
from labkit.config import ConfigError, RunConfig, Sweep, expand_sweep, resolve, sweep_knobs
from labkit.measure import energy
from labkit.measure.clock import fixed_repeats_timer
from labkit.measure.flops import count_flops
from labkit.measure.memory import (ActivationMeter, MemoryMeter, free_device_memory,
                                   is_out_of_memory, storage_bytes)
from labkit.measure.roofline import roofline
from labkit.measure.timer import Timing, cpu_threads, time_step
from labkit.results import (RunRecord, RunResult, RunsDirError, expand_row, unit_of,  # noqa: F401
                            writable_runs_dir)  # RunResult: re-exported, its old home
from labkit.techniques import REGISTRY, Experiment, record
from labkit.workload import Comparison, SkipVariant, Workload

if TYPE_CHECKING:
    from labkit.measure.profiler import Profile


class Mismatch(Exception):
    """A variant disagrees with the reference beyond its tolerance."""

    def __init__(self, comparison: Comparison):
        super().__init__(comparison.message)
        self.comparison = comparison


def choose_variants(exp: Experiment, variants: list[str] | None) -> list[str]:
    """The reference first, then the requested variants (all by default), each once."""
    for v in variants or []:
        if v not in exp.variants:
            raise ConfigError(f"unknown variant {v!r}; valid: {', '.join(exp.variants)}")
    chosen = variants or list(exp.variants)
    return [exp.reference] + [v for v in dict.fromkeys(chosen) if v != exp.reference]


def plan_points(name: str, preset: str | None, overrides: dict[str, Any] | None,
                sweep: Sweep | None) -> list[tuple[dict[str, Any], RunConfig]]:
    """Resolve every sweep point before anything runs, so bad input fails before measuring."""
    exp = record(name)
    if "variant" in set(overrides or {}) | sweep_knobs(sweep):
        raise ConfigError(f"variants are chosen with --variant, not set; valid: {', '.join(exp.variants)}")
    points = []
    for point in expand_sweep(sweep or {}):
        cfg = checked(exp, resolve(exp.Config, preset, {**(overrides or {}), **point}, experiment=name))
        typed = {k: getattr(cfg, k) if hasattr(cfg, k) else getattr(cfg.model, k) for k in point}
        points.append((typed, cfg))
    return points


def sized_points(name: str, preset: str | None, overrides: dict[str, Any],
                 sweep: Sweep | None, chosen: list[str],
                 budget_s: float | None) -> list[tuple[dict[str, Any], RunConfig]]:
    """`plan_points`, at the size `budget.fit_run` chooses for `budget_s` seconds (when given)."""
    # under torchrun every rank plans for itself: a size chosen from each rank's own clock could
    # differ between ranks, so those runs take the defaults
    sized = budget_s and not ranks.under_torchrun()
    fit = budget.fit_run(name, preset, overrides, chosen, budget_s, sweep) if sized else None
    if fit is None or not fit.note:
        return plan_points(name, preset, overrides, sweep)
    points = plan_points(name, preset, {**fit.settings, **overrides}, sweep)
    return [(point, dataclasses.replace(cfg, sizing=fit.note)) for point, cfg in points]


def run_experiment(name: str, *, preset: str | None = None, overrides: dict[str, Any] | None = None,
                   sweep: Sweep | None = None, variants: list[str] | None = None,
                   runs_dir: str | None = None, progress: bool = True, budget_s: float | None = None,
                   on_rows: Callable[[list[dict[str, Any]]], None] | None = None) -> RunResult:
    """Run one experiment over its sweep and variants; store and return every row. A
    multi-process experiment starts its ranks (or, under torchrun, is one of them). `budget_s`:
    size the defaults down to this many predicted seconds on this CPU (`labkit.harness.budget`;
    settings given in `overrides` or `sweep` are kept), the reason in every row's `sizing`."""
    exp = record(name)
    chosen = choose_variants(exp, variants)
    points = sized_points(name, preset, dict(overrides or {}), sweep, chosen, budget_s)
    try:
        writable_runs_dir(runs_dir)  # refused now, not after the first point has been measured
    except RunsDirError as e:
        raise ConfigError(str(e)) from None
    if exp.distributed:
        return launch.run(name, chosen, points, run_points, runs_dir=runs_dir, on_rows=on_rows)
    store = RunRecord(name, hardware.fingerprint(), points[0][1].params(), runs_dir)
    bar = _progress(len(points) * len(chosen), name, progress)
    status = "interrupted"
    try:
        run_points(exp, chosen, points, store, on_rows=on_rows, bar=bar)
        status = "complete"
    finally:
        store.finish(status)
        bar.close()
    return RunResult(store.run_id, str(store.path), store.full_rows())


def profile_experiment(name: str, *, preset: str | None = None, overrides: dict[str, Any] | None = None,
                       variant: str | None = None, trace_path: str | None = None) -> Profile:
    """One timed step of one variant of any single-process experiment under torch.profiler, after
    its check (which warms it up): the operator table, findings and (with `trace_path`) a Chrome
    trace. For a multi-process experiment profile the ranks with `nsys` (see `profiler`)."""
    from labkit.measure import profiler  # torch.profiler and its tables: only when profiling

    exp = record(name)
    chosen = variant or exp.reference
    if chosen not in exp.variants:
        raise ConfigError(f"unknown variant {chosen!r} of {name}; valid: {', '.join(exp.variants)}")
    if exp.distributed:
        raise ConfigError(f"{name} runs several processes; profile its ranks with nsys "
                          f"({profiler.nsys_command(name, variant=None, capture_range=False)})")
    (_, cfg), = plan_points(name, preset, overrides, None)
    cfg = dataclasses.replace(cfg, variant=chosen)
    reason = exp.why_skipped(cfg)
    if reason:
        raise ConfigError(f"{name} {chosen} cannot run here: {reason}")
    with cpu_threads(cfg.num_threads):
        wl = exp.build(cfg)
        wl.check()
        prof, _ = profiler.profile_step(wl.step, cfg.device, trace_path=trace_path)
    return prof


def run_points(exp: Experiment, chosen: list[str], points: list[tuple[dict[str, Any], RunConfig]],
               store: RunRecord, *, on_rows: Callable[[list[dict[str, Any]]], None] | None = None,
               bar: Any = None, before_variant: Callable[[int, RunConfig], None] | None = None) -> None:
    """Every variant at every point, the reference first at each; rows stored as they come.
    Where a point differs from the one before only in knobs the reference does not read
    (`Experiment.reference_ignores`), the reference's rows measured there stand for this point too,
    and its outputs check this point's variants (`_reused`)."""
    bar = bar or _NoBar()
    last = None  # the reference's last measurement: (the settings it reads, its rows, its outputs)
    for point, cfg in points:
        reference = None
        for index, variant in enumerate(chosen):
            bar.set_postfix_str(f"{variant} {point}" if point else variant)
            cfg_v = dataclasses.replace(cfg, variant=variant)
            reads = reference_reads(exp, cfg_v) if variant == exp.reference else None
            if reads is not None and last is not None and last[0] == reads:
                rows, outputs = _reused(exp, cfg_v, point, last[1]), last[2]
                store.add(rows)
            else:
                if before_variant:
                    before_variant(index, cfg_v)
                rows, outputs = measure_stored(exp, cfg_v, reference, point, store)
                if reads is not None:  # a reference that did not run is measured again
                    last = None if outputs is None else (reads, rows, outputs)
            reference = outputs if variant == exp.reference else reference
            if on_rows:
                on_rows([expand_row(r, store.record) for r in rows])
            bar.update(1)


def reference_reads(exp: Experiment, cfg: RunConfig) -> dict[str, Any] | None:
    """The settings the reference reads at `cfg`: all but the knobs it ignores there (None where
    the experiment does not say which those are)."""
    if exp.reference_ignores is None:
        return None
    ignored = set(exp.reference_ignores(cfg))
    return {k: v for k, v in cfg.params().items() if k not in ignored}


def _reused(exp: Experiment, cfg: RunConfig, point: dict[str, Any],
            rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reference's `rows` measured at another point, as this point's (its settings), each
    saying where they were measured and which knobs, all unread by the reference, differ."""
    params, before = _row_maker(cfg, point)(None, None)["params"], rows[0]["params"]
    differ = [k for k in exp.reference_ignores(cfg) if params[k] != before[k]]
    where = ", ".join(f"{k}={v}" for k, v in before["sweep"].items()) or "the base settings"
    note = (f"measured once, at {where}: {exp.reference} does not read {', '.join(differ)}, "
            "where this point differs.")
    return [{**r, "params": params, "message": " ".join(filter(None, [r["message"], note]))} for r in rows]


def lab_plan(device: str = "auto", preset: str | None = None) -> list[dict[str, Any]]:
    """What the lab will do on `device`: each experiment's variants, the preset, and which will be
    skipped and why (without running anything)."""
    plan = []
    for name in REGISTRY:
        exp = record(name)
        cfg = resolve(exp.Config, preset, {"device": device}, experiment=name)
        refused = _refusal(exp, cfg)
        for variant in exp.variants:
            reason = refused or exp.why_skipped(dataclasses.replace(cfg, variant=variant))
            plan.append({"experiment": name, "variant": variant, "preset": cfg.preset,
                         "device": cfg.device, "runs": reason is None, "reason": reason or ""})
    return plan


def checked(exp: Experiment, cfg: RunConfig) -> RunConfig:
    """`cfg` with a multi-process experiment's world size filled in (validate() may read it),
    validated by the experiment: a ConfigError otherwise."""
    if exp.distributed:
        cfg = ranks.resolve_world(cfg, exp.cpu_ranks)
    exp.check(cfg)
    return cfg


def _refusal(exp: Experiment, cfg: RunConfig) -> str | None:
    """Why the whole experiment cannot run here with its defaults (too few GPUs for its ranks)."""
    try:
        checked(exp, cfg)
    except ConfigError as e:
        return str(e)
    return None


def measure_stored(exp: Experiment, cfg: RunConfig, reference, point: dict, store) -> tuple[list, Any]:
    """`measure_variant`, its rows stored at once; a rank that stops the run stores its failing
    variant's rows first."""
    try:
        rows, outputs = measure_variant(exp, cfg, reference, point)
    except ranks.RankAbort as e:
        store.add(e.rows)
        raise
    store.add(rows)
    return rows, outputs


def measure_variant(exp: Experiment, cfg: RunConfig, reference: dict[str, Any] | None,
                    point: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Rows for one variant at one point, and its check outputs (None unless it ran)."""
    row = _row_maker(cfg, point)
    outputs, rows = None, []
    try:
        with cpu_threads(cfg.num_threads):  # the whole point: build, check, memory, timing
            outputs, rows = _measure(exp, cfg, reference, row)
    except SkipVariant as e:
        rows = [row(None, None, status="skipped", message=str(e))]
    except Mismatch as e:
        rows = [row(m, v, status="error", message=f"does not match {exp.reference}: {e}")
                for m, v in e.comparison.metrics.items()]
    except Exception as e:  # any other failure is a result too; the sweep goes on
        rows = [_failure_row(e, row)]
        if rows[0]["status"] == "error" and distributed.world_size() > 1:
            raise ranks.RankAbort(rows[0]["message"], rows) from e  # collectives out of step
    # Only here, with the exception and its traceback gone, can the variant's tensors be freed.
    free_device_memory(cfg.device)
    return rows, outputs


def _failure_row(e: Exception, row: Callable[..., dict[str, Any]]) -> dict[str, Any]:
    """`oom` for an allocation failure (CUDA's, the virtual budget's or the CPU allocator's,
    which raises a plain RuntimeError), else `error`; the message's first line."""
    if is_out_of_memory(e):
        return row(None, None, status="oom", message=(str(e).splitlines() or [""])[0])
    return row(None, None, status="error", message=f"{type(e).__name__}: {e}".splitlines()[0])


def _measure(exp: Experiment, cfg: RunConfig, reference: dict[str, Any] | None,
             row: Callable[..., dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    reason = exp.why_skipped(cfg)
    if reason:
        raise SkipVariant(reason)
    budget = int(cfg.memory_budget_gib * 2**30) if cfg.memory_budget_gib else None
    with MemoryMeter(cfg.device, budget) as meter:
        wl = exp.build(cfg)
        outputs = wl.check()
        comparison = _compare(exp, cfg, reference, outputs)
        if distributed.world_size() > 1:
            ok, message = distributed.agree(comparison.ok, comparison.message)
            comparison = dataclasses.replace(comparison, ok=ok, message=message)
        if not comparison.ok:
            raise Mismatch(comparison)
        meter.reset_peak()
        wl.step()
        measured = {"peak_mem_bytes": meter.peak_bytes, "reserved_bytes": meter.reserved_bytes,
                    "nvml_used_bytes": meter.nvml_used_bytes}
        measured.update({m: storage_bytes(fn()) for m, fn in wl.tensors.items()})
        measured.update({f"{m}_per_token": measured[m] / fn() for m, fn in wl.per_token.items()})
        saved = _activations(wl)
    timing, energy_rows = _time_with_energy(wl, cfg, row)
    measured.update(step_ms=timing.median_ms, step_iqr_ms=timing.iqr_s * 1e3)
    measured.update({m: _time(fn, wl, cfg).median_ms for m, fn in wl.timed.items()})
    if wl.tokens_per_step:
        measured["tokens_per_s"] = wl.tokens_per_step / timing.median_s
    measured.update({m: amount / timing.median_s for m, amount in wl.per_second.items()})
    measured.update(_flop_rows(wl, cfg, timing.median_s))
    measured.update(comparison.metrics)
    measured.update(wl.report())
    notes = {**wl.notes, "step_ms": " ".join(filter(None, (comparison.message, wl.notes.get("step_ms"),
                                                             cfg.sizing and f"({cfg.sizing})")))}
    predicted = {**exp.expected(cfg), **wl.predicted()}
    skipped = [row(m, None, status="skipped", message=why) for m, why in wl.skipped.items()]
    return outputs, _rows(measured, saved, predicted, notes, row) + energy_rows + skipped


def _time_with_energy(wl: Workload, cfg: RunConfig,
                      row: Callable[..., dict[str, Any]]) -> tuple[Timing, list[dict[str, Any]]]:
    """The step's timing and, when it serves `energy_tokens`, the energy rows of exactly the calls
    the timer made (its warm-up and calibration calls too: every call inside the window counts).
    A counter that cannot be read gives a `skipped` row saying why; the timing is kept."""
    if not wl.energy_tokens:
        return _time(wl.step, wl, cfg), []
    try:
        window = energy.EnergyWindow(energy.make_meter(cfg.device), cfg.device)
    except energy.EnergyUnavailable as e:
        return _time(wl.step, wl, cfg), [row("joules_per_token", None, status="skipped", message=str(e))]
    counted = energy.CountedCalls(wl.step)
    timing = _time(counted, wl, cfg)
    try:
        span = window.stop(counted.num_calls)
    except energy.EnergyUnavailable as e:
        return timing, [row("joules_per_token", None, status="skipped", message=str(e))]
    return timing, _energy_rows(span, wl.energy_tokens, cfg.device, row)


def _energy_rows(span: energy.EnergySpan, tokens_per_call: int, device: str,
                 row: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    """joules_per_token (predicted: the TDP upper bound, where the GPU's is known), idle_watts and
    joules_per_token_above_idle, each in its unit."""
    bound = energy.tdp_bound(device, span, tokens_per_call)
    note = span.describe(tokens_per_call)
    if bound is not None:
        note += " Predicted: an upper bound, the datasheet TDP for the whole window per token."
    rows = []
    for metric, value in span.per_token(tokens_per_call).items():
        first = metric == "joules_per_token"
        rows.append({**row(metric, value, predicted=bound if first else None,
                           message=note if first else ""), "unit": energy.UNITS[metric]})
    return rows


def _time(step: Callable[[], Any], wl: Workload, cfg: RunConfig) -> Timing:
    if distributed.world_size() > 1:
        times = fixed_repeats_timer(step, warmup=cfg.warmup, repeats=cfg.timed_steps, device=cfg.device)
        return Timing(times, cfg.warmup)
    return time_step(step, device=cfg.device, warmup=cfg.warmup,
                     min_repeats=cfg.min_repeats or wl.min_repeats, min_run_time_s=cfg.min_run_time_s,
                     num_threads=cfg.num_threads)


def _compare(exp: Experiment, cfg: RunConfig, reference: dict[str, Any] | None,
             outputs: dict[str, Any]) -> Comparison:
    """The variant against the reference's outputs; the reference against itself (its quality
    rows: a zero delta). When the reference did not run here, say so instead of checking."""
    if cfg.variant == exp.reference:
        return exp.compare(outputs, outputs, cfg)
    if reference is None:
        return Comparison({}, True, f"NOT CHECKED: the reference ({exp.reference}) did not run "
                                    "at this point.")
    return exp.compare(reference, outputs, cfg)


def _activations(wl: Workload) -> ActivationMeter | None:
    return None if wl.forward is None else ActivationMeter(wl.resident()).measure(wl.forward)


def _flop_rows(wl: Workload, cfg: RunConfig, seconds: float) -> dict[str, float]:
    if not wl.count_flops:
        return {}
    flops = count_flops(wl.step)
    peak = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads)
    point = roofline(flops, seconds, peak_tflops=peak.get(wl.compute_dtype))
    out = {"flops": float(flops), "tflops": point.tflops}
    if point.pct_peak_flops is not None:
        out["peak_flops_pct"] = point.pct_peak_flops
    return out


def _rows(measured: dict[str, Any], saved: ActivationMeter | None, predicted: dict[str, float],
          notes: dict[str, str], row: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
    if saved is not None:
        measured["activation_bytes"] = saved.total_bytes
        measured["saved_weight_copy_bytes"] = saved.weight_copy_bytes
        measured.update({f"activation_{d}_bytes": b for d, b in sorted(saved.by_dtype.items())})
        top = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in saved.largest)
        note = notes.get("activation_bytes", "")
        notes = {**notes, "activation_bytes": f"{note} Largest saved: {top}.".strip()}
    return [row(metric, value, predicted=predicted.get(metric), message=notes.get(metric, ""))
            for metric, value in measured.items() if value is not None]


def _row_maker(cfg: RunConfig, point: dict[str, Any]) -> Callable[..., dict[str, Any]]:
    params = {**cfg.params(), "sweep": point}

    def row(metric: str | None, value: Any, *, predicted: float | None = None,
            status: str = "ok", message: str = "") -> dict[str, Any]:
        value = None if value is None else float(value)
        if value is not None and not math.isfinite(value):  # JSON has no nan/inf: say it in words
            value, message = None, f"measured {value}. {message}".strip()
        return {"variant": cfg.variant, "params": params, "metric": metric, "value": value,
                "unit": unit_of(metric) if metric else "", "predicted": predicted,
                "status": status, "message": message, "rank": distributed.rank()}

    return row


class _NoBar:
    def set_postfix_str(self, _: str) -> None: ...
    def update(self, _: int) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, name: str, enabled: bool):
    """A tqdm.auto bar on long sweeps when tqdm is installed (the core does not need it)."""
    if not enabled or total < 2:
        return _NoBar()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=name, leave=False)
