"""The report's own time plan: each notebook's seconds on this CPU, predicted before anything runs,
and the size each one runs at so that the whole report fits its budget.

A notebook's sizes are its report parameters (level 0), then its smaller ones: the `CPU_RUNGS` of
its experiment, given as overrides, or `NOTEBOOK_RUNGS` for a notebook that is not one
experiment's. Its reference seconds at each level are measured in reports on the reference CPU
(`data/costs.json`, `notebooks`: written by `python -m labkit.harness.budget --from-report`);
a level no report measured is the nearest measured one scaled as its experiment's own run scales
between the two sizes (both measured), the kernel's start kept. On this CPU the seconds are
multiplied by its pace's `slowdown` (`labkit.measure.pace`), plus what its 16-bit matmuls cost
beyond that (`labkit.harness.budget.low_precision_s`). Each notebook's share of the budget is its
part of the whole at level 0, at most `NOTEBOOK_TARGET_S`; a notebook predicted over its share is
sized down before it runs, to its first level that fits, or to its quickest where none does.

The notebooks run on `cores` core slots: a notebook takes one slot per rank it starts (at most
all of them), so two multi-rank notebooks never share two cores; the predicted wall time is that
schedule replayed on the predicted seconds.
"""
from __future__ import annotations

import ast
import heapq
import math
from dataclasses import dataclass, field
from typing import Any

from labkit.config import expand_sweep, resolve
from labkit.harness import budget
from labkit.measure.pace import Pace
from labkit.techniques import record

LAST_FROM = 90  # 99_compare and later read the runs the others store: they start after them
REPORT_TARGET_S = 480.0  # the whole report's goal is 600 s on any 2-core CPU; the rest is margin
NOTEBOOK_TARGET_S = 45.0  # each notebook's goal is 60 s
# Smaller report settings of a notebook's own parameters, level by level (with its experiment's
# rungs, where it has one): parameter -> what to change in its default (a dict parameter is
# updated, not replaced)
NOTEBOOK_RUNGS: dict[str, tuple[dict[str, Any], ...]] = {
    # the worked example's ladder on 8 x 64 tokens per rank through one block, not 8 x 128
    # through two: a quarter of the work, and the story holds (every rung at the whole batch
    # predicted over the budget, the accumulated one under it, each by 6%)
    "08_memory_planner": ({"measured": {"seq_len": 64, "num_layers": 1}},
                          # then one timed step a rung (the ladder's story is memory), and the
                          # planner's check at 2 x 32 tokens, not 4 x 64
                          {"measured": {"seq_len": 64, "num_layers": 1, "timed_steps": 1},
                           "check_overrides": {"batch_size": 2, "seq_len": 32}}),
    # one cold compile, not two: the decode step's, where fusing many small ops pays
    "18_compile": ({}, {}, {"sweep": {"target": ["decode"]}}),
    # naive attention at 512 tokens, not 1024: a quarter of its costliest point
    "17_attention": ({}, {}, {"sweep": {"seq_len": [128, 512]}}),
    # the bubble at 1 and 4 micro-batches, not also at 2: its fall with m still shown
    "13_pipeline_parallel": ({}, {}, {}, {"sweep": {"micro_batches": [1, 4]}}),
    # the Pareto figure at two batch limits, not four
    "29_sla": ({}, {}, {}, {"pareto_batch_sizes": [2, 8]}),
    # one fresh process (OMP_NUM_THREADS read at its start), not three: each imports torch anew,
    # about 2 s of its 10 on the reference CPU; a knob set in the process and one read at its start
    # still stand side by side
    "24_threads": ({}, {}, {"variants": "set_num_threads,omp_env"}),
    # LoRA and QLoRA beside the full fine-tune, without LoRA with checkpointing: three of the
    # run's four variants (the frontier still searches all four)
    "30_finetune": ({}, {}, {"variants": "lora,qlora"}),
}
# Notebooks whose recipe ladder runs rungs in bf16 (autocast, or FSDP2's policy under ZeRO-2/3):
# the parameter holding the ladder's sizes, and how many of its rungs run in bf16 (every rung
# from `+ bf16` on)
LADDERS = {"08_memory_planner": ("measured", 3), "26_recipe": ("overrides", 2)}


@dataclass
class NotebookPlan:
    """One notebook: its ranks, its settings over its report parameters, its predicted seconds
    here (nan where nothing was measured), its level (0: its report size) and why."""

    stem: str
    ranks: int
    settings: dict[str, Any] = field(default_factory=dict)
    predicted_s: float = math.nan
    level: int = 0
    note: str = ""


def levels(stem: str, experiment: str | None, known: dict[str, Any]) -> list[dict[str, Any]]:
    """The notebook's parameters over its report ones at each level: {} first, then its
    experiment's rungs as overrides, each with the notebook's own at that level (NOTEBOOK_RUNGS)."""
    rungs = [{"overrides": dict(r)} for r in record(experiment).cpu_rungs] if experiment else []
    own = NOTEBOOK_RUNGS.get(stem, ())
    smaller = []
    for i in range(max(len(rungs), len(own))):
        level = {**(rungs[i] if i < len(rungs) else rungs[-1] if rungs else {}),
                 **(own[i] if i < len(own) else own[-1] if own else {})}
        smaller.append({k: {**_default(known, k), **v} if isinstance(v, dict) and k != "overrides" else v
                        for k, v in level.items()})
    return [{}] + smaller


def _default(known: dict[str, Any], name: str) -> Any:
    """A parameter's default in the notebook (papermill's inspect_notebook gives its source)."""
    return ast.literal_eval(known[name]["default"])


def reference_s(stem: str, experiment: str | None, count: int) -> list[float]:
    """The notebook's reference seconds at each of its `count` levels (empty: never measured)."""
    c = budget.costs()
    measured = {int(k): v for k, v in c.get("notebooks", {}).get(stem, {}).items()}
    if not measured:
        return []
    runs = c["experiments"].get(experiment or "", [])
    start, kernel = c["startup_s"], c["kernel_s"]
    out = []
    for level in range(count):
        if level in measured:
            out.append(measured[level])
            continue
        near = min(measured, key=lambda k: abs(k - level))
        ratio = 1.0
        if runs:  # a level past the experiment's rungs runs its last rung (and smaller own
            # parameters, which only a report measures)
            at, near_at = (runs[min(i, len(runs) - 1)] for i in (level, near))
            ratio = max(0.0, at - start) / max(1e-9, near_at - start)
        kept = min(kernel, measured[near])
        out.append(kept + (measured[near] - kept) * ratio)
    return out


def low_precision_s(stem: str, experiment: str | None, params: dict[str, Any],
                    known: dict[str, Any], pace: Pace) -> float:
    """What the notebook's 16-bit matmuls add here at `params` (its report parameters with a
    level's applied): its experiment's variants at each sweep point, or its ladder's bf16 rungs."""
    if stem in LADDERS:
        where, rungs = LADDERS[stem]
        sizes = params.get(where) or _default(known, where)
        exp = record("recipe")
        cfg = resolve(exp.Config, "tiny", {**sizes, "precision": "bf16", "device": "cpu"},
                      experiment="recipe")
        return rungs * budget.low_precision_s(exp, cfg, ["composed"], pace)
    if not experiment:
        return 0.0
    exp = record(experiment)
    chosen = params.get("variants", "all")
    variants = list(exp.variants) if chosen in ("all", None) else str(chosen).split(",")
    extra = 0.0
    for point in expand_sweep(params.get("sweep") or {}):
        overrides = {**(params.get("overrides") or {}), **point, "device": "cpu"}
        cfg = resolve(exp.Config, "tiny", overrides, experiment=experiment)
        extra += budget.low_precision_s(exp, cfg, variants, pace)
    return extra


def plan_notebooks(params: dict[str, dict[str, Any]], experiments: dict[str, str | None],
                   known: dict[str, dict[str, Any]], ranks: dict[str, int], given: dict[str, set[str]],
                   pace: Pace, cores: int, budget_s: float = REPORT_TARGET_S) -> list[NotebookPlan]:
    """Each notebook's level and predicted seconds, in the order of `params` (by stem: its report
    parameters). `given`: settings its parameters fix by hand (a user's --set, a swept key) and
    parameters its caller gave, which no level overrides."""
    sized: dict[str, list[tuple[dict[str, Any], float]]] = {}
    for stem, own in params.items():
        steps = levels(stem, experiments[stem], known[stem])
        seconds = reference_s(stem, experiments[stem], len(steps))
        sized[stem] = []
        for step, ref in zip(steps, seconds):
            applied = _apply(own, step, given[stem])
            changes = _changes(own, applied)
            if sized[stem] and changes == sized[stem][-1][0]:
                # what this level would change is given by hand or swept: the size before it,
                # at its seconds (a smaller level may still change something else)
                sized[stem].append(sized[stem][-1])
                continue
            extra = low_precision_s(stem, experiments[stem], applied, known[stem], pace)
            sized[stem].append((changes, pace.slowdown * ref + extra))
    core_s = sum(s[0][1] * min(ranks[t], cores) for t, s in sized.items() if s)
    scale = min(1.0, budget_s * cores / core_s) if core_s else 1.0
    plans = []
    for stem in params:
        plan = NotebookPlan(stem, ranks[stem])
        if sized[stem]:
            share = min(NOTEBOOK_TARGET_S, scale * sized[stem][0][1])
            times = [t for _, t in sized[stem]]
            quickest = min(range(len(times)), key=lambda i: (times[i], -i))  # where none fits
            plan.level = next((i for i, t in enumerate(times) if t <= share), quickest)
            while plan.level and sized[stem][plan.level - 1] == sized[stem][plan.level]:
                plan.level -= 1  # the first level of that size
            plan.settings, plan.predicted_s = sized[stem][plan.level]
            if plan.level:
                over = "" if plan.predicted_s <= share else "; still over it at its quickest size"
                shown = _shown(plan.settings, params[stem], known[stem])
                plan.note = (f"sized down to {shown}: about {times[0]:.0f} s here at its report size, "
                             f"over its share of {share:.0f} s{over}")
        plans.append(plan)
    return plans


def _apply(own: dict[str, Any], step: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """The report parameters `own` with a level's `step` applied: its overrides over the
    notebook's, except the settings and parameters in `given`."""
    applied = dict(own)
    for name, value in step.items():
        if name == "overrides":
            kept = {k: v for k, v in value.items() if k not in given}
            if kept:
                applied["overrides"] = {**(own.get("overrides") or {}), **kept}
        elif name not in given:
            applied[name] = value
    return applied


def _changes(own: dict[str, Any], applied: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in applied.items() if own.get(k) != v}


def _shown(settings: dict[str, Any], own: dict[str, Any], known: dict[str, Any]) -> str:
    """What a level changes, in words: `key=value` for each setting that differs from the
    notebook's own (a dict parameter: each of its entries that differs, named `param.key`
    except in `overrides`, the experiment's settings)."""
    parts = []
    for name, value in settings.items():
        if isinstance(value, dict):
            before = own[name] if name in own else _default(known, name)
            head = "" if name == "overrides" else f"{name}."
            parts += [f"{head}{k}={v}" for k, v in value.items() if before.get(k) != v]
        else:
            parts.append(f"{name}={value}")
    return ", ".join(parts)


def schedule_s(plans: list[NotebookPlan], cores: int, start_s: float = 0.0) -> float:
    """The report's predicted wall time: the notebooks started in the report's order on `cores`
    core slots (multi-rank first, then the rest; from `LAST_FROM` on after all others), each
    holding min(ranks, cores) slots for its predicted seconds (0 where unknown), after `start_s`
    (the kernels' start, side by side)."""
    order = sorted(plans, key=lambda p: start_order(p.stem, p.ranks, p.predicted_s))
    running: list[tuple[float, int]] = []  # (end time, slots held), earliest end first
    clock, free = start_s, cores
    for plan in order:
        need = min(plan.ranks, cores)
        while running and (free < need or number(plan.stem) >= LAST_FROM):
            clock, slots = heapq.heappop(running)
            free += slots
        heapq.heappush(running, (clock + (0.0 if math.isnan(plan.predicted_s) else plan.predicted_s), need))
        free -= need
    return max([clock] + [end for end, _ in running])


def start_order(stem: str, ranks: int, predicted_s: float) -> tuple[bool, bool, float]:
    """A notebook's place in the report's queue: the multi-rank ones first (they need every
    slot, so they do not queue up at the end while the cores idle), then the others, from
    `LAST_FROM` on after all; within each, the longest predicted first, so that no long one
    starts last and runs alone (unmeasured ones last)."""
    return number(stem) >= LAST_FROM, ranks < 2, -(0.0 if math.isnan(predicted_s) else predicted_s)


def number(stem: str) -> int:
    """A notebook's number: 8 for 08_memory_planner."""
    head = stem.split("_", 1)[0]
    return int(head) if head.isdigit() else 0


def describe(plans: list[NotebookPlan], cores: int, pace: Pace, budget_s: float = REPORT_TARGET_S) -> str:
    """The dry run's table: each notebook's ranks, predicted seconds and sizing, then the total."""
    lines = [f"pace: {pace.describe()}", f"core slots: {cores}", "",
             f"{'notebook':<24} {'ranks':>5} {'predicted s':>12}  sizing"]
    for p in plans:
        seconds = "unmeasured" if math.isnan(p.predicted_s) else f"{p.predicted_s:.0f}"
        lines.append(f"{p.stem:<24} {p.ranks:>5} {seconds:>12}  {p.note or 'report size'}")
    # the kernels start and import torch and labkit first, side by side: about one labkit process
    # start (`startup_s`, Python, torch and labkit) each
    start_s = budget.costs()["startup_s"] * pace.slowdown
    lines += ["", f"predicted wall time: {schedule_s(plans, cores, start_s):.0f} s, the kernels' "
                  f"start ({start_s:.0f} s) included (target {budget_s:.0f} s)"]
    return "\n".join(lines)
