"""Plots and tables: pure functions from result rows (a DataFrame) to plotly figures or frames.
Nothing here runs an experiment."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

MEMORY_METRICS = ("peak_mem_bytes", "param_bytes", "optimizer_bytes", "activation_bytes",
                  "saved_weight_copy_bytes", "kv_bytes")
THROUGHPUT_METRICS = ("tokens_per_s", "requests_per_s")
COLORS = dict(zip(MEMORY_METRICS + THROUGHPUT_METRICS,
                  ("#264653", "#e76f51", "#8e7dbe", "#457b9d", "#f4a261", "#e9c46a", "#2a9d8f",
                   "#2a9d8f")))
MIB = 2**20


def ok_rows(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["status"] == "ok") & frame["metric"].notna()]


def not_run(frame: pd.DataFrame) -> pd.DataFrame:
    """One line per variant that did not run: variant, status, message."""
    bad = frame[frame["status"] != "ok"]
    return bad.drop_duplicates("variant")[["variant", "status", "message"]].reset_index(drop=True)


def variant_comparison(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Memory (MiB, by kind) and throughput of each variant; predictions as open diamonds."""
    rows = ok_rows(frame)
    variants = list(dict.fromkeys(rows["variant"]))
    throughput = next((m for m in THROUGHPUT_METRICS if (rows["metric"] == m).any()), None)
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "memory (MiB)", f"{throughput or 'throughput'} (higher is better)"))
    for metric in MEMORY_METRICS:
        sel = rows[rows["metric"] == metric].set_index("variant").reindex(variants)
        if sel["value"].notna().any():
            fig.add_bar(x=variants, y=sel["value"] / MIB, name=metric, legendgroup=metric,
                        offsetgroup=metric, marker_color=COLORS[metric], row=1, col=1)
            _add_predicted(fig, variants, sel["predicted"] / MIB, metric, col=1)
    if throughput:
        sel = rows[rows["metric"] == throughput].set_index("variant").reindex(variants)
        fig.add_bar(x=variants, y=sel["value"], name=throughput, offsetgroup=throughput,
                    marker_color=COLORS[throughput], row=1, col=2)
        _add_predicted(fig, variants, sel["predicted"], throughput, col=2)
    skipped = not_run(frame)
    note = "; ".join(f"{r.variant}: {r.status}" for r in skipped.itertuples())
    fig.update_layout(barmode="group", scattermode="group", title=title + (f"  (not run: {note})" if note else ""),
                      height=420, legend={"orientation": "h", "y": -0.2})
    return fig


def _add_predicted(fig: go.Figure, variants: list[str], predicted: pd.Series, metric: str, col: int) -> None:
    if predicted.notna().any():
        fig.add_scatter(x=variants, y=predicted, mode="markers", name=f"{metric} predicted",
                        legendgroup=metric, offsetgroup=metric, row=1, col=col,
                        marker={"symbol": "diamond-open", "size": 13, "color": "black",
                                "line": {"width": 2}})


def sweep_lines(frame: pd.DataFrame, x: str, metric: str) -> go.Figure:
    """`metric` against a swept config field `x`, one line per variant (needs expanded params)."""
    rows = ok_rows(frame)
    rows = rows[rows["metric"] == metric]
    fig = go.Figure()
    for variant, sel in rows.groupby("variant", sort=False):
        sel = sel.sort_values(x)
        fig.add_scatter(x=sel[x], y=sel["value"], mode="lines+markers", name=variant)
    fig.update_layout(xaxis_title=x, yaxis_title=metric, height=380)
    return fig


def predicted_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Measured beside predicted, for every metric that has a prediction."""
    rows = ok_rows(frame)
    rows = rows[rows["predicted"].notna()]
    table = rows[["variant", "metric", "value", "predicted", "unit"]].rename(columns={"value": "measured"})
    ratio = table["measured"] / table["predicted"].where(table["predicted"] != 0)
    return table.assign(measured_over_predicted=ratio.round(3)).reset_index(drop=True)


def metric_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Variants as columns, metrics as rows: the numbers behind the figure."""
    rows = ok_rows(frame)
    return rows.pivot_table(index="metric", columns="variant", values="value", sort=False)
