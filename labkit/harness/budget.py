"""Sizes from a seconds target: what a run will take on this CPU, predicted before it starts, and
the largest size whose prediction fits the target.

Each experiment's `labkit run NAME` is measured once on the reference CPU, at its defaults and at
each of its cheaper sizes (its module's `CPU_RUNGS`), into `data/costs.json`
(`python -m labkit.harness.budget` writes it, in reference seconds: the wall time over the pace
of the CPU it ran on). On any CPU a run is then predicted from that CPU's pace
(`labkit.measure.pace`): the reference seconds times its `slowdown`, plus what its 16-bit matmuls
cost beyond that where it has no native bf16 or fp16 (their FLOPs, from the experiment's
`expected()`, over the rate measured for that dtype). The defaults are never enlarged: a fast
CPU runs them as they are.

Sizing applies to a CPU run at the tiny preset whose sized settings the user did not set (a
setting given by hand is never overridden), and only where a caller asks for it with a target
(`labkit run`'s `--budget-s`, the report's plan): the library's `run_experiment` without one
runs exactly what it is given.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any

from labkit import hardware, planner
from labkit.config import Sweep, resolve, resolve_device, sweep_knobs
from labkit.measure.pace import REFERENCE, Pace, measure_now, measure_pace
from labkit.techniques import Experiment, record

COSTS_PATH = hardware.REPO_DIR / "data" / "costs.json"
RUN_TARGET_S = 40.0  # `labkit run NAME` with defaults: the goal is 60 s on any 2-core CPU; the
# prediction's error (other work on the cores, a noisy clock) is the margin
PANEL_TARGET_S = 15.0  # a panel's whole default run on a CPU: its first point (the reference's
# rows) within about 5 s
CALLS = 8  # step calls per variant whose matmuls count: check, memory, activations, FLOP count,
# warm-up and at least three timed calls
DTYPE_OF_VARIANT = {"fp16": "float16", "bf16": "bfloat16", "bf16_weights": "bfloat16",
                    "bf16_ckpt": "bfloat16"}  # variants whose matmuls run in a 16-bit dtype


@dataclass(frozen=True)
class Fit:
    """The settings a run gets over its defaults (empty: the defaults), its predicted seconds on
    this CPU, and the note that says why it was sized down ("" when it was not)."""

    settings: dict[str, Any]
    predicted_s: float
    note: str = ""


@functools.lru_cache(maxsize=1)
def costs() -> dict[str, Any]:
    """`data/costs.json`: the reference CPU's measured seconds (see the module docstring)."""
    return json.loads(COSTS_PATH.read_text())


def ladder(exp: Experiment) -> tuple[dict[str, Any], ...]:
    """The sizes a CPU run steps down: the defaults ({}), then each of the experiment's rungs."""
    return ({}, *exp.cpu_rungs)


def matmul_dtype(exp: Experiment, cfg) -> str | None:
    """The 16-bit dtype `cfg.variant`'s matmuls run in (its name's, or a recipe's `precision`
    for a variant other than the reference), or None for fp32."""
    named = DTYPE_OF_VARIANT.get(cfg.variant)
    if named or cfg.variant == exp.reference:
        return named
    return DTYPE_OF_VARIANT.get(getattr(cfg, "precision", ""))


def low_precision_s(exp: Experiment, cfg, variants: list[str], pace: Pace) -> float:
    """Seconds the 16-bit matmuls of `variants` take here beyond what the slowdown already
    scales: on a CPU without native bf16 this is most of a mixed-precision run. Their FLOPs are
    the experiment's `expected()` step's, else a training step's (`planner.train_step_flops`)."""
    extra = 0.0
    for variant in variants:
        cfg_v = dataclasses.replace(cfg, variant=variant)
        dtype = matmul_dtype(exp, cfg_v)
        if dtype is None or exp.why_skipped(cfg_v):
            continue
        step = exp.expected(cfg_v).get("flops") or planner.train_step_flops(
            cfg.model, batch=cfg.batch_size, seq_len=cfg.seq_len)
        flops = CALLS * step
        extra += max(0.0, flops / pace.rate(dtype) - pace.slowdown * flops / REFERENCE.rate(dtype))
    return extra


def predict_s(exp: Experiment, cfg, variants: list[str], reference_s: float, pace: Pace) -> float:
    """Seconds on this CPU of a run that took `reference_s` on the reference CPU."""
    return pace.slowdown * reference_s + low_precision_s(exp, cfg, variants, pace)


def sizable(exp: Experiment, preset: str | None, overrides: dict[str, Any],
            sweep: Sweep | None) -> bool:
    """Whether a run may be sized: measured, on the CPU, at the tiny preset with its own model
    shape, and none of its rungs' settings given by hand."""
    given = set(overrides) | sweep_knobs(sweep)
    keys = {k for rung in exp.cpu_rungs for k in rung}
    measured = costs()["experiments"].get(exp.name, [])
    return (len(measured) == len(ladder(exp)) > 1 and not (keys & given)
            and preset in (None, "tiny") and "model" not in overrides
            and resolve_device(str(overrides.get("device", "auto"))) == "cpu")


def fit_run(name: str, preset: str | None, overrides: dict[str, Any], variants: list[str],
            target_s: float, sweep: Sweep | None = None, pace: Pace | None = None) -> Fit:
    """The largest size of `labkit run NAME` (the defaults, then each rung) predicted to take at
    most `target_s` on this CPU; the smallest when none does, said so."""
    exp = record(name)
    if not sizable(exp, preset, overrides, sweep):
        return Fit({}, math.nan)
    pace = pace or measure_pace()
    predicted = []
    for rung, reference_s in zip(ladder(exp), costs()["experiments"][name]):
        cfg = resolve(exp.Config, preset, {**overrides, **rung, "device": "cpu"}, experiment=name)
        predicted.append(predict_s(exp, cfg, variants, reference_s, pace))
        if predicted[-1] <= target_s:
            break
    if not rung:
        return Fit({}, predicted[0])
    over = "" if predicted[-1] <= target_s else ", still over it at the smallest size"
    shown = ", ".join(f"{k}={v}" for k, v in rung.items())
    note = (f"sized down to {shown} for this CPU: the defaults would take about {predicted[0]:.0f} s "
            f"here against a target of {target_s:.0f} s; this size about {predicted[-1]:.0f} s{over} "
            f"(pace: {pace.describe()})")
    return Fit(dict(rung), predicted[-1], note)


# --- measuring the costs on the reference CPU ---------------------------------------------------

def _wall_s(argv: list[str]) -> tuple[float, list[dict[str, Any]]]:
    """Wall seconds of `python ARGV` and the JSON rows it printed."""
    import subprocess
    import sys
    import time

    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return wall, [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def measure_costs(names: list[str], runs_dir: str) -> dict[str, list[float]]:
    """Each experiment's `labkit run NAME`, timed as a user would (process start included) at
    its defaults and at each rung, in reference seconds: the wall time over this CPU's slowdown.
    A rung whose run fails (its reference or a variant's check) is an error: every size must
    still check against its reference."""
    from labkit.techniques import REGISTRY

    seconds = {}
    for name in names or list(REGISTRY):
        seconds[name] = []
        pace = measure_now()  # anew for each: other work on the cores slows both alike
        for rung in ladder(record(name)):
            sets = [a for k, v in rung.items() for a in ("--set", f"{k}={v}")]
            argv = ["-m", "labkit", "run", name, "--device", "cpu", "--budget-s", "0", "--json",
                    "--runs-dir", runs_dir, *sets]
            wall, rows = _wall_s(argv)
            bad = [r for r in rows if r["status"] == "error"]
            if bad:
                raise RuntimeError(f"{name} at {rung or 'its defaults'}: {bad[0]['variant']} "
                                   f"{bad[0]['metric']}: {bad[0]['message']}")
            seconds[name].append(round(wall / pace.measured_slowdown, 2))
        print(f"{name}: {seconds[name]} reference s", flush=True)
    return seconds


def startup_s() -> float:
    """Reference seconds of a `labkit run` process that runs nothing: Python, torch, labkit and
    the pace's own measurement."""
    wall, _ = _wall_s(["-c", "import labkit.harness.experiment, labkit.measure.pace as p; p.measure_pace()"])
    return round(wall / measure_pace().measured_slowdown, 2)


def report_costs(folders: list[str]) -> dict[str, Any]:
    """From reports' `timings.json`: each notebook that ran, in reference seconds at the level it
    ran at (over the mean slowdown of the paces measured at the report's start and end: a shared
    host's speed drifts over minutes), the median where several reports ran it there. The
    notebooks' entries are these reports', nothing older: a notebook's cost changes with how its
    kernel runs, so one report at its report size and one at its smallest size make it anew.
    The shortest is a notebook's fixed cost (`kernel_s`)."""
    import statistics
    from pathlib import Path

    seen: dict[str, dict[str, list[float]]] = {}
    for folder in folders:
        timings = json.loads((Path(folder) / "timings.json").read_text())
        paces = [Pace(**timings[k]) for k in ("pace", "pace_after") if k in timings]
        slowdown = statistics.mean(p.measured_slowdown for p in paces)
        for stem, t in timings["notebooks"].items():
            if t["status"] == "ok":
                seen.setdefault(stem, {}).setdefault(str(t["level"]), []).append(t["seconds"] / slowdown)
    notebooks = {stem: {level: round(statistics.median(s), 2) for level, s in levels.items()}
                 for stem, levels in seen.items()}
    kernel = min(v for levels in notebooks.values() for v in levels.values())
    return {"notebooks": notebooks, "kernel_s": kernel}


def main(argv: list[str] | None = None) -> None:
    """`python -m labkit.harness.budget [NAME ...] [--from-report DIR ...]`: measure the
    experiments' costs (all, or those named) at every size, or read the notebooks' from reports
    (one unsized, `--budget-s 0`, and one at the smallest sizes, `--budget-s 1`), and write them
    into data/costs.json, keeping the rest."""
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("names", nargs="*")
    parser.add_argument("--from-report", metavar="DIR", nargs="+")
    args = parser.parse_args(argv)
    old = json.loads(COSTS_PATH.read_text()) if COSTS_PATH.exists() else {}
    if args.from_report:  # the notebooks these reports ran (`--only`) anew, the others' kept
        old["notebooks"] = {**old.get("notebooks", {}), **report_costs(args.from_report)["notebooks"]}
        old["kernel_s"] = min(v for levels in old["notebooks"].values() for v in levels.values())
    else:
        with tempfile.TemporaryDirectory() as runs_dir:
            old["experiments"] = {**old.get("experiments", {}), **measure_costs(args.names, runs_dir)}
        old["startup_s"] = startup_s()
    old["reference"] = REFERENCE.source
    COSTS_PATH.write_text(json.dumps(old, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
