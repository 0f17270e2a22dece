"""Packing's two figures, pure functions of frames: the padding fraction and useful tokens/s per
variant (a `packing` run's result rows), and each document's loss packed against padded
(`labkit.techniques.packing.document_loss_table`'s frame)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.config import ConfigError
from labkit.views.plots import legend_above

MEASURED, PREDICTED = "#264653", "#a8dadc"
VARIANT_COLORS = {"packed_naive": "#e76f51", "packed": "#2a9d8f"}


def _metric(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    rows = frame[(frame["metric"] == metric) & (frame["status"] == "ok")]
    return rows.drop_duplicates("variant", keep="last")


def throughput_figure(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Left: padding fraction per variant, measured beside predicted; right: useful (document)
    tokens/s per variant, measured. Traces: padding measured, padding predicted, useful tokens/s."""
    if not {"variant", "metric", "value", "predicted", "status"} <= set(frame.columns):
        raise ConfigError("not result rows: they need variant, metric, value, predicted and status")
    pad, speed = _metric(frame, "padding_fraction"), _metric(frame, "useful_tokens_per_s")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12)
    fig.add_bar(name="padding, measured", x=pad["variant"], y=pad["value"], marker_color=MEASURED, row=1, col=1)
    fig.add_bar(name="padding, predicted", x=pad["variant"], y=pad["predicted"], marker_color=PREDICTED,
                row=1, col=1)
    fig.add_bar(name="useful tokens/s", x=speed["variant"], y=speed["value"], marker_color="#e9c46a",
                text=[f"{v:,.0f}" for v in speed["value"]], textposition="outside", row=1, col=2)
    fig.update_yaxes(title_text="padding fraction (pads / tokens computed)", tickformat=".0%", row=1, col=1)
    fig.update_yaxes(title_text="document tokens / s", row=1, col=2)
    fig.update_layout(barmode="group", title=title or "Padding and useful throughput per variant")
    return legend_above(fig, 420)


def document_loss_figure(table: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Each document's loss packed (y) against padded, alone in its row (x): on the diagonal
    when the document saw only itself. Traces: the diagonal, then one per packed variant."""
    missing = [c for c in ("length", "padded", *VARIANT_COLORS) if c not in table.columns]
    if missing:
        raise ConfigError(f"not a document-loss table: it lacks {', '.join(missing)}; make one with "
                          "labkit.techniques.packing.document_loss_table")
    lo, hi = table[["padded", *VARIANT_COLORS]].min().min(), table[["padded", *VARIANT_COLORS]].max().max()
    fig = go.Figure([go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="each document alone",
                                line={"color": "#888", "dash": "dot"})])
    for variant, color in VARIANT_COLORS.items():
        fig.add_scatter(x=table["padded"], y=table[variant], mode="markers", name=variant,
                        marker={"color": color, "size": 6 + 14 * table["length"] / table["length"].max()},
                        text=[f"document {d}: {n} tokens" for d, n in zip(table["document"], table["length"])])
    fig.update_layout(title=title or "Per-document loss: packed against each document alone (padded)",
                      xaxis_title="padded: mean loss", yaxis_title="packed: mean loss")
    return legend_above(fig, 440)
