"""The workshop leaderboard: every participant's stored results side by side, by machine and by
technique, and the best configuration per challenge, each number with where it came from.

Pure functions from a results frame (`labkit.results.load_results`, usually of a shared folder
that a room writes to, or of bundles imported into one) to tables and one plotly figure. The
numbers are what the runs measured; nothing here runs an experiment. Provenance of every number:
the run id, participant, team, machine (the stored fingerprint, `views.machine_name`), date and
preset, so a facilitator can open the run file behind any cell.

A challenge names an experiment, a metric and its direction. Runs only compete inside one
comparison group (`comparison_group`): the same model shape (every model field, not just the
preset name: one layer is less work, not a better technique), the same rank count and dtype, the
challenge's own `same` settings (peak memory at a smaller batch is only less work) and the same
machine class (a GPU's name, or the CPU model: what the device is, not the hostname).

The learning view (`learning_view`, `hardest_exercises`) reads the room's exercise attempts:
attempts and accuracy by topic and person, and the exercises a room gets wrong most.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import pandas as pd

from labkit.config import DTYPE_ALIASES, MODELS, check_choice
from labkit.results import format_value, load_results
from labkit.views import device_identity, machine_name

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
    # run settings a fair comparison holds fixed, besides every group's model shape, rank count,
    # dtype and machine class (`comparison_group`)
    same: tuple[str, ...] = ()

    @property
    def goal(self) -> str:
        return better(self.metric)


CHALLENGES = (
    Challenge("fastest decoding", "kv_cache", "tokens_per_s",
              "the most decoded tokens/s: cache variant, batch size, kv_dtype"),
    Challenge("leanest training step", "checkpointing", "peak_mem_bytes",
              "the least peak memory for the same model, batch and sequence: what to recompute",
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
              "the least peak memory per rank for the same batch and ranks: the ZeRO stage",
              same=("batch_size", "seq_len")),
)


def better(metric: str) -> str:
    """`min` where lower is better (time, bytes, fractions, loss), else `max`."""
    return "min" if metric.endswith(LOWER_IS_BETTER) else "max"


def _point(params: Any) -> str:
    """A sweep point as text: `batch_size=4, seq_len=64` (empty without a sweep)."""
    sweep = params.get("sweep") if isinstance(params, dict) else None
    return ", ".join(f"{k}={v}" for k, v in (sweep or {}).items())


def machine_class(env: dict | None, device: str | None = None) -> str:
    """What the device is, not which host: the GPU's name for a `cuda` run (`views.machine_name`),
    else `CPU <model>` (two hosts with the same CPU model are one class)."""
    kind, model = device_identity(env, device)
    return f"CPU {model or '?'}" if kind == "cpu" else machine_name(env, device)


def board(frame: pd.DataFrame) -> pd.DataFrame:
    """The measured rows (status ok; rank 0 of a multi-process run) with their provenance: one
    row per measurement, columns PROVENANCE plus experiment, variant, settings (the sweep point),
    metric, value, unit, params, machine_class (`machine_class`) and setup (`setup`)."""
    columns = [*PROVENANCE, "experiment", "variant", "settings", "metric", "value", "unit", "params",
               "machine_class", "setup"]
    ok = frame[(frame["status"] == "ok") & frame["metric"].notna() & frame["value"].notna()]
    ok = ok[ok["rank"].fillna(0) == 0]
    if ok.empty:
        return pd.DataFrame(columns=columns)
    params = ok["params"].map(lambda p: p if isinstance(p, dict) else {})
    out = ok.assign(
        participant=params.map(lambda p: p.get("participant") or UNNAMED),
        team=params.map(lambda p: p.get("team") or ""),
        machine=[machine_name(env, p.get("device")) for env, p in zip(ok["env"], params)],
        machine_class=[machine_class(env, p.get("device")) for env, p in zip(ok["env"], params)],
        date=ok["timestamp"], preset=params.map(lambda p: p.get("preset")),
        settings=params.map(_point), setup=params.map(setup), params=params,
        value=ok["value"].astype(float))
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
    """Each participant's best `metric` per technique (experiment, variant, setup), machine and
    preset, with the provenance of that number and the settings that gave it."""
    check_choice("metric", metric, METRICS)
    keys = ["experiment", "variant", "setup", "participant", "team", "machine", "preset"]
    best = _best(rows, metric, keys)
    return best[[*keys[:3], "value", "unit", "settings", "run_id", "date", *keys[3:]]]


def _technique(best: pd.DataFrame) -> pd.Series:
    """`experiment/variant`, then its `setup` in parentheses where it is not the preset's."""
    return pd.Series([f"{e}/{v}" + (f" ({s})" if s else "")
                      for e, v, s in zip(best["experiment"], best["variant"], best["setup"])],
                     index=best.index, dtype=object)


def side_by_side(rows: pd.DataFrame, metric: str = "tokens_per_s", by: str = "machine") -> pd.DataFrame:
    """Techniques (experiment/variant, and the setup where it is not the preset's) down, `by`
    (machine, participant or team) across: the best `metric` in each cell. The provenance of
    each cell is its row in `entries`."""
    check_choice("by", by, ("machine", "participant", "team"))
    best = entries(rows, metric)
    if best.empty:
        return pd.DataFrame()
    best = best.assign(technique=_technique(best))
    pick = "min" if better(metric) == "min" else "max"
    return best.pivot_table(index="technique", columns=by, values="value", aggfunc=pick)


def shape_changes(params: dict) -> list[str]:
    """The model fields of a run's resolved config (`params["model"]`) that differ from its
    preset's defaults (`MODELS[preset]`), as `field=value`, in the model's field order. A preset
    not in MODELS shows every field; a row without a stored model says so."""
    model = params.get("model")
    if not isinstance(model, dict):
        return ["shape not recorded"]
    preset = MODELS.get(params.get("preset"))
    default = dataclasses.asdict(preset) if preset is not None else {}
    return [f"{k}={v}" for k, v in model.items() if k not in default or default[k] != v]


def setup(params: dict) -> str:
    """What a run changed beyond its preset and variant, for the side-by-side tables (which
    pool machines of one kind but must not pool shapes): model fields off the preset, the rank
    count when above 1 and the dtype when not float32; empty for a run at the preset's shape."""
    shape = shape_changes(params) if isinstance(params.get("model"), dict) else []
    num_ranks, dtype = int(params.get("nproc") or 1), params.get("dtype")
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    return ", ".join([*shape, *([f"{num_ranks} ranks"] if num_ranks > 1 else []),
                      *([dtype] if dtype and dtype != "float32" else [])])


def comparison_group(params: dict, machine: str, same: tuple[str, ...] = ()) -> str:
    """The runs a row competes with, as readable text that is also the group's key: the preset
    and every model field off its defaults (so the whole shape is fixed), the `same` settings, the
    rank count (`nproc`; missing: 1), the dtype and the machine class, e.g. `tiny, num_layers=1,
    batch_size=8, seq_len=512, 2 ranks, float32, CPU AMD EPYC 7763`."""
    num_ranks = int(params.get("nproc") or 1)
    dtype = params.get("dtype")
    return ", ".join([str(params.get("preset")), *shape_changes(params),
                      *(f"{k}={params.get(k)}" for k in same),
                      f"{num_ranks} rank{'s' if num_ranks != 1 else ''}",
                      DTYPE_ALIASES.get(dtype, dtype or "dtype unknown"), machine])


def best_per_challenge(rows: pd.DataFrame, challenges: tuple[Challenge, ...] = CHALLENGES) -> pd.DataFrame:
    """One row per challenge and comparison group (`comparison_group`: model shape, `same`
    settings, rank count, dtype, machine class): the best value, the configuration (variant and
    settings) that gave it, its provenance, and how many measurements competed. Runs in
    different groups never compete. A challenge nobody ran yet is one row with no value."""
    out = []
    for c in challenges:
        mine = rows[(rows["experiment"] == c.experiment) & (rows["metric"] == c.metric)]
        mine = mine.assign(group=[comparison_group(p, m, c.same)
                                  for p, m in zip(mine["params"], mine["machine_class"])])
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


# ---- the learning view: exercise attempts (`labkit.study.exercises.attempts`), by topic and person ----

LEARNING_BY = ("participant", "team")
ALL_TOPICS, EVERYONE = "(all topics)", "(everyone)"  # the total rows of `learning_view`
LEARNING_COLUMNS = ["attempts", "correct", "accuracy_pct", "exercises_tried", "first_try_accuracy_pct"]


def load_learning(runs_dir: str | os.PathLike | None = None) -> pd.DataFrame:
    """The room's exercise attempts (`<runs_dir>/attempts/*.json`), one row per attempt; an empty
    frame when nobody has tried an exercise yet."""
    from labkit.study.exercises.attempts import load_attempts  # lazy: the run tables need none of it

    return load_attempts(runs_dir)


def _tidy_attempts(attempts: pd.DataFrame) -> pd.DataFrame:
    """Attempts in time order with `correct` a bool, names filled in, `first`: whether the row is
    its participant's first attempt at that exercise (and kind: a troubleshooting exercise's
    diagnosis and fix are two questions; ties: the attempt id), and `first_correct`."""
    frame = attempts.copy()
    for name in ("participant", "team", "topic", "exercise", "kind", "attempt_id", "timestamp"):
        if name not in frame:
            frame[name] = None
    frame["correct"] = frame["correct"].eq(True) if "correct" in frame else False
    for name in ("participant", "team"):
        frame[name] = [v if isinstance(v, str) and v else UNNAMED for v in frame[name]]
    frame["topic"] = [v if isinstance(v, str) and v else "?" for v in frame["topic"]]
    when = pd.to_datetime(frame["timestamp"], utc=True, errors="coerce", format="ISO8601")
    frame = frame.assign(_when=when).sort_values(["_when", "attempt_id"], kind="stable")
    frame["first"] = ~frame.duplicated(["participant", "exercise", "kind"])
    frame["first_correct"] = frame["first"] & frame["correct"]
    return frame.drop(columns="_when")


def _tally(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """LEARNING_COLUMNS for each group of `keys` (accuracies in %, one decimal)."""
    grouped = frame.groupby(keys, sort=True)
    out = pd.DataFrame({
        "attempts": grouped.size(), "correct": grouped["correct"].sum().astype(int),
        "exercises_tried": grouped["exercise"].nunique(),
        "first_tries": grouped["first"].sum(), "first_correct": grouped["first_correct"].sum(),
    })
    out["accuracy_pct"] = (100 * out["correct"] / out["attempts"]).round(1)
    out["first_try_accuracy_pct"] = (100 * out["first_correct"] / out["first_tries"]).round(1)
    return out.reset_index()[[*keys, *LEARNING_COLUMNS]]


def learning_view(attempts: pd.DataFrame, by: str = "participant") -> pd.DataFrame:
    """One row per person (or team, `by`) and topic: attempts, correct, accuracy_pct,
    exercises_tried and first_try_accuracy_pct (each participant's first attempt at each
    exercise, so retries until right do not count); then each person's row over all topics
    (topic `(all topics)`) and the room's (`(everyone)`). Empty attempts: an empty table."""
    check_choice("by", by, LEARNING_BY)
    columns = [by, "topic", *LEARNING_COLUMNS]
    if attempts is None or attempts.empty:
        return pd.DataFrame(columns=columns)
    frame = _tidy_attempts(attempts)
    per_topic = _tally(frame, [by, "topic"])
    per_person = _tally(frame, [by]).assign(topic=ALL_TOPICS)
    room = _tally(frame.assign(_all=EVERYONE), ["_all"]).rename(columns={"_all": by})
    room = room.assign(topic=ALL_TOPICS)
    return pd.concat([per_topic, per_person, room], ignore_index=True)[columns]


def hardest_exercises(attempts: pd.DataFrame) -> pd.DataFrame:
    """Exercises by accuracy, the one a room gets wrong most first (ties: more attempts first):
    exercise, topic, level, people (who tried it), attempts, correct, accuracy_pct,
    first_try_accuracy_pct. Empty attempts: an empty table."""
    columns = ["exercise", "topic", "level", "people", "attempts", "correct", "accuracy_pct",
               "first_try_accuracy_pct"]
    if attempts is None or attempts.empty:
        return pd.DataFrame(columns=columns)
    frame = _tidy_attempts(attempts)
    frame["level"] = frame["level"] if "level" in frame else None
    out = _tally(frame, ["exercise"])
    about = frame.groupby("exercise").agg(topic=("topic", "first"), level=("level", "first"),
                                          people=("participant", "nunique"))
    out = out.join(about, on="exercise")
    out = out.sort_values(["accuracy_pct", "attempts", "exercise"], ascending=[True, False, True],
                          kind="stable")
    return out.reset_index(drop=True)[columns]


def figure(rows: pd.DataFrame, metric: str = "tokens_per_s") -> Any:
    """Bars: each technique's best `metric` per participant (colour), on each machine (hover:
    the run id, machine, date and settings)."""
    import plotly.express as px

    best = entries(rows, metric)
    best = best.assign(technique=_technique(best))
    from labkit.views.plots import legend_above

    best = best.assign(shown=[format_value(metric, v) for v in best["value"]])
    fig = px.bar(best, x="technique", y="value", color="participant", barmode="group",
                 hover_data={"value": False, "shown": True, **dict.fromkeys(HOVER_FIELDS, True)},
                 labels={"shown": metric}, title=f"best {metric} per participant ({better(metric)} is better)")
    fig.update_layout(yaxis_title=metric, xaxis_title=None, legend_title="participant")
    return legend_above(fig, 460)


def _show_runs(runs_dir, preset, metric: str, by: str) -> None:
    from IPython.display import display

    from labkit.views.plots import readable

    rows = load_board(runs_dir, preset)
    display(readable(side_by_side(rows, metric, by), metric=metric),
            readable(best_per_challenge(rows)), figure(rows, metric))


def _show_learning(runs_dir, by: str) -> None:
    """The learning tables, by team when `by` is team, else by participant (a machine does not
    learn)."""
    from IPython.display import display

    attempts = load_learning(runs_dir)
    if attempts.empty:
        print("no exercise attempts yet: they appear here as the room answers exercises")
    display(learning_view(attempts, "team" if by == "team" else "participant"),
            hardest_exercises(attempts))


def leaderboard_panel(runs_dir: str | os.PathLike | None = None, metric: str = "tokens_per_s",
                      preset: str | None = None) -> Any:
    """A view (runs or learning), a metric and a grouping to choose, and Refresh (reads the shared
    folder again, so the room's newest runs and attempts appear). Runs: the side-by-side table,
    the best per challenge, the bars. Learning: `learning_view` and `hardest_exercises`."""
    import ipywidgets as W

    check_choice("metric", metric, METRICS)
    view = W.ToggleButtons(options=["runs", "learning"], value="runs", description="view")
    pick = W.Dropdown(options=list(METRICS), value=metric, description="metric")
    by = W.Dropdown(options=["machine", "participant", "team"], value="machine", description="by")
    refresh = W.Button(description="Refresh", icon="refresh")
    output = W.Output()

    def redraw(_=None) -> None:
        pick.disabled = view.value == "learning"  # the learning view ranks no metric
        with output:
            output.clear_output(wait=True)
            if view.value == "runs":
                _show_runs(runs_dir, preset, pick.value, by.value)
            else:
                _show_learning(runs_dir, by.value)

    for control in (view, pick, by):
        control.observe(redraw, names="value")
    refresh.on_click(redraw)
    redraw()
    return W.VBox([W.HBox([view, pick, by, refresh]), output])
