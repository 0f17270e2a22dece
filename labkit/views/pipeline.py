"""Pipeline figures, pure functions of frames: each schedule's step as a timeline per rank
(`labkit.blocks.pipeline_schedule.timeline`'s rows), and a `pipeline_parallel` run's bubble and
saved bytes per rank, measured beside predicted."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.config import ConfigError
from labkit.views.plots import legend_above

KIND_COLORS = {"F": "#2a9d8f", "B": "#e76f51", "I": "#f4a261", "W": "#8d99ae"}
KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward to the input (I)",
              "W": "backward to the weights (W)"}
MEASURED, PREDICTED = "#264653", "#a8dadc"


def timeline_figure(rows: pd.DataFrame, *, title: str = "") -> go.Figure:
    """One panel per schedule, one bar row per rank: each op from start to end, colored by kind,
    labelled with its micro-batch (and stage module where a rank holds several). White gaps are
    the bubble."""
    need = {"variant", "rank", "stage", "kind", "micro_batch", "start", "end"}
    if not need <= set(rows.columns):
        raise ConfigError(f"not timeline rows: they need {', '.join(sorted(need))}; make them with "
                          "labkit.blocks.pipeline_schedule.timeline")
    variants, shown = list(dict.fromkeys(rows["variant"])), set()
    fig = make_subplots(rows=len(variants), cols=1, shared_xaxes=True, subplot_titles=variants,
                        vertical_spacing=0.3 / max(1, len(variants)))
    for i, variant in enumerate(variants, start=1):
        part = rows[rows["variant"] == variant]
        several = part.groupby("rank")["stage"].nunique().max() > 1
        for kind, ops in part.groupby("kind", sort=False):
            labels = [f"{mb}" + (f"·s{s}" if several else "") for mb, s in zip(ops["micro_batch"], ops["stage"])]
            fig.add_bar(x=ops["end"] - ops["start"], base=ops["start"], y=[f"rank {r}" for r in ops["rank"]],
                        orientation="h", marker_color=KIND_COLORS[kind], name=KIND_NAMES[kind],
                        legendgroup=kind, showlegend=kind not in shown,
                        text=labels, textposition="inside", insidetextanchor="middle", row=i, col=1)
            shown.add(kind)
        fig.update_yaxes(autorange="reversed", row=i, col=1)
    fig.update_xaxes(title_text="time (one stage's forward = 1)", row=len(variants), col=1)
    fig.update_layout(barmode="overlay", title=title or "One step per schedule, equal stages, free handoffs")
    return legend_above(fig, 160 + 130 * len(variants))


def _ok(frame: pd.DataFrame, metric: str) -> pd.DataFrame:
    rows = frame[(frame["metric"] == metric) & (frame["status"] == "ok") & (frame["variant"] != "single")]
    return rows.drop_duplicates(["variant", "rank"], keep="last")


def bubble_figure(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Left: each rank's bubble (share of the step idle) per schedule, measured beside the
    replay's prediction, the ideal formula as a marker; right: each rank's peak bytes saved for
    backward, measured beside predicted. Bars read variant / rank."""
    if not {"variant", "metric", "value", "predicted", "status", "rank"} <= set(frame.columns):
        raise ConfigError("not result rows: they need variant, rank, metric, value, predicted and status")
    bubble, ideal, saved = (_ok(frame, m) for m in ("bubble_fraction", "ideal_bubble_fraction", "activation_bytes"))
    label = lambda rows: [f"{v} / r{r}" for v, r in zip(rows["variant"], rows["rank"])]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1)
    fig.add_bar(name="measured", x=label(bubble), y=bubble["value"], marker_color=MEASURED, row=1, col=1)
    fig.add_bar(name="predicted (replay)", x=label(bubble), y=bubble["predicted"], marker_color=PREDICTED,
                row=1, col=1)
    fig.add_scatter(name="ideal formula", x=label(ideal), y=ideal["value"], mode="markers",
                    marker={"color": "#e76f51", "symbol": "line-ew-open", "size": 18}, row=1, col=1)
    fig.add_bar(name="saved, measured", x=label(saved), y=saved["value"] / 2**20, marker_color="#6d597a",
                row=1, col=2)
    fig.add_bar(name="saved, predicted", x=label(saved), y=saved["predicted"] / 2**20,
                marker_color="#b56576", row=1, col=2)
    fig.update_yaxes(title_text="bubble (idle share of the step)", tickformat=".0%", row=1, col=1)
    fig.update_yaxes(title_text="peak saved for backward (MiB)", row=1, col=2)
    fig.update_layout(barmode="group", title=title or "Bubble and activation memory per rank")
    return legend_above(fig, 460)
