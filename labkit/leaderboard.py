"""The workshop leaderboard: every participant's stored results side by side, by machine and by
technique, and the best configuration per challenge, each number with where it came from.

Pure functions from a results frame (`labkit.results.load_results`, usually of a shared folder
that a room writes to, or of bundles imported into one) to tables and one plotly figure. The
numbers are what the runs measured; nothing here runs an experiment. Provenance of every number:
the run id, participant, team, machine (the stored fingerprint, `views.machine_name`), date and
preset, so a facilitator can open the run file behind any cell.

A challenge names an experiment, a metric and its direction. Runs only compete with runs at the
same preset (a `tiny` CPU run never beats a `medium` GPU one) and, where a challenge says so, the
same settings (`same`): peak memory at a smaller batch is not a better technique, only less work.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import pandas as pd

from labkit.config import check_choice
from labkit.results import format_value, load_results
from labkit.views import machine_name

# The metrics the leaderboard ranks by (one vocabulary: the unit is in the name).
METRICS = ("tokens_per_s", "useful_tokens_per_s", "requests_per_s", "tflops", "gbps", "step_ms",
           "peak_mem_bytes", "bubble_fraction")
LOWER_IS_BETTER = ("_ms", "_bytes", "_fraction", "loss")  # metric name endings
PROVENANCE = ["run_id", "participant", "team", "machine", "date", "preset"]
HOVER_FIELDS = ("team", "machine", "preset", "settings", "run_id", "date")  # a bar's provenance
UNNAMED = "(unnamed)"


@dataclass(frozen=True)
class Challenge:
    name: str
    experiment: str
    metric: str
    task: str  # what participants try, in one line
    same: tuple[str, ...] = ()  # config fields a fair comparison holds fixed (besides the preset)

    @property
    def goal(self) -> str:
        return better(self.metric)


CHALLENGES = (
    Challenge("fastest decoding", "kv_cache", "tokens_per_s",
              "the most decoded tokens/s: cache variant, batch size, dtype"),
    Challenge("leanest training step", "checkpointing", "peak_mem_bytes",
              "the least peak memory for the same batch and sequence: what to recompute",
              same=("batch_size", "seq_len")),
    Challenge("most useful serving throughput", "batching", "useful_tokens_per_s",
              "the most useful (non-padding) tokens/s: static, dynamic or continuous batching"),
    Challenge("fastest mixed-precision training", "mixed_precision", "tokens_per_s",
              "the most training tokens/s: dtype, loss scaling, batch size"),
    Challenge("matmul nearest the peak", "matmul", "tflops",
              "the most TFLOP/s: shape, dtype, tensor-core-friendly sizes"),
    Challenge("smallest pipeline bubble", "pipeline_parallel", "bubble_fraction",
              "the least idle time: schedule and number of micro-batches"),
    Challenge("least memory per rank with ZeRO", "zero", "peak_mem_bytes",
              "the least peak memory per rank for the same batch: the ZeRO stage",
              same=("batch_size", "seq_len")),
)


def better(metric: str) -> str:
    """`min` where lower is better (time, bytes, fractions, loss), else `max`."""
    return "min" if metric.endswith(LOWER_IS_BETTER) else "max"


def _point(params: Any) -> str:
    """A sweep point as text: `batch_size=4, seq_len=64` (empty without a sweep)."""
    sweep = params.get("sweep") if isinstance(params, dict) else None
    return ", ".join(f"{k}={v}" for k, v in (sweep or {}).items())


def board(frame: pd.DataFrame) -> pd.DataFrame:
    """The measured rows (status ok; rank 0 of a multi-process run) with their provenance: one
    row per measurement, columns PROVENANCE plus experiment, variant, settings (the sweep point),
    metric, value, unit and params."""
    columns = [*PROVENANCE, "experiment", "variant", "settings", "metric", "value", "unit", "params"]
    ok = frame[(frame["status"] == "ok") & frame["metric"].notna() & frame["value"].notna()]
    ok = ok[ok["rank"].fillna(0) == 0]
    if ok.empty:
        return pd.DataFrame(columns=columns)
    params = ok["params"].map(lambda p: p if isinstance(p, dict) else {})
    out = ok.assign(
        participant=params.map(lambda p: p.get("participant") or UNNAMED),
        team=params.map(lambda p: p.get("team") or ""),
        machine=[machine_name(env, p.get("device")) for env, p in zip(ok["env"], params)],
        date=ok["timestamp"], preset=params.map(lambda p: p.get("preset")),
        settings=params.map(_point), params=params, value=ok["value"].astype(float))
    return out[columns].reset_index(drop=True)


def load_board(runs_dir: str | os.PathLike | None = None, preset: str | None = None) -> pd.DataFrame:
    """`board` of every run stored in `runs_dir` (None: $LABKIT_RUNS_DIR or ./runs), at `preset`
    only when one is given."""
    rows = board(load_results(runs_dir))
    return rows if preset is None else rows[rows["preset"] == preset].reset_index(drop=True)


def _best(rows: pd.DataFrame, metric: str, keys: list[str]) -> pd.DataFrame:
    """The best row of `metric` for each group of `keys` (ties: the earliest run)."""
    rows = rows[rows["metric"] == metric].sort_values(["date", "run_id"], kind="stable")
    if rows.empty:
        return rows
    order = rows.sort_values("value", ascending=better(metric) == "min", kind="stable")
    return order.drop_duplicates(keys).sort_values(keys, kind="stable").reset_index(drop=True)


def entries(rows: pd.DataFrame, metric: str = "tokens_per_s") -> pd.DataFrame:
    """Each participant's best `metric` per technique (experiment, variant), machine and preset,
    with the provenance of that number and the settings that gave it."""
    check_choice("metric", metric, METRICS)
    keys = ["experiment", "variant", "participant", "team", "machine", "preset"]
    best = _best(rows, metric, keys)
    return best[[*keys[:2], "value", "unit", "settings", "run_id", "date", *keys[2:]]]


def side_by_side(rows: pd.DataFrame, metric: str = "tokens_per_s", by: str = "machine") -> pd.DataFrame:
    """Techniques (experiment/variant) down, `by` (machine, participant or team) across: the best
    `metric` in each cell. The provenance of each cell is its row in `entries`."""
    check_choice("by", by, ("machine", "participant", "team"))
    best = entries(rows, metric)
    if best.empty:
        return pd.DataFrame()
    best = best.assign(technique=best["experiment"] + "/" + best["variant"])
    pick = "min" if better(metric) == "min" else "max"
    return best.pivot_table(index="technique", columns=by, values="value", aggfunc=pick)


def _group(challenge: Challenge, params: dict) -> str:
    """The comparison a row belongs to: its preset and the settings the challenge holds fixed."""
    return ", ".join([f"preset={params.get('preset')}", *(f"{k}={params.get(k)}" for k in challenge.same)])


def best_per_challenge(rows: pd.DataFrame, challenges: tuple[Challenge, ...] = CHALLENGES) -> pd.DataFrame:
    """One row per challenge and comparison group (the preset, and `same` settings): the best
    value, the configuration (variant and settings) that gave it, its provenance, and how many
    measurements competed. A challenge nobody ran yet is one row with no value."""
    out = []
    for c in challenges:
        mine = rows[(rows["experiment"] == c.experiment) & (rows["metric"] == c.metric)]
        mine = mine.assign(group=[_group(c, p) for p in mine["params"]])
        head = {"challenge": c.name, "experiment": c.experiment, "metric": c.metric, "goal": c.goal}
        if mine.empty:
            out.append({**head, "task": c.task, "entries": 0})
            continue
        for _, r in _best(mine, c.metric, ["group"]).iterrows():
            competing = int((mine["group"] == r["group"]).sum())
            out.append({**head, "group": r["group"], "value": r["value"], "unit": r["unit"],
                        "variant": r["variant"], "settings": r["settings"], "entries": competing,
                        **{k: r[k] for k in PROVENANCE}, "task": c.task})
    columns = ["challenge", "experiment", "metric", "goal", "group", "value", "unit", "variant",
               "settings", "entries", *PROVENANCE, "task"]
    return pd.DataFrame(out, columns=columns)


def figure(rows: pd.DataFrame, metric: str = "tokens_per_s") -> Any:
    """Bars: each technique's best `metric` per participant (colour), on each machine (hover:
    the run id, machine, date and settings)."""
    import plotly.express as px

    best = entries(rows, metric)
    best = best.assign(technique=best["experiment"] + "/" + best["variant"])
    from labkit.viz import legend_above

    best = best.assign(shown=[format_value(metric, v) for v in best["value"]])
    fig = px.bar(best, x="technique", y="value", color="participant", barmode="group",
                 hover_data={"value": False, "shown": True, **dict.fromkeys(HOVER_FIELDS, True)},
                 labels={"shown": metric}, title=f"best {metric} per participant ({better(metric)} is better)")
    fig.update_layout(yaxis_title=metric, xaxis_title=None, legend_title="participant")
    return legend_above(fig, 460)


def leaderboard_panel(runs_dir: str | os.PathLike | None = None, metric: str = "tokens_per_s",
                      preset: str | None = None) -> Any:
    """A metric and a grouping to choose, and Refresh (reads the shared folder again, so the
    room's newest runs appear): the side-by-side table, the best per challenge, the bars."""
    import ipywidgets as W
    from IPython.display import display

    check_choice("metric", metric, METRICS)
    pick = W.Dropdown(options=list(METRICS), value=metric, description="metric")
    by = W.Dropdown(options=["machine", "participant", "team"], value="machine", description="by")
    refresh = W.Button(description="Refresh", icon="refresh")
    output = W.Output()

    def redraw(_=None) -> None:
        from labkit.viz import readable

        rows = load_board(runs_dir, preset)
        with output:
            output.clear_output(wait=True)
            display(readable(side_by_side(rows, pick.value, by.value), metric=pick.value),
                    readable(best_per_challenge(rows)), figure(rows, pick.value))

    for control in (pick, by):
        control.observe(redraw, names="value")
    refresh.on_click(redraw)
    redraw()
    return W.VBox([W.HBox([pick, by, refresh]), output])
