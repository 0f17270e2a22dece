"""Fine-tuning's two figures, pure functions of frames: the longest sequence each variant fits
(`labkit.techniques.finetune.frontier`'s frame), and the memory by category per variant (the
result rows of a `finetune` run, measured beside the planner's)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from labkit.config import ConfigError
from labkit.views.plots import byte_unit, legend_above

# The step's memory by what it holds, bottom to top of each bar.
CATEGORIES = ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes")
CATEGORY_COLORS = dict(zip(CATEGORIES, ("#264653", "#e76f51", "#8e7dbe", "#2a9d8f")))
FRONTIER_COLUMNS = ("variant", "max_seq_len", "predicted_max_seq_len")


def frontier_figure(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Max sequence length per variant: measured and predicted bars side by side. Traces:
    measured, predicted."""
    missing = [c for c in FRONTIER_COLUMNS if c not in frame.columns]
    if missing:
        raise ConfigError(f"not a frontier frame: it lacks {', '.join(missing)}; make one with "
                          "labkit.techniques.finetune.frontier")
    fig = go.Figure([
        go.Bar(name="measured", x=frame["variant"], y=frame["max_seq_len"], marker_color="#264653",
               text=frame["max_seq_len"], textposition="outside"),
        go.Bar(name="predicted (planner)", x=frame["variant"], y=frame["predicted_max_seq_len"],
               marker_color="#a8dadc", text=frame["predicted_max_seq_len"], textposition="outside")])
    budget = f" in {frame['budget_gib'].iloc[0]:.3g} GiB" if "budget_gib" in frame and len(frame) else ""
    fig.update_layout(barmode="group", title=title or f"Longest sequence that fits{budget}",
                      yaxis_title="max seq_len (tokens)", xaxis_title="variant")
    return legend_above(fig, 420)


def memory_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """(variant, category, source, bytes): each category's measured value and its prediction, from
    a run's result rows (metric, value, predicted), in the run's variant order."""
    rows = frame[frame["metric"].isin(CATEGORIES) & (frame["status"] == "ok")]
    measured = rows.assign(source="measured", bytes=rows["value"])
    predicted = rows.assign(source="predicted", bytes=rows["predicted"])
    out = pd.concat([measured, predicted])[["variant", "metric", "source", "bytes"]]
    return out.rename(columns={"metric": "category"}).dropna(subset=["bytes"])


def memory_figure(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Stacked bars by category, two per variant (measured, predicted), from a run's result rows.
    Traces: one per category (the legend groups measured and predicted)."""
    if not {"variant", "metric", "value", "predicted", "status"} <= set(frame.columns):
        raise ConfigError("not result rows: they need variant, metric, value, predicted and status")
    rows = memory_rows(frame)
    variants = list(dict.fromkeys(rows["variant"]))
    scale, unit = byte_unit(rows.groupby(["variant", "source"])["bytes"].sum())
    x = [[v for v in variants for _ in ("measured", "predicted")],
         [s for _ in variants for s in ("measured", "predicted")]]
    fig = go.Figure()
    for category in CATEGORIES:
        got = rows[rows["category"] == category].set_index(["variant", "source"])["bytes"]
        y = [got.get((v, s), 0.0) / scale for v, s in zip(*x)]
        fig.add_bar(name=category.removesuffix("_bytes"), x=x, y=y,
                    marker_color=CATEGORY_COLORS[category])
    fig.update_layout(barmode="stack", title=title or "Memory by category, measured and predicted",
                      yaxis_title=unit)
    return legend_above(fig, 440)
