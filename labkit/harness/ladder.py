"""The ladder: from `plain`, one technique at a time, each rung a `recipe` run measured beside
the planner's prediction for that exact rung.

    rungs = build_rungs({"precision": "bf16", "checkpointing": "full", "zero_stage": 2}, nproc=2)
    frame = run_ladder(rungs, preset="tiny", overrides={"nproc": 2})
    labkit.views.ladder.ladder_figure(frame)

The rungs follow the composition root's order (`labkit.blocks.recipe.ORDER`: precision,
checkpointing, compile, zero_stage, micro_batches, offload), so each rung is the one before
with one more transform applied where compose applies it. On several ranks the first rung above
`plain` is DDP alone (`zero_stage=0`): plain computes the whole global batch in one process,
and splitting it over the ranks is itself a technique, whose memory would otherwise be credited
to the next one.

Every rung is a point of ONE launch (gloo launches cost seconds each): `plain`, the reference,
runs once, and every composed rung is checked against its outputs (the global batch and the
weights are the same on every rung: the knobs only change how it is computed).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from labkit.blocks import recipe as recipes
from labkit.config import ConfigError, usable_threads
from labkit.harness import launch
from labkit.harness.experiment import measure_stored, plan_points
from labkit.results import RunsDirError, writable_runs_dir
from labkit.techniques import recipe, record

NAME = "recipe"
PLAIN = "plain"
# The knobs a rung turns on, in the order compose applies them (its one `ORDER`); the model
# converters and tensor, context and expert parallelism are not rungs (tensor and context
# parallelism change what plain's global batch is: the replicas; expert parallelism needs an MoE)
ORDER = tuple(k for k in recipes.ORDER
              if k not in ("finetune", "tensor_parallel", "context_parallel", "expert_parallel"))
DEFAULTS = {f.name: f.default for f in dataclasses.fields(recipe.Config) if f.name in ORDER}  # all off
DDP = "+ ddp"
# Metrics a rung that did not run (oom, error, skipped) still has a prediction for.
PREDICTED_WHEN_NOT_RUN = ("peak_mem_bytes", "tokens_per_s")
COLUMNS = ("rung", "rung_index", "variant", "rank", "metric", "measured", "predicted", "ratio",
           "status", "message")
BALANCE_PCT = 3.0  # the per-rank peaks of a balanced rung are within this % of the busiest


@dataclass(frozen=True)
class Rung:
    """One rung: its label, the recipe knobs it turns on (every one of the rungs below it, plus
    its own) and the recipe variant that runs it."""
    label: str
    knobs: dict[str, Any] = field(default_factory=dict)
    variant: str = "composed"


def cpu_ranks() -> int:
    """Ranks of a CPU ladder: as many as the cores this process may use hold without sharing a
    core (gloo ranks on one thread each), at least 2 (one data-parallel pair), at most 4."""
    return max(2, min(4, usable_threads()))


def rung_label(knob: str, value: Any) -> str:
    """`+ bf16`, `+ compile`, else `+ knob=value`."""
    if knob == "precision":
        return f"+ {value}"
    return "+ compile" if knob == "compile" else f"+ {knob}={value}"


def build_rungs(steps: dict[str, Any], *, nproc: int) -> list[Rung]:
    """plain, DDP alone on several ranks, then one rung per knob of `steps` in ORDER, each
    keeping the knobs of the rungs below it. A knob at its default would add a rung that
    changes nothing: refused, as is anything that is not a recipe knob."""
    unknown = [k for k in steps if k not in ORDER]
    if unknown:
        raise ConfigError(f"ladder steps are recipe knobs ({', '.join(ORDER)}); got {', '.join(unknown)}")
    idle = [k for k, v in steps.items() if v == DEFAULTS[k]]
    if idle:
        raise ConfigError(f"{', '.join(f'{k}={steps[k]}' for k in idle)} is the default: that "
                          "rung would turn nothing on")
    rungs = [Rung(PLAIN, {}, PLAIN)] + ([Rung(DDP)] if nproc > 1 else [])
    knobs: dict[str, Any] = {}
    for knob in (k for k in ORDER if k in steps):
        knobs = {**knobs, knob: steps[knob]}
        rungs.append(Rung(rung_label(knob, steps[knob]), knobs))
    return rungs


def ladder_rungs(steps: dict[str, Any], *, preset: str | None = None,
                 overrides: dict[str, Any] | None = None) -> list[Rung]:
    """build_rungs on the ranks these settings resolve to (nproc None: one per visible GPU,
    else the recipe's CPU ranks)."""
    (_, cfg), = plan_points(NAME, preset, _sizes(overrides), None)
    return build_rungs(steps, nproc=cfg.nproc)


def _sizes(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The settings every rung shares; the rungs set the recipe's knobs themselves."""
    knobs = sorted(set(overrides or {}) & set(ORDER))
    if knobs:
        raise ConfigError(f"the ladder's rungs set {', '.join(knobs)}: give them as its steps, "
                          "not in its overrides")
    return dict(overrides or {})


def rung_points(rungs: list[Rung], preset: str | None, overrides: dict[str, Any] | None) -> list:
    """Each rung as a harness point ({"rung": label}, its resolved and validated config), all
    before anything runs, so a bad rung fails first. Labels must differ (the rows carry them)."""
    labels = [r.label for r in rungs]
    if len(set(labels)) != len(labels) or not rungs or rungs[0].variant != PLAIN:
        raise ConfigError(f"a ladder is plain first, then rungs with different labels; got {labels}")
    overrides = _sizes(overrides)
    points = []
    for rung in rungs:
        (_, cfg), = plan_points(NAME, preset, {**(overrides or {}), **rung.knobs}, None)
        points.append(({"rung": rung.label}, dataclasses.replace(cfg, variant=rung.variant)))
    return points


def ladder_points(exp, chosen, points, store, *, on_rows=None, bar=None, before_variant=None) -> None:
    """The harness's point loop for a ladder (`run_points`' signature, handed to the launcher):
    plain once, then every composed rung checked against plain's outputs; rows stored as they
    come. `chosen` is unused: each point names its own variant."""
    reference = None
    for index, (point, cfg) in enumerate(points):
        if before_variant:
            before_variant(index, cfg)
        _, outputs = measure_stored(exp, cfg, reference, point, store)
        reference = outputs if cfg.variant == exp.reference else reference


def run_ladder(rungs: list[Rung], *, preset: str | None = None, overrides: dict[str, Any] | None = None,
               runs_dir: str | None = None) -> pd.DataFrame:
    """Measure every rung in one launch of `nproc` ranks (stored as one `recipe` run); the
    tidy frame of `ladder_frame`."""
    points = rung_points(rungs, preset, overrides)
    try:
        writable_runs_dir(runs_dir)
    except RunsDirError as e:
        raise ConfigError(str(e)) from None
    exp = record(NAME)
    result = launch.run(NAME, [exp.reference, "composed"], points, ladder_points, runs_dir=runs_dir)
    frame = ladder_frame(result.rows, points)
    frame.attrs["run_id"] = result.run_id
    return frame


# --- the rows as one tidy frame, and what it tells ------------------------------------------------

def ladder_frame(rows: list[dict[str, Any]], points: list) -> pd.DataFrame:
    """One row per rung, rank and metric (COLUMNS): measured beside predicted and `ratio`
    (measured / predicted); a rung that did not run (an `oom`) keeps its predicted peak and
    tokens/s (PREDICTED_WHEN_NOT_RUN) beside its status and message. `attrs["budget_gib"]`:
    the composed rungs' budget (None: unbounded)."""
    index = {p["rung"]: i for i, (p, _) in enumerate(points)}
    configs = {p["rung"]: cfg for p, cfg in points}
    exp, out = record(NAME), []
    for r in rows:
        label = r["params"]["sweep"]["rung"]
        base = {"rung": label, "rung_index": index[label], "variant": r["variant"], "rank": r["rank"],
                "status": r["status"], "message": r["message"]}
        if r["metric"] is not None:
            out.append({**base, "metric": r["metric"], "measured": r["value"], "predicted": r["predicted"]})
            continue
        expected = exp.expected(configs[label])
        out += [{**base, "metric": m, "measured": None, "predicted": expected.get(m)}
                for m in PREDICTED_WHEN_NOT_RUN]
    frame = pd.DataFrame(out, columns=[c for c in COLUMNS if c != "ratio"])
    for column in ("measured", "predicted"):
        frame[column] = pd.to_numeric(frame[column], errors="coerce")
    predicted = frame["predicted"].where(frame["predicted"] != 0)  # a 0 prediction has no ratio
    frame.insert(COLUMNS.index("ratio"), "ratio", frame["measured"] / predicted)
    frame = frame.sort_values(["rung_index", "rank"], kind="stable").reset_index(drop=True)
    frame.attrs["budget_gib"] = next((cfg.budget_gib for _, cfg in points if cfg.variant != PLAIN), None)
    return frame


def _per_rung(frame: pd.DataFrame, metric: str):
    """(rung_index, rung, variant, that rung's rows of `metric`), in the ladder's order."""
    rows = frame[frame["metric"] == metric]
    for (index, label, variant), group in rows.groupby(["rung_index", "rung", "variant"], sort=True):
        yield index, label, variant, group


def _status(group: pd.DataFrame) -> str:
    """ok when every rank's row is; else the first other status (an oom is every rank's)."""
    other = group["status"][group["status"] != "ok"]
    return "ok" if other.empty else other.iloc[0]


def job_throughput(frame: pd.DataFrame) -> pd.DataFrame:
    """Per rung, the whole job's training tokens/s, measured and predicted: plain's ranks each
    compute the whole global batch, so the job's rate is one rank's (their mean); a composed
    rung's ranks each compute their own slice at the same time, so it is their sum."""
    out = []
    for index, label, variant, g in _per_rung(frame, "tokens_per_s"):
        total = (lambda s: s.mean()) if variant == PLAIN else (lambda s: s.sum(min_count=1))
        out.append({"rung": label, "rung_index": index, "variant": variant,
                    "measured_tokens_per_s": total(g["measured"]),
                    "predicted_tokens_per_s": total(g["predicted"]), "status": _status(g)})
    return pd.DataFrame(out)


def verdicts(frame: pd.DataFrame) -> pd.DataFrame:
    """Per rung: the busiest rank's peak, measured and predicted, and the two verdicts against
    the budget (composed rungs only; plain, the reference, runs without it): the
    planner's fits / does not fit (`planner`) and the run's fits or oom (`run`); `agree` where
    there is a budget."""
    budget = frame.attrs.get("budget_gib")
    out = []
    for index, label, variant, g in _per_rung(frame, "peak_mem_bytes"):
        limit = None if variant == PLAIN or budget is None else budget * 2**30
        predicted, status = g["predicted"].max(), _status(g)
        planned = "no budget" if limit is None else ("fits" if predicted <= limit else "does not fit")
        measured = {"ok": "ran" if limit is None else "fits"}.get(status, status)
        out.append({"rung": label, "measured_peak_bytes": g["measured"].max(),
                    "predicted_peak_bytes": predicted, "ratio": g["measured"].max() / predicted,
                    "budget_bytes": limit, "planner": planned, "run": measured,
                    "agree": None if limit is None else (planned == "fits") == (status == "ok")})
    return pd.DataFrame(out)


def balance(frame: pd.DataFrame, tolerance_pct: float = BALANCE_PCT) -> pd.DataFrame:
    """Per rung that ran: the ranks' measured peaks, the least and the busiest, and their spread
    in % of the busiest; `balanced` when it is within `tolerance_pct`."""
    out = []
    for _, label, _, g in _per_rung(frame, "peak_mem_bytes"):
        peaks = g["measured"].dropna()
        if _status(g) != "ok" or peaks.empty:
            continue
        spread = 100 * (peaks.max() - peaks.min()) / peaks.max()
        out.append({"rung": label, "num_ranks": len(peaks), "least_peak_bytes": peaks.min(),
                    "busiest_peak_bytes": peaks.max(), "spread_pct": spread,
                    "balanced": bool(spread <= tolerance_pct)})
    return pd.DataFrame(out)


# --- predictions before anything runs -------------------------------------------------------------

def predicted_peaks(rungs: list[Rung], *, preset: str | None = None,
                    overrides: dict[str, Any] | None = None) -> dict[str, float]:
    """Each rung's predicted peak per rank (bytes; the planner, through `recipe`'s expected()),
    by label, without running anything."""
    exp = record(NAME)
    return {p["rung"]: exp.expected(cfg)["peak_mem_bytes"] for p, cfg in rung_points(rungs, preset, overrides)}


def budget_between(fits_bytes: float, does_not_fit_bytes: float) -> float:
    """A budget (GiB) that the first peak fits and the second does not, as far from each as the
    planner's error allows: their geometric mean (equal ratios to both)."""
    if not 0 < fits_bytes < does_not_fit_bytes:
        raise ConfigError(f"no budget fits {fits_bytes:.0f} bytes but not {does_not_fit_bytes:.0f}: "
                          "the first peak must be the smaller")
    return math.sqrt(fits_bytes * does_not_fit_bytes) / 2**30
