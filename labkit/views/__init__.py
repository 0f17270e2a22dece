"""Views across runs: compare stored runs (other variants, other machines, other people), price
what was measured, and ask the planner which GPUs a model and technique fit on.

Pure functions from result frames (or planner inputs) to tables and plotly figures, plus thin
ipywidgets panels that only call them. Nothing here runs an experiment or invents a number:
prices are what the user enters (none by default), throughput is what a run measured, memory per
GPU is `labkit.planner.plan_report`'s prediction. plotly and ipywidgets are imported where used.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import pandas as pd

from labkit import hardware, planner
from labkit.views import plots as viz
from labkit.config import PRESETS, ConfigError
from labkit.results import format_number, load_results, load_runs

GIB = 2**30
TOKEN_METRICS = ("tokens_per_s", "useful_tokens_per_s")  # what a cost per token can come from
GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)  # the counts the fit table tries, fewest first
RUN_COLORS = ("#264653", "#e76f51", "#2a9d8f", "#8e7dbe", "#f4a261", "#457b9d", "#e9c46a", "#6d597a")


# --- Which machine a run ran on --------------------------------------------------------------------

# Every name for a machine or device is read from a fingerprint (`hardware.fingerprint()`, stored
# with every run as `env`) here: `device_identity`, `machine_name`, `machine_key`.

def gpu_names(env: dict | None) -> tuple[str | None, ...]:
    """The names of the fingerprint's GPUs, in index order."""
    env = env if isinstance(env, dict) else {}
    return tuple(g.get("name") for g in env.get("gpus") or [] if isinstance(g, dict))


def device_identity(env: dict | None, device: str | None = None) -> tuple[str, str | None]:
    """Which device a run measured on and what its fingerprint calls it: ("cpu", the CPU model)
    or ("cuda:N", the GPU's name); the name is None where the fingerprint does not hold it.
    `device` ("cpu", "cuda", "cuda:N") defaults to the fingerprint's own default device."""
    env = env if isinstance(env, dict) else {}
    device = str(device or env.get("device") or "cpu")
    if not device.startswith("cuda"):
        return "cpu", (env.get("cpu") or {}).get("model")
    index, names = int(device.split(":")[1]) if ":" in device else 0, gpu_names(env)
    return f"cuda:{index}", names[index] if index < len(names) else None


def machine_name(env: dict | None, device: str | None = None) -> str:
    """The device a run measured on, as people read it: the GPU's name for a `cuda` run, else
    the CPU model and core count (a CPU run on a GPU machine says CPU)."""
    device, name = device_identity(env, device)
    if device != "cpu":
        return name or "GPU"
    cores = ((env if isinstance(env, dict) else {}).get("cpu") or {}).get("num_cores")
    return f"CPU {name or '?'} ({cores or '?'} cores)"


def machine_key(env: dict | None) -> tuple:
    """What identifies the machine (not only its kind) behind a fingerprint, to match stored runs
    (a shared runs folder holds many machines'): host, default device, torch, GPU names."""
    env = env if isinstance(env, dict) else {}
    return env.get("hostname"), env.get("device"), env.get("torch"), gpu_names(env)


def short_id(run_id: str) -> str:
    """The run id's random suffix (6 hex digits): enough to tell runs apart in a legend."""
    return str(run_id).rsplit("-", 1)[-1]


def run_label(run_id: str, env: dict | None, device: str | None = None) -> str:
    return f"{machine_name(env, device)} · {short_id(run_id)}"


def _row_device(params: Any) -> str | None:
    return params.get("device") if isinstance(params, dict) else None


# --- 1. Comparison ---------------------------------------------------------------------------------

def run_table(runs_dir: str | os.PathLike | None = None) -> pd.DataFrame:
    """One row per stored run in `runs_dir` (any folder of run files: yours, or a colleague's
    copied in): run_id, experiment, date, device, machine (from the stored fingerprint), host,
    variants, status, rows, label. Newest first."""
    rows = []
    for rec in load_runs(runs_dir):
        env, device = rec.get("env") or {}, (rec.get("config") or {}).get("device")
        rows.append({"run_id": rec["run_id"], "experiment": rec["experiment"],
                     "date": rec["timestamp"], "device": device or env.get("device"),
                     "machine": machine_name(env, device), "host": env.get("hostname"),
                     "variants": ", ".join(dict.fromkeys(r.get("variant", "") for r in rec["rows"])),
                     "status": rec.get("status"), "rows": len(rec["rows"]),
                     "label": run_label(rec["run_id"], env, device)})
    columns = ["run_id", "experiment", "date", "device", "machine", "host", "variants", "status",
               "rows", "label"]
    return pd.DataFrame(rows, columns=columns).iloc[::-1].reset_index(drop=True)


def latest_runs(frame: pd.DataFrame, experiment: str | None = None, n: int = 3) -> list[str]:
    """The ids of the `n` newest runs (of `experiment`, default: the newest run's experiment)
    that measured something."""
    ok = viz.ok_rows(frame)
    if ok.empty:
        return []
    experiment = experiment or ok.sort_values("timestamp")["experiment"].iloc[-1]
    ok = ok[ok["experiment"] == experiment]
    ids = ok.sort_values(["timestamp", "run_id"]).drop_duplicates("run_id", keep="last")["run_id"]
    return list(ids)[-n:]


def _check_run_ids(frame: pd.DataFrame, run_ids: list[str]) -> None:
    known = list(dict.fromkeys(frame["run_id"]))
    if not run_ids:
        raise ConfigError(f"choose at least one run; valid: {', '.join(known) or 'none stored'}")
    unknown = [r for r in run_ids if r not in known]
    if unknown:
        raise ConfigError(f"unknown run {unknown[0]!r}; valid: {', '.join(known) or 'none stored'}")


def run_rows(frame: pd.DataFrame, run_id: str) -> pd.DataFrame:
    """A run's measured rows (rank 0 of a multi-process run), each labelled by its sweep point."""
    rows = viz.ok_rows(viz.rank0(frame[frame["run_id"] == run_id]))
    return rows.assign(point=viz.point_labels(rows))


def compare_runs(frame: pd.DataFrame, run_ids: list[str], *, memory: str = "peak_mem_bytes",
                 throughput: str | None = None, title: str = "") -> Any:
    """The chosen runs side by side on the same axes: `memory` (MiB) and `throughput` (default:
    the first of tokens_per_s, useful_tokens_per_s, requests_per_s they measured) per variant
    and sweep point; one legend group (one colour) per run, labelled by machine and short id."""
    from plotly.subplots import make_subplots

    _check_run_ids(frame, run_ids)
    chosen = {r: run_rows(frame, r) for r in run_ids}
    measured = set().union(*(set(rows["metric"]) for rows in chosen.values()))
    throughput = throughput or next((m for m in viz.THROUGHPUT_METRICS if m in measured), None)
    metrics = [m for m in (memory, throughput) if m]
    points = list(dict.fromkeys(p for rows in chosen.values() for p in rows["point"]))
    fig = make_subplots(rows=1, cols=len(metrics), horizontal_spacing=0.12)
    scales = {m: viz.byte_unit(pd.concat([r.loc[r["metric"] == m, "value"] for r in chosen.values()]))
              if m.endswith("_bytes") else (1, "") for m in metrics}
    for i, (run_id, rows) in enumerate(chosen.items()):
        first = rows.iloc[0] if not rows.empty else None
        label = run_label(run_id, first["env"] if first is not None else {},
                          _row_device(first["params"]) if first is not None else None)
        for col, metric in enumerate(metrics, start=1):
            sel = rows[rows["metric"] == metric].drop_duplicates("point").set_index("point")
            values = sel["value"].reindex(points)
            fig.add_bar(x=points, y=values / scales[metric][0], name=label,
                        legendgroup=label, showlegend=col == 1, offsetgroup=str(i),
                        hovertext=viz.hover_values(metric, values), hovertemplate=viz.HOVER,
                        marker_color=RUN_COLORS[i % len(RUN_COLORS)], row=1, col=col)
    for col, metric in enumerate(metrics, start=1):
        unit = scales[metric][1]
        fig.update_yaxes(title_text=f"{metric} ({unit})" if unit else f"{metric} (higher is better)",
                         side="right" if col == 2 else "left", row=1, col=col)
    fig.update_layout(barmode="group", title=title or "stored runs compared")
    return viz.legend_above(fig, 460)


# --- Your device against the reference results (data/reference/, from `labkit selfcheck`) --------

REFERENCES = ("h200",)  # data/reference/<name>.json (the checks) and <name>-runs/ (the runs)


def _reference_path(name: str, suffix: str) -> Any:
    if name not in REFERENCES:
        raise ConfigError(f"unknown reference {name!r}; valid: {', '.join(REFERENCES)}")
    return hardware.DATA_DIR / "reference" / f"{name}{suffix}"


def reference_results(name: str = "h200") -> pd.DataFrame:
    """The rows of the runs behind a reference selfcheck (a results store of its own)."""
    return load_results(_reference_path(name, "-runs"))


def reference_overlay(frame: pd.DataFrame, experiment: str, name: str = "h200") -> Any:
    """Your newest run of `experiment` beside the reference's run of it, on the same axes; a line
    saying so when either has none."""
    ref = reference_results(name)
    mine, theirs = latest_runs(frame, experiment, n=1), latest_runs(ref, experiment, n=1)
    if not mine or not theirs:
        missing = "you have no run" if not mine else f"the {name} reference has no run"
        return f"{experiment}: {missing} of it to compare"
    both = pd.concat([frame[frame["run_id"] == mine[0]], ref[ref["run_id"] == theirs[0]]])
    return compare_runs(both, [mine[0], theirs[0]], title=f"{experiment}: yours against {name}")


def selfcheck_table(mine: dict | None = None, name: str = "h200") -> pd.DataFrame:
    """The reference's selfcheck checks, with yours beside them when `mine` (a `labkit selfcheck
    --out` record) is given: metric, expected, the reference's measured value and verdict."""
    ref = json.loads(_reference_path(name, ".json").read_text())
    table = pd.DataFrame([{"experiment": c["experiment"], "metric": c["metric"],
                           "expected": c.get("expected", ""), name: c.get("measured"),
                           f"{name} passed": c.get("passed")} for c in ref["checks"]])
    if mine:
        yours = {(c["experiment"], c["metric"]): c for c in mine["checks"]}
        same = [yours.get(k, {}) for k in zip(table.experiment, table.metric)]
        table["yours"] = [c.get("measured") for c in same]
        table["you passed"] = [c.get("passed") for c in same]
    return table


# --- 2. Cost ---------------------------------------------------------------------------------------

def _check_price(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0:
        raise ConfigError(f"{name}={value!r} must be a non-negative number per hour, or None (not priced)")


def cost_table(frame: pd.DataFrame, price_per_gpu_hour: float | None = None, num_gpus: int = 1, *,
               cpu_price_per_hour: float | None = None) -> pd.DataFrame:
    """For every measured configuration (run, variant, sweep point) with a tokens-per-second row:
    cost per million tokens = price per hour x devices / 3600 / tokens_per_s x 1e6, in the
    currency of the price given. GPU rows use `price_per_gpu_hour` x `num_gpus` (the devices
    that produced that row's throughput: one for a rank's row); CPU rows use
    `cpu_price_per_hour` (the machine's). No price given: no cost, and the note says so."""
    _check_price("price_per_gpu_hour", price_per_gpu_hour)
    _check_price("cpu_price_per_hour", cpu_price_per_hour)
    if isinstance(num_gpus, bool) or not isinstance(num_gpus, int) or num_gpus < 1:
        raise ConfigError(f"num_gpus={num_gpus!r} must be a whole number >= 1")
    rows = viz.ok_rows(viz.rank0(frame)) if not frame.empty else frame
    rows = rows[rows["metric"].isin(TOKEN_METRICS)]
    return pd.DataFrame([_cost_row(r, price_per_gpu_hour, num_gpus, cpu_price_per_hour)
                         for r in rows.assign(point=viz.point_labels(rows)).itertuples()],
                        columns=["run_id", "label", "experiment", "variant", "metric",
                                 "measured_tokens_per_s", "device", "price_per_hour", "devices",
                                 "cost_per_million_tokens", "note"])


def _cost_row(r: Any, gpu_price: float | None, num_gpus: int, cpu_price: float | None) -> dict:
    device = _row_device(r.params) or "cpu"
    on_gpu = str(device).startswith("cuda")
    price, devices = (gpu_price, num_gpus) if on_gpu else (cpu_price, 1)
    unit = "per GPU-hour" if on_gpu else "per CPU-machine-hour"
    if price is None:
        cost = float("nan")
        note = ("GPU run: enter price_per_gpu_hour to price it" if on_gpu else
                "CPU run: enter cpu_price_per_hour to price it") + " (no price is assumed)"
    else:
        cost = price * devices / 3600 / r.value * 1e6
        note = f"{price:g} {unit} x {devices} / 3600 s / {format_number(r.value)} tokens/s x 1e6"
    return {"run_id": r.run_id, "label": run_label(r.run_id, r.env, device), "experiment": r.experiment,
            "variant": r.point, "metric": r.metric, "measured_tokens_per_s": r.value,
            "device": device, "price_per_hour": price, "devices": devices,
            "cost_per_million_tokens": cost, "note": note}


# --- 3. Hardware fit -------------------------------------------------------------------------------

def fit_table(model: str = "llama-2-7b", *, precision: str = "bf16_pure", zero_stage: int = 3,
              checkpointing: str = "full", tp: int = 1, pp: int = 1, batch_size: int = 1,
              seq_len: int | None = None, optimizer: str = "adamw",
              gpu_counts: tuple[int, ...] = GPU_COUNTS) -> pd.DataFrame:
    """For each GPU in `data/gpus.json`: the fewest GPUs of that type (of `gpu_counts` that
    tp x pp divides) on which one training step of `model` fits, by the planner's predicted peak
    per GPU (`plan_report`, the same answer as `labkit plan`); data parallelism (with the ZeRO
    stage) fills the rest. Memory is the datasheet's as marketed, taken as GiB; the CUDA context
    and fragmentation are not counted, so keep some headroom."""
    if model not in PRESETS:
        raise ConfigError(f"unknown model {model!r}; valid: {', '.join(PRESETS)}")
    counts = [n for n in gpu_counts if n % (tp * pp) == 0]
    if not counts:
        raise ConfigError(f"tp x pp = {tp * pp} divides none of gpu_counts {tuple(gpu_counts)}")
    settings = dict(model=model, precision=precision, zero_stage=zero_stage, checkpointing=checkpointing,
                    tp=tp, pp=pp, batch_size=batch_size, seq_len=seq_len, optimizer=optimizer)
    # The per-GPU prediction does not depend on the GPU's memory: one plan per count.
    per_gpu = {n: planner.plan_report(**settings, gpus=n)["per_gpu"]["total_bytes"] for n in counts}
    return pd.DataFrame([_fit_row(spec, per_gpu) for spec in hardware.load_gpu_specs()])


def _fit_row(spec: dict, per_gpu: dict[int, int]) -> dict:
    memory = spec["memory_gib"] * GIB
    n = next((n for n, total in per_gpu.items() if total <= memory), None)
    shown = per_gpu[n if n is not None else max(per_gpu)]
    return {"gpu": spec["name"], "memory_gib": spec["memory_gib"], "num_gpus": n,
            "fits": n is not None, "predicted_gib_per_gpu": round(shown / GIB, 2),
            "headroom_gib": round((memory - shown) / GIB, 2),
            "note": "" if n is not None else f"does not fit on {max(per_gpu)} (predicted at that count)"}


def fit_figure(table: pd.DataFrame, *, title: str = "") -> Any:
    """The predicted peak per GPU at the fewest GPUs that fit (bars, labelled "x N"), beside each
    GPU's memory (dashes); red bars do not fit even on the most GPUs tried."""
    import plotly.graph_objects as go

    text = [f"x {int(n)}" if ok else "no fit" for n, ok in zip(table["num_gpus"], table["fits"])]
    fig = go.Figure()
    fig.add_bar(x=table["gpu"], y=table["predicted_gib_per_gpu"], text=text, textposition="outside",
                name="predicted GiB per GPU",
                marker_color=["#2a9d8f" if f else "#e63946" for f in table["fits"]])
    fig.add_scatter(x=table["gpu"], y=table["memory_gib"], mode="markers", name="GPU memory (GiB)",
                    marker={"symbol": "line-ew-open", "size": 24, "color": "black", "line": {"width": 3}})
    fig.update_layout(title=title or "fewest GPUs that fit, and the predicted peak per GPU there",
                      yaxis_title="GiB per GPU")
    return viz.legend_above(fig, 480)


# --- 4. Panels: thin front-ends over the functions above ------------------------------------------

def _show(output: Any, make: Any) -> None:
    try:
        items = make()
    except ConfigError as e:  # bad input: one line in the panel
        items = [f"error: {e}"]
    viz.show_items(output, [viz.readable(i) if isinstance(i, pd.DataFrame) else i for i in items])


def comparison_panel(runs_dir: str | os.PathLike | None = None) -> Any:
    """Pick stored runs (newest first); their overlay is redrawn on every change."""
    import ipywidgets as W

    frame, table = load_results(runs_dir), run_table(runs_dir)
    options = [(f"{r.experiment} · {r.label} · {r.date}", r.run_id) for r in table.itertuples()]
    select = W.SelectMultiple(options=options, value=tuple(latest_runs(frame)), rows=8,
                              description="runs", layout=W.Layout(width="95%"))
    output = W.Output()

    def redraw(_=None) -> None:
        _show(output, lambda: [compare_runs(frame, list(select.value))] if options
              else ["no runs stored yet: run an experiment first"])

    select.observe(redraw, names="value")
    redraw()
    return W.VBox([select, output])


def cost_panel(frame: pd.DataFrame) -> Any:
    """Prices per hour (0 means not priced: no price is assumed) -> the cost table."""
    import ipywidgets as W

    style = {"style": {"description_width": "initial"}}
    gpu = W.BoundedFloatText(value=0.0, min=0, max=1e6, description="price per GPU-hour (0: none)", **style)
    cpu = W.BoundedFloatText(value=0.0, min=0, max=1e6, description="price per CPU-hour (0: none)", **style)
    count = W.BoundedIntText(value=1, min=1, max=4096, description="GPUs per row", **style)
    output = W.Output()

    def redraw(_=None) -> None:
        _show(output, lambda: [cost_table(frame, gpu.value or None, count.value,
                                          cpu_price_per_hour=cpu.value or None)])

    for w in (gpu, cpu, count):
        w.observe(redraw, names="value")
    redraw()
    return W.VBox([W.HBox([gpu, cpu, count]), output])


def fit_panel(model: str = "llama-2-7b") -> Any:
    """Model, precision, ZeRO stage, checkpointing and tp -> the fit table and its figure."""
    import ipywidgets as W

    style = {"style": {"description_width": "initial"}}
    controls = {
        "model": W.Dropdown(options=list(PRESETS), value=model, description="model", **style),
        "precision": W.Dropdown(options=list(planner.PRECISIONS), value="bf16_pure",
                                description="precision", **style),
        "zero_stage": W.Dropdown(options=list(planner.ZERO_STAGES), value=3, description="ZeRO", **style),
        "checkpointing": W.Dropdown(options=list(planner.CHECKPOINTING), value="full",
                                    description="checkpointing", **style),
        "tp": W.Dropdown(options=[1, 2, 4, 8], value=1, description="tp", **style)}
    output = W.Output()

    def redraw(_=None) -> None:
        def items() -> list:
            values = {k: w.value for k, w in controls.items()}
            table = fit_table(values.pop("model"), **values)
            return [fit_figure(table, title=f"{controls['model'].value}: fewest GPUs that fit"), table]
        _show(output, items)

    for w in controls.values():
        w.observe(redraw, names="value")
    redraw()
    return W.VBox([W.HBox(list(controls.values())), output])
