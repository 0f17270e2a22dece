"""Compressed gradients' figure, a pure function of a `grad_compression` run's result rows: per
variant, the bytes each rank moves for the gradient reduction (measured beside predicted), the
gradient's distance from fp32's beside the bound it is held to, and the loss after the steps
beside fp32's with its tolerance."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.config import ConfigError
from labkit.views.plots import legend_above

MEASURED, PREDICTED, BOUND = "#264653", "#a8dadc", "#e76f51"


def _metric(frame: pd.DataFrame, metric: str, rank: int = 0) -> pd.DataFrame:
    rows = frame[(frame["metric"] == metric) & (frame["status"] == "ok")]
    if "rank" in rows.columns:
        rows = rows[rows["rank"].fillna(rank) == rank]
    return rows.drop_duplicates("variant", keep="last").set_index("variant")


def compression_figure(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Left: grad_bus_bytes per variant (MiB, log: PowerSGD's are hundreds of times fewer),
    measured and predicted, the compression ratio over each bar. Middle: grad_rel_diff (log) and grad_tolerance. Right: |loss_delta| and
    loss_tolerance (log). Rank 0's rows. Traces: measured, predicted, error, bound, |delta|,
    tolerance."""
    if not {"variant", "metric", "value", "predicted", "status"} <= set(frame.columns):
        raise ConfigError("not result rows: they need variant, metric, value, predicted and status")
    sent, ratio = _metric(frame, "grad_bus_bytes"), _metric(frame, "compression_ratio")
    err, tol = _metric(frame, "grad_rel_diff"), _metric(frame, "grad_tolerance")
    delta, loss_tol = _metric(frame, "loss_delta"), _metric(frame, "loss_tolerance")
    names = list(sent.index)
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.09)
    fig.add_bar(name="bytes on the link, measured", x=names, y=sent["value"] / 2**20, marker_color=MEASURED,
                text=[f"{ratio['value'].get(v, float('nan')):.3g}x" for v in names],
                textposition="outside", row=1, col=1)
    fig.add_bar(name="predicted", x=names, y=sent["predicted"] / 2**20, marker_color=PREDICTED, row=1, col=1)
    lossy = [v for v in names if v in err.index and err.loc[v, "value"] > 0]
    fig.add_bar(name="gradient error (first step)", x=lossy, y=err.loc[lossy, "value"],
                marker_color="#2a9d8f", row=1, col=2)
    fig.add_scatter(name="its bound", x=lossy, y=tol.loc[lossy, "value"], mode="markers",
                    marker={"color": BOUND, "symbol": "line-ew-open", "size": 28, "line": {"width": 3}},
                    row=1, col=2)
    moved = [v for v in names if v in delta.index and delta.loc[v, "value"] != 0]
    fig.add_bar(name="|loss - fp32's| after the steps", x=moved, y=delta.loc[moved, "value"].abs(),
                marker_color="#e9c46a", row=1, col=3)
    fig.add_scatter(name="loss tolerance", x=moved, y=loss_tol.loc[moved, "value"], mode="markers",
                    marker={"color": BOUND, "symbol": "line-ew-open", "size": 28, "line": {"width": 3}},
                    showlegend=False, row=1, col=3)
    fig.update_yaxes(type="log", title_text="gradient bytes per rank per step (MiB, ring)", row=1, col=1)
    fig.update_yaxes(type="log", title_text="||g - g_fp32|| / ||g_fp32||", row=1, col=2)
    fig.update_yaxes(type="log", title_text="|loss delta| after the steps", row=1, col=3)
    fig.update_layout(barmode="group", title=title or "Gradient bytes sent, and what the compression cost")
    return legend_above(fig, 460)
