"""Context parallelism's figures, pure functions of frames: bytes sent and activations per rank
by variant, the causal work per rank (ring against zig-zag), and how bytes sent per rank scale
when the sequence grows with the ranks (`labkit.techniques.context_parallel.scaling_table`'s
frame, with a run's measured points on it)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.config import ConfigError
from labkit.views.plots import byte_unit, legend_above

MEASURED, PREDICTED = "#264653", "#a8dadc"
LINES = {"ring": "#e76f51", "ulysses": "#2a9d8f"}
RINGS = {"ring": "#e76f51", "ring_zigzag": "#2a9d8f"}


def _check(frame: pd.DataFrame) -> None:
    if not {"variant", "metric", "value", "predicted", "status", "rank"} <= set(frame.columns):
        raise ConfigError("not result rows: they need variant, metric, value, predicted, status and rank")


def _rows(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    rows = frame[(frame["metric"] == metric) & (frame["status"] == "ok")]
    return rows.drop_duplicates(["variant", "rank"], keep="last")


def per_rank_figure(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Rank 0's bytes sent in one step (left) and bytes saved for backward (right) per variant,
    measured beside predicted. Traces: sent measured, sent predicted, saved measured, saved predicted."""
    _check(frame)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12)
    for col, (metric, label) in enumerate((("comm_bus_bytes", "sent"), ("activation_bytes", "saved")), 1):
        rows = _rows(frame, metric)
        rows = rows[rows["rank"] == rows["rank"].min()]
        scale, unit = byte_unit(pd.concat([rows["value"], rows["predicted"]]))
        fig.add_bar(name=f"{label}, measured", x=rows["variant"], y=rows["value"] / scale,
                    marker_color=MEASURED, row=1, col=col)
        fig.add_bar(name=f"{label}, predicted", x=rows["variant"], y=rows["predicted"] / scale,
                    marker_color=PREDICTED, row=1, col=col)
        axis = "bytes sent per step" if col == 1 else "saved for backward"
        fig.update_yaxes(title_text=f"{axis} ({unit})", row=1, col=col)
    fig.update_layout(barmode="group", title=title or "Per rank: bytes sent in a step, bytes saved for backward")
    return legend_above(fig, 420)


def balance_figure(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Allowed (query, key) pairs each rank's forward computed, per sequence and head, for the
    contiguous ring and the zig-zag one: measured bars, predicted markers. Traces: per variant,
    measured then predicted."""
    _check(frame)
    rows = _rows(frame, "attended_pairs")
    fig = go.Figure()
    for variant, color in RINGS.items():
        mine = rows[rows["variant"] == variant].sort_values("rank")
        fig.add_bar(name=f"{variant}, measured", x=mine["rank"], y=mine["value"], marker_color=color)
        fig.add_scatter(name=f"{variant}, predicted", x=mine["rank"], y=mine["predicted"], mode="markers",
                        marker={"color": color, "symbol": "line-ew-open", "size": 28, "line": {"width": 3}})
    fig.update_layout(barmode="group", xaxis={"title": "rank", "dtick": 1},
                      yaxis_title="attended (query, key) pairs",
                      title=title or "Causal work per rank: contiguous blocks against zig-zag")
    return legend_above(fig, 420)


def scaling_figure(table: pd.DataFrame, frame: pd.DataFrame | None = None, *, title: str = "") -> go.Figure:
    """Bytes each rank sends in one step as the sequence grows with the ranks (tokens per rank
    fixed): ring and Ulysses, predicted lines; a run's measured rank-0 figures as markers at its
    rank count. Traces: ring, ulysses, then the measured markers."""
    if not {"ranks", "ring", "ulysses"} <= set(table.columns):
        raise ConfigError("not a scaling table: make one with "
                          "labkit.techniques.context_parallel.scaling_table")
    scale, unit = byte_unit(table[["ring", "ulysses"]].stack())
    fig = go.Figure()
    for variant, color in LINES.items():
        fig.add_scatter(name=f"{variant}, predicted", x=table["ranks"], y=table[variant] / scale,
                        mode="lines+markers", line={"color": color})
    if frame is not None:
        rows = _rows(frame, "comm_bus_bytes")
        rows = rows[(rows["rank"] == 0) & rows["variant"].isin(LINES)]
        ranks = [len(frame.loc[frame["variant"] == v, "rank"].unique()) for v in rows["variant"]]
        fig.add_scatter(name="measured (this run)", x=ranks, y=rows["value"] / scale, mode="markers",
                        marker={"color": MEASURED, "size": 12, "symbol": "x"}, text=rows["variant"])
    fig.update_layout(xaxis={"title": "ranks (sequence = ranks x tokens per rank)", "type": "log",
                             "tickvals": list(table["ranks"])},
                      yaxis_title=f"bytes sent per rank per step ({unit})",
                      title=title or "Sequence and ranks grow together: Ulysses stays flat, the ring grows")
    return legend_above(fig, 420)
