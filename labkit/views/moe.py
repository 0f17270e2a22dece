"""The mixture-of-experts figures, pure functions of a `moe` run's result rows: the dropped
share of assignments against the capacity factor (measured, predicted from the router's loads,
and uniform routing's expectation), and the bytes each rank sends against their formulas."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit import planner
from labkit.config import ConfigError
from labkit.views.plots import legend_above

MEASURED, PREDICTED, UNIFORM = "#264653", "#e76f51", "#8e7dbe"
BYTES = ("all_to_all_bytes", "offrank_bytes")


def _rows(frame: pd.DataFrame, metric: str, variant: str | None = None) -> pd.DataFrame:
    if not {"variant", "metric", "value", "predicted", "status", "params"} <= set(frame.columns):
        raise ConfigError("not result rows: they need variant, metric, value, predicted, status and params")
    rows = frame[(frame["metric"] == metric) & (frame["status"] == "ok")]
    if variant is not None:
        rows = rows[rows["variant"] == variant]
    return rows.assign(capacity_factor=rows["params"].map(lambda p: p["capacity_factor"]))


def drops_figure(frame: pd.DataFrame, *, variant: str = "ep", title: str = "") -> go.Figure:
    """Dropped share of the assignments against the capacity factor, the mean over ranks:
    measured (the router's kept mask), predicted (sum_e max(0, load_e - C) of its loads) and
    uniform routing's expectation (a line over the factors). Traces in that order."""
    rows = _rows(frame, "dropped_fraction", variant)
    if rows.empty:
        raise ConfigError(f"no dropped_fraction rows for variant {variant!r} in these results")
    points = rows.groupby("capacity_factor")[["value", "predicted"]].mean().reset_index()
    p = rows["params"].iloc[0]
    tokens, k, E = p["batch_size"] * p["seq_len"], p["experts_per_token"], p["num_experts"]
    grid = [0.5 + 0.05 * i for i in range(int((max(points["capacity_factor"].max(), 2.0) - 0.5) / 0.05) + 1)]
    fig = go.Figure()
    fig.add_scatter(x=points["capacity_factor"], y=points["value"], mode="markers+lines", name="measured",
                    marker={"color": MEASURED, "size": 10})
    fig.add_scatter(x=points["capacity_factor"], y=points["predicted"], mode="markers",
                    name="predicted from the loads",
                    marker={"color": PREDICTED, "size": 14, "symbol": "circle-open", "line": {"width": 2}})
    fig.add_scatter(x=grid, y=[planner.uniform_drop_fraction(tokens, k, E, f) for f in grid], mode="lines",
                    name=f"uniform routing ({tokens} tokens, top-{k} of {E})",
                    line={"color": UNIFORM, "dash": "dot"})
    fig.update_layout(title=title or f"Dropped assignments against the capacity factor ({variant})",
                      xaxis_title="capacity factor (C = ceil(factor x tokens x k / E))",
                      yaxis_title="dropped share of tokens x k", yaxis_tickformat=".1%")
    return legend_above(fig, 420)


def bytes_figure(frame: pd.DataFrame, *, variant: str = "ep", title: str = "") -> go.Figure:
    """Per rank, at the last capacity factor run: all-to-all bytes (CommCounter) beside the
    formula from the routing, and the bytes handed to other ranks beside uniform routing's."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("all-to-all S (CommCounter)", "sent to other ranks"))
    for col, metric in enumerate(BYTES, start=1):
        rows = _rows(frame, metric, variant)
        if rows.empty:
            raise ConfigError(f"no {metric} rows for variant {variant!r} in these results")
        last = rows[rows["capacity_factor"] == rows["capacity_factor"].iloc[-1]]
        rows = last.drop_duplicates("rank", keep="last")
        ranks = [f"rank {r}" for r in rows["rank"]]
        fig.add_bar(x=ranks, y=rows["value"] / 2**20, name="measured", marker_color=MEASURED,
                    showlegend=col == 1, row=1, col=col)
        fig.add_bar(x=ranks, y=rows["predicted"] / 2**20, name="predicted", marker_color=PREDICTED,
                    showlegend=col == 1, row=1, col=col)
    fig.update_yaxes(title_text="MiB per step", row=1, col=1)
    fig.update_layout(barmode="group", title=title or "Expert parallelism's traffic per rank, one step")
    return legend_above(fig, 420)
