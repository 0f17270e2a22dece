"""The ladder as one figure: a pure function from `labkit.harness.ladder`'s tidy frame to plotly.

Top panel: every rank's peak memory on every rung, the measured peak as a bar and the planner's
prediction as a marker on it (a rung that did not fit its budget has no bar: a cross at the
budget, named by its status). Bottom panel: the whole job's training tokens/s on every rung,
measured beside predicted (the prediction is the step's FLOPs at the device's peak: a bound).
"""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.config import ConfigError
from labkit.harness.ladder import COLUMNS, job_throughput
from labkit.views.plots import byte_unit, legend_above

MEASURED_COLOR, PREDICTED_COLOR, NOT_RUN_COLOR = "#457b9d", "#d62828", "#6c757d"
TRACES = ("measured peak", "predicted peak", "not run", "measured tokens/s", "predicted tokens/s")


def ladder_figure(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Traces, in order: `measured peak` (bars, x = (rung, rank)), `predicted peak` (markers on
    the same x), `not run` (only when a rung did not run: crosses at the budget), `measured
    tokens/s` and `predicted tokens/s` (bars, x = rung). The budget, when the frame has one, is
    a dashed line over the top panel."""
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise ConfigError(f"not a ladder frame: it lacks {', '.join(missing)}; "
                          "make one with labkit.harness.ladder.run_ladder")
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.22)
    _add_peaks(fig, frame[frame["metric"] == "peak_mem_bytes"], frame.attrs.get("budget_gib"))
    _add_throughput(fig, job_throughput(frame))
    fig.update_layout(title=title or "the ladder: one technique per rung, measured beside predicted",
                      barmode="group")
    return legend_above(fig, 720)


def _add_peaks(fig: go.Figure, peaks: pd.DataFrame, budget_gib: float | None) -> None:
    budget = None if budget_gib is None else budget_gib * 2**30
    scale, unit = byte_unit(pd.concat([peaks["measured"], peaks["predicted"], pd.Series([budget])]))
    x = _rung_rank(peaks)
    fig.add_bar(x=x, y=peaks["measured"] / scale, name=TRACES[0], marker_color=MEASURED_COLOR,
                hovertemplate=f"%{{x}}: measured %{{y:.2f}} {unit}<extra></extra>", row=1, col=1)
    fig.add_scatter(x=x, y=peaks["predicted"] / scale, name=TRACES[1], mode="markers",
                    marker={"symbol": "diamond", "size": 11, "color": PREDICTED_COLOR},
                    hovertemplate=f"%{{x}}: predicted %{{y:.2f}} {unit}<extra></extra>", row=1, col=1)
    not_run = peaks[peaks["status"] != "ok"]
    if not not_run.empty:  # no bar to draw: a cross at the budget (or its prediction), its status
        level = not_run["predicted"] if budget is None else pd.Series(budget, index=not_run.index)
        fig.add_scatter(x=_rung_rank(not_run), y=level / scale, name=TRACES[2], mode="markers+text",
                        text=not_run["status"], textposition="top center",
                        marker={"symbol": "x", "size": 12, "color": NOT_RUN_COLOR}, row=1, col=1)
    if budget is not None:
        fig.add_hline(y=budget / scale, line={"color": NOT_RUN_COLOR, "dash": "dash"}, row=1, col=1,
                      annotation_text=f"budget {budget / scale:.1f} {unit}", annotation_position="top left")
    fig.update_yaxes(title_text=f"peak per rank ({unit})", rangemode="tozero", row=1, col=1)


def _rung_rank(rows: pd.DataFrame) -> list[list[str]]:
    """The two-level x of the per-rank panel: (rung, rank k); bars and markers share it."""
    return [rows["rung"].tolist(), [f"rank {r}" for r in rows["rank"]]]


def _add_throughput(fig: go.Figure, rates: pd.DataFrame) -> None:
    for column, name, color in (("measured_tokens_per_s", TRACES[3], MEASURED_COLOR),
                                ("predicted_tokens_per_s", TRACES[4], PREDICTED_COLOR)):
        fig.add_bar(x=rates["rung"], y=rates[column], name=name, marker_color=color,
                    hovertemplate=f"%{{x}}: {name} %{{y:,.0f}}<extra></extra>", row=2, col=1)
    fig.update_yaxes(title_text="tokens/s, whole job", rangemode="tozero", row=2, col=1)
