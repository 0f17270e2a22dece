"""Serving figures: tokens/s per user against tokens/s per device, and the same on the cost view.

Pure functions from `sla` result rows (a DataFrame) to plotly figures. One point per scheduler and
batch limit (a `batch_size` sweep), each from its backlog replay; the Pareto front (no other point
faster for the user AND for the device, or cheaper) is drawn as a line through its points.
Interactivity is on the x axis of both figures, as serving engineers plot it.
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from labkit.blocks.slo import pareto_front
from labkit.views.plots import PALETTE, legend_above, ok_rows

POINT_METRICS = ("user_tokens_per_s", "useful_tokens_per_s", "usd_per_million_tokens")
USER, DEVICE, COST = "tokens/s per user", "tokens/s per device", "USD per million tokens"


def serving_points(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per variant and batch limit: variant, batch_size, user_tokens_per_s,
    useful_tokens_per_s (per device), usd_per_million_tokens, `on_front` (the throughput front:
    per user and per device both maximised) and `on_cost_front` (per user maximised, cost
    minimised)."""
    rows = ok_rows(frame)
    rows = rows[rows["metric"].isin(POINT_METRICS)]
    rows = rows.assign(batch_size=rows["params"].map(lambda p: p["batch_size"]))
    points = rows.pivot_table(index=["variant", "batch_size"], columns="metric", values="value",
                              sort=False).reset_index()
    points = points.dropna(subset=list(POINT_METRICS))
    pairs = list(zip(points["user_tokens_per_s"], points["useful_tokens_per_s"]))
    costs = list(zip(points["user_tokens_per_s"], -points["usd_per_million_tokens"]))
    return points.assign(on_front=pareto_front(pairs), on_cost_front=pareto_front(costs))


def pareto_figure(frame: pd.DataFrame, *, cost: bool = False) -> go.Figure:
    """Tokens/s per device (or, `cost`, USD per million tokens) against tokens/s per user: a
    marker per variant and batch limit (labelled with it), the Pareto front as a line."""
    points = serving_points(frame)
    y, front = ("usd_per_million_tokens", "on_cost_front") if cost else ("useful_tokens_per_s", "on_front")
    fig = go.Figure()
    for i, (variant, sel) in enumerate(points.groupby("variant", sort=False)):
        fig.add_scatter(x=sel["user_tokens_per_s"], y=sel[y], mode="markers+text", name=variant,
                        text=[f"b={b}" for b in sel["batch_size"]], textposition="top center",
                        marker={"color": PALETTE[i % len(PALETTE)], "size": 10})
    edge = points[points[front]].sort_values("user_tokens_per_s")
    fig.add_scatter(x=edge["user_tokens_per_s"], y=edge[y], mode="lines", name="Pareto front",
                    line={"color": "black", "dash": "dash"})
    what = "cost per million tokens (lower is better)" if cost else "throughput per device"
    fig.update_layout(title=f"Serving: {what} against speed per user", xaxis_title=USER,
                      yaxis_title=COST if cost else DEVICE)
    return legend_above(fig, 460)


def cost_figure(frame: pd.DataFrame) -> go.Figure:
    """The cost view: USD per million tokens (at the run's `price_per_hour`) against tokens/s per
    user, the cheapest-for-each-speed front marked."""
    return pareto_figure(frame, cost=True)
