"""Two recipes' memory over one training step, on one x axis: a pure function from the tidy
frame of `labkit.harness.timeline.compare_timelines` to a plotly figure.

PyTorch's memory_viz shows one snapshot at a time, and people compare two runs with a ruler
(https://github.com/pytorch/pytorch/issues/120245). Here each recipe gets a panel of stacked
areas by category; the panels share both axes, and each step's phases are rescaled to the same
width (forward over [0, 1], backward over [1, 2], the optimizer over [2, 3]), so the marks line
up whatever each phase's number of allocations. The planner's predicted peak of each recipe is
a dashed line in its panel, labelled with its value.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.config import ConfigError
from labkit.measure.timeline import CATEGORIES, PHASES
from labkit.views.plots import byte_unit, legend_above

CATEGORY_COLORS = dict(zip(CATEGORIES, ("#264653", "#e76f51", "#8e7dbe", "#2a9d8f", "#e9c46a")))
PEAK_COLOR = "#d62828"
NEEDED = ("recipe", "sample", "phase", "category", "bytes", "total_bytes", "predicted_peak_bytes")
MAX_SAMPLES = 800  # drawn per recipe (`thinned`)


def aligned_x(samples: pd.Series, phases: pd.Series) -> np.ndarray:
    """Each sample's place on the common axis: phase k's samples (its first occurrence to the
    next phase's) spread over [k, k + 1]; the resident state before the step sits at 0. With
    several micro-batches, `backward` runs from the first backward to the optimizer."""
    samples = samples.to_numpy()
    bounds = []
    for phase in PHASES:
        hits = samples[(phases == phase).to_numpy()]
        bounds.append(hits.min() if len(hits) else (bounds[-1] if bounds else samples.min()))
    bounds.append(samples.max() + 1)  # the step's end
    ticks = np.arange(len(bounds), dtype=float)
    return np.interp(samples, np.maximum.accumulate(np.asarray(bounds, dtype=float)), ticks)


def timeline_figure(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """One panel per recipe (in the frame's order), stacked areas by category on the aligned
    axis, the phase marks as vertical lines and each recipe's predicted peak as a line with its
    value. Traces: one per category per recipe, then one per predicted peak."""
    missing = [c for c in NEEDED if c not in frame.columns]
    if missing:
        raise ConfigError(f"not a timeline frame: it lacks {', '.join(missing)}; "
                          "make one with labkit.harness.timeline.compare_timelines")
    recipes = list(dict.fromkeys(frame["recipe"]))
    scale, unit = byte_unit(pd.concat([frame["total_bytes"], frame["predicted_peak_bytes"]]))
    fig = make_subplots(rows=len(recipes), cols=1, shared_xaxes=True, vertical_spacing=0.06)
    fig.update_yaxes(matches="y", rangemode="tozero")  # one byte scale for every panel
    for row, recipe in enumerate(recipes, start=1):
        _add_areas(fig, frame[frame["recipe"] == recipe], row, scale, unit)
    for row, recipe in enumerate(recipes, start=1):
        _add_peak(fig, frame[frame["recipe"] == recipe], row, scale, unit)
        fig.update_yaxes(title_text=f"{recipe} ({unit})", row=row, col=1)
    for k, phase in enumerate(PHASES):
        fig.add_vline(x=k, line={"color": "grey", "dash": "dot", "width": 1})
    fig.update_xaxes(tickvals=[k + 0.5 for k in range(len(PHASES))], ticktext=list(PHASES),
                     range=[0, len(PHASES)], row=len(recipes), col=1)
    fig.update_layout(title=title or "memory over one training step, by category")
    return legend_above(fig, 260 + 220 * len(recipes))


def thinned(rows: pd.DataFrame, most: int = MAX_SAMPLES) -> pd.DataFrame:
    """One recipe's rows at no more than about `most` samples: every k-th, each phase's first and
    last and the peak kept (an eager 8-bit optimizer step allocates thousands of times, and a
    report page holds every drawn point)."""
    samples = rows["sample"].drop_duplicates()
    if len(samples) <= most:
        return rows
    totals = rows.drop_duplicates("sample")
    keep = set(samples.iloc[::-(-len(samples) // most)])
    keep |= set(totals.groupby("phase", sort=False)["sample"].agg(["first", "last"]).to_numpy().ravel())
    keep.add(totals.loc[totals["total_bytes"].idxmax(), "sample"])
    return rows[rows["sample"].isin(keep)]


def _add_areas(fig: go.Figure, rows: pd.DataFrame, row: int, scale: float, unit: str) -> None:
    rows = thinned(rows)
    for category in CATEGORIES:
        sel = rows[rows["category"] == category].sort_values("sample")
        sel = pd.concat([sel, sel.iloc[-1:]])  # the last state holds to the step's end
        x = aligned_x(sel["sample"], sel["phase"])
        x[-1] = len(PHASES)
        fig.add_scatter(x=x, y=sel["bytes"] / scale, name=category, legendgroup=category,
                        showlegend=row == 1, stackgroup=f"recipe{row}", line_shape="hv",
                        line={"width": 0.5, "color": CATEGORY_COLORS[category]},
                        # numbers only, so plotly stores them as typed arrays: a report
                        # notebook of three recipes' steps stays small (the x axis names phases)
                        customdata=sel["sample"].to_numpy(),
                        hovertemplate=(f"{category}: %{{y:.2f}} {unit}<br>sample %{{customdata}}"
                                       "<extra></extra>"),
                        row=row, col=1)


def _add_peak(fig: go.Figure, rows: pd.DataFrame, row: int, scale: float, unit: str) -> None:
    """The predicted peak as a line across the step (a trace, so the legend names it), and the
    measured peak beside it in words. No prediction: the line is absent and the words say so."""
    predicted = pd.to_numeric(rows["predicted_peak_bytes"], errors="coerce").iloc[0]
    measured = rows["total_bytes"].max()
    recipe = rows["recipe"].iloc[0]
    if pd.notna(predicted):
        label = f"predicted peak ({recipe}): {predicted / scale:.2f} {unit}"
        fig.add_scatter(x=[0, len(PHASES)], y=[predicted / scale] * 2, mode="lines+text",
                        name=label, text=[label, ""], textposition="top right",
                        line={"color": PEAK_COLOR, "dash": "dash", "width": 1.5},
                        hoverinfo="name", row=row, col=1)
        words = (f"measured peak {measured / scale:.2f} {unit}, predicted "
                 f"{predicted / scale:.2f} {unit} ({100 * (predicted / measured - 1):+.1f}%)")
    else:
        words = f"measured peak {measured / scale:.2f} {unit}; the planner has no prediction"
    axis = "" if row == 1 else str(row)
    fig.add_annotation(text=words, xref=f"x{axis} domain", yref=f"y{axis} domain", x=0.99, y=0.02,
                       xanchor="right", yanchor="bottom", showarrow=False, font={"size": 11})


def ledger_figure(ledger: pd.DataFrame) -> go.Figure:
    """A recipe's memory ledger (`labkit.harness.ledger.memory_ledger`) as two stacked bars, the
    measured peak and the predicted one, one colour per category (the timeline's colours, in
    its order); each category's residual in its hover text."""
    scale, unit = byte_unit(pd.concat([ledger["measured"], ledger["predicted"]]))
    fig = go.Figure()
    for color, row in zip(CATEGORY_COLORS.values(), ledger.itertuples()):  # the held categories first
        if not (row.measured or row.predicted):
            continue
        fig.add_bar(x=["measured", "predicted"], y=[row.measured / scale, row.predicted / scale],
                    name=row.category, marker_color=color,
                    hovertemplate=(f"{row.category}: %{{y:.2f}} {unit}<br>residual "
                                   f"{row.residual / scale:+.3f} {unit}, named {row.named / scale:.3f}"
                                   "<extra></extra>"))
    attrs = ledger.attrs
    fig.update_layout(barmode="stack", yaxis_title=unit,
                      title=(f"{attrs.get('recipe', '')}: the peak by category, measured "
                             f"({attrs.get('measured_phase', '')}) against predicted "
                             f"({attrs.get('predicted_phase', '')})"))
    return legend_above(fig, 420)
