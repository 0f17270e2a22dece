"""Plots and tables: pure functions from result rows (a DataFrame) to plotly figures or frames.
Nothing here runs an experiment. `show_items` puts figures, frames and text into an ipywidgets
Output (every panel draws through it)."""
from __future__ import annotations

import json
from typing import Any

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.results import BINARY_PREFIXES, format_value, metric_skipped

MEMORY_METRICS = ("peak_mem_bytes", "param_bytes", "optimizer_bytes", "activation_bytes",
                  "saved_weight_copy_bytes", "kv_bytes")
# The first one a run measured is its throughput; kernels (matmul, copies) measure only rates.
THROUGHPUT_METRICS = ("tokens_per_s", "useful_tokens_per_s", "requests_per_s", "tflops", "gbps")
COLORS = dict(zip(MEMORY_METRICS + THROUGHPUT_METRICS,
                  ("#264653", "#e76f51", "#8e7dbe", "#457b9d", "#f4a261", "#e9c46a", "#2a9d8f",
                   "#2a9d8f", "#2a9d8f", "#2a9d8f", "#2a9d8f")))
MIB = 2**20


# --- Readable numbers and legends that stay off the data ------------------------------------------

TITLE_PX, LEGEND_GAP_PX = 44, 8  # the title's line at the top of a figure; space below the legend


def legend_above(fig: go.Figure, height: int) -> go.Figure:
    """The title on the first line, the legend in rows under it, the plot area below both.
    The legend is placed relative to the figure, not to the plot area, so plotly grows the top
    margin to the legend's height (however many rows it wraps into at the figure's width) and the
    legend never covers the data. Subplot titles would sit under the legend's last row: name each
    panel on its axis instead. `height`: the figure's, in px."""
    return fig.update_layout(
        height=height, margin={"t": TITLE_PX + LEGEND_GAP_PX},
        title={"yref": "container", "y": 1 - 12 / height, "yanchor": "top", "x": 0.01,
               "xanchor": "left"},
        legend={"orientation": "h", "yref": "container", "y": 1 - TITLE_PX / height,
                "yanchor": "top", "x": 0, "xanchor": "left", "borderwidth": LEGEND_GAP_PX,
                "bordercolor": "rgba(0,0,0,0)"})


def byte_unit(values: pd.Series) -> tuple[int, str]:
    """The binary unit an axis of bytes reads best in (its largest value at or above 1 of it):
    (2**20, "MiB") for a tiny run, (2**30, "GiB") for a GPU's."""
    largest = pd.to_numeric(values, errors="coerce").abs().max()
    power = 1
    while power < len(BINARY_PREFIXES) - 1 and largest >= 1024 ** (power + 1):
        power += 1
    return 1024**power, BINARY_PREFIXES[power]


def hover_values(metric: str, values: pd.Series) -> list[str]:
    """Each value as the tables show it (`format_value`), for a trace's hover text."""
    return [format_value(metric, v) for v in values]


HOVER = "%{x}<br>%{hovertext}<extra>%{fullData.name}</extra>"
VALUE_COLUMNS = ("value", "measured", "predicted")  # columns in the unit of each row's metric


def readable(table: pd.DataFrame, *, metric: str | None = None,
             by_metric: tuple[str, ...] = VALUE_COLUMNS) -> pd.DataFrame:
    """A copy of `table` to show people: every number as text with its unit (`format_value`,
    as the CLI prints it); the frame the caller computed stays numeric. Each cell's metric is
    `metric` when given; else, in the `by_metric` columns (and everywhere in a table with metrics
    as its index, `metric_table`), its row's `metric`; else its column's name
    (`measured_tokens_per_s`, `rank`). A `unit` column is dropped once the values carry theirs."""
    out = table.copy()
    rows = _row_metrics(table, metric)
    units = [u if isinstance(u, str) else None for u in table["unit"]] if "unit" in table \
        else [None] * len(table)
    for column in out.columns:
        by_row = rows is not None and (metric is not None or "metric" in table.index.names
                                       or column in by_metric)
        names, unit = (rows, units) if by_row else ([str(column)] * len(out), [None] * len(out))
        out[column] = [format_value(m, v, u) for m, v, u in zip(names, table[column], unit)]
    carried = metric is not None or rows is not None and any(c in table.columns for c in by_metric)
    return out.drop(columns="unit") if carried and "unit" in out.columns else out


def _row_metrics(table: pd.DataFrame, metric: str | None) -> list | None:
    if metric is not None:
        return [metric] * len(table)
    if "metric" in table.index.names:
        return list(table.index.get_level_values("metric"))
    return list(table["metric"]) if "metric" in table.columns else None


def ok_rows(frame: pd.DataFrame) -> pd.DataFrame:
    return frame[(frame["status"] == "ok") & frame["metric"].notna()]


def multi_rank(frame: pd.DataFrame) -> bool:
    return "rank" in frame and frame["rank"].nunique() > 1


def rank0(frame: pd.DataFrame) -> pd.DataFrame:
    """Rank 0's rows of a multi-process run (every row of a single-process one)."""
    return frame[frame["rank"] == 0] if multi_rank(frame) else frame


def not_run(frame: pd.DataFrame) -> pd.DataFrame:
    """One line per variant that did not run: variant, status, message. A metric skipped alone
    (energy where no counter can be read) leaves its variant among those that ran."""
    bad = frame[(frame["status"] != "ok") & ~metric_skipped(frame)]
    return bad.drop_duplicates("variant")[["variant", "status", "message"]].reset_index(drop=True)


def point_labels(frame: pd.DataFrame) -> pd.Series:
    """`variant`, or `variant key=value,...` when the run swept settings: one bar per point."""
    def label(row) -> str:
        sweep = row["params"].get("sweep") if isinstance(row["params"], dict) else None
        return row["variant"] + (" " + ",".join(f"{k}={v}" for k, v in sweep.items()) if sweep else "")
    return frame.apply(label, axis=1) if not frame.empty else pd.Series(dtype=str)


def variant_comparison(frame: pd.DataFrame, *, title: str = "") -> go.Figure:
    """Memory (by kind, in MiB or GiB) and throughput of each variant (and sweep point);
    predictions as open diamonds. Multi-process runs show rank 0 here; `rank_comparison` shows
    every rank."""
    rows = ok_rows(rank0(frame))
    rows = rows.assign(variant=point_labels(rows))
    variants = list(dict.fromkeys(rows["variant"]))
    throughput = next((m for m in THROUGHPUT_METRICS if (rows["metric"] == m).any()), None)
    memory = rows[rows["metric"].isin(MEMORY_METRICS)]
    scale, unit = byte_unit(pd.concat([memory["value"], memory["predicted"]]))
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12)
    for metric in MEMORY_METRICS:
        sel = rows[rows["metric"] == metric].set_index("variant").reindex(variants)
        if sel["value"].notna().any():
            _add_bars(fig, variants, sel, metric, scale, col=1)
    if throughput:
        sel = rows[rows["metric"] == throughput].set_index("variant").reindex(variants)
        _add_bars(fig, variants, sel, throughput, 1, col=2)
    fig.update_yaxes(title_text=f"memory ({unit})", row=1, col=1)
    fig.update_yaxes(title_text=f"{throughput or 'throughput'} (higher is better)", side="right",
                     row=1, col=2)  # its title at the figure's edge, not over the memory panel
    fig.update_layout(barmode="group", scattermode="group", title=title + _not_run_note(frame))
    return legend_above(fig, 440)


def _add_bars(fig: go.Figure, x: list[str], sel: pd.DataFrame, metric: str, scale: float,
              col: int) -> None:
    """A bar per variant of `metric` (values divided by `scale`), its prediction as a diamond;
    hover shows both as the tables do. One legend entry for every prediction."""
    fig.add_bar(x=x, y=sel["value"] / scale, name=metric, offsetgroup=metric,
                marker_color=COLORS[metric], hovertext=hover_values(metric, sel["value"]),
                hovertemplate=HOVER, row=1, col=col)
    if sel["predicted"].notna().any():
        add_predicted(fig, x, sel["predicted"], metric, scale, offsetgroup=metric, col=col,
                      hovertemplate=HOVER.replace("%{fullData.name}", f"{metric} predicted"),
                      marker={"size": 13, "line": {"width": 2}})


def add_predicted(fig: go.Figure, x: list[str], predicted: pd.Series, metric: str, scale: float,
                  *, offsetgroup: str, col: int, hovertemplate: str = HOVER,
                  marker: dict | None = None) -> None:
    """Predictions as open diamonds beside their bars; one "predicted" legend entry, listed last,
    for every prediction in the figure."""
    fig.add_scatter(x=x, y=predicted / scale, mode="markers", name="predicted",
                    legendgroup="predicted", legendrank=2000, offsetgroup=offsetgroup,
                    showlegend=not any(t.name == "predicted" for t in fig.data),
                    hovertext=hover_values(metric, predicted), hovertemplate=hovertemplate,
                    row=1, col=col,
                    marker={"symbol": "diamond-open", "size": 12, "color": "black", **(marker or {})})


def _not_run_note(frame: pd.DataFrame) -> str:
    note = "; ".join(f"{r.variant}: {r.status}" for r in not_run(frame).itertuples())
    return f"  (not run: {note})" if note else ""


RANK_COLORS = ("#264653", "#e76f51", "#2a9d8f", "#f4a261", "#8e7dbe", "#457b9d", "#e9c46a", "#6d597a")


def rank_comparison(frame: pd.DataFrame, *, title: str = "",
                    metrics: tuple[str, ...] = ("peak_mem_bytes", "step_ms")) -> go.Figure:
    """One panel per metric (bytes in MiB or GiB): a bar per rank for each variant (and sweep
    point), the prediction for that rank as an open diamond."""
    rows = ok_rows(frame)
    rows = rows.assign(variant=point_labels(rows))
    metrics = tuple(m for m in metrics if (rows["metric"] == m).any())
    variants = list(dict.fromkeys(rows["variant"]))
    fig = make_subplots(rows=1, cols=max(1, len(metrics)), horizontal_spacing=0.12)
    for col, metric in enumerate(metrics, start=1):
        mine = rows[rows["metric"] == metric]
        scale, unit = byte_unit(mine["value"]) if metric.endswith("_bytes") else (1, "")
        for rank, sel in mine.groupby("rank"):
            sel = sel.drop_duplicates("variant").set_index("variant").reindex(variants)
            fig.add_bar(x=variants, y=sel["value"] / scale, name=f"rank {rank}",
                        marker_color=RANK_COLORS[int(rank) % len(RANK_COLORS)],
                        offsetgroup=str(rank), legendgroup=str(rank), showlegend=col == 1,
                        hovertext=hover_values(metric, sel["value"]), hovertemplate=HOVER,
                        row=1, col=col)
            if sel["predicted"].notna().any():
                add_predicted(fig, variants, sel["predicted"], metric, scale,
                              offsetgroup=str(rank), col=col)
        fig.update_yaxes(title_text=f"{metric} ({unit})" if unit else metric, row=1, col=col,
                         side="right" if col == 2 == len(metrics) else "left")
    fig.update_layout(barmode="group", scattermode="group",
                      title=(title or "per rank") + _not_run_note(frame))
    return legend_above(fig, 440)


def block_table_figure(table: pd.DataFrame) -> go.Figure:
    """A paged cache's block tables: one row per sequence, one cell per logical block, labelled
    with the physical block it maps to and coloured by the tokens it holds (a partly filled last
    block is the only waste)."""
    grid = table.pivot(index="sequence", columns="logical_block", values="tokens_used")
    physical = table.pivot(index="sequence", columns="logical_block", values="physical_block")
    fig = go.Figure(go.Heatmap(z=grid.values, x=list(grid.columns), y=[f"seq {s}" for s in grid.index],
                               text=physical.values, texttemplate="%{text}", colorscale="Blues",
                               colorbar={"title": "tokens used"}, xgap=2, ygap=2))
    fig.update_layout(title="block table: the physical block behind each logical block",
                      xaxis_title="logical block", height=120 + 40 * len(grid), yaxis_autorange="reversed")
    return fig


def latency_bars(frame: pd.DataFrame, name: str = "ttft") -> go.Figure:
    """A serving latency (`ttft` or `tpot`) per variant: one bar per percentile and priority
    class (`ttft_p99_high_ms`, ...), the all-requests ones first."""
    rows = ok_rows(frame)
    rows = rows[rows["metric"].str.fullmatch(rf"{name}_p\d+(_\w+)?_ms")]
    fig = go.Figure()
    for metric, part in rows.groupby("metric", sort=False):
        fig.add_bar(x=part["variant"], y=part["value"], name=metric.removesuffix("_ms"),
                    hovertext=hover_values(metric, part["value"]), hovertemplate=HOVER)
    fig.update_layout(barmode="group", title=f"{name} by variant (ms; lower is better)",
                      yaxis_title="ms")
    return legend_above(fig, 400)


SEGMENT_COLORS = {"served": None, "held": "lightgrey", "preempted": "crimson"}


def schedule_figure(segments: pd.DataFrame, steps: pd.DataFrame, *, title: str = "") -> go.Figure:
    """A serving replay: above, which request holds which slot over time (a Gantt chart: one bar
    per stretch, coloured by priority class; grey: done but held until its batch ends; red: cut
    short by a preemption); below, the rows each decode step computed for a request, against
    the rows it computed (the difference is padding)."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.7, 0.3],
                        vertical_spacing=0.06)
    classes = sorted(segments["priority"].unique())
    palette = dict(zip(classes, ("royalblue", "darkorange", "seagreen", "purple")))
    for state, color in SEGMENT_COLORS.items():
        for cls in classes:
            part = segments[(segments.state == state) & (segments.priority == cls)]
            if part.empty:
                continue
            fig.add_trace(go.Bar(
                x=part.end_ms - part.start_ms, base=part.start_ms, y=part.slot, orientation="h",
                marker_color=color or palette[cls], name=f"{cls}: {state}",
                customdata=part.request, hovertemplate="request %{customdata}<br>%{base:.0f} ms "
                                                       "+ %{x:.0f} ms<extra></extra>"), row=1, col=1)
    decode = steps[steps.kind == "decode"]
    fig.add_trace(go.Scatter(x=decode.start_ms, y=decode.rows, name="rows computed",
                             line={"shape": "hv", "color": "grey"}), row=2, col=1)
    fig.add_trace(go.Scatter(x=decode.start_ms, y=decode.live, name="rows serving a request",
                             line={"shape": "hv", "color": "royalblue"}), row=2, col=1)
    fig.update_layout(title=title or "schedule", barmode="overlay", bargap=0.15)
    fig.update_yaxes(title_text="slot", autorange="reversed", dtick=1, row=1, col=1)
    fig.update_yaxes(title_text="rows per decode step", row=2, col=1)
    fig.update_xaxes(title_text="ms since the replay began (arrival times count from it)", row=2, col=1)
    return legend_above(fig, 580)


def sweep_lines(frame: pd.DataFrame, x: str, metric: str) -> go.Figure:
    """`metric` against a swept config field `x`, one line per variant (needs expanded params)."""
    rows = ok_rows(frame)
    rows = rows[rows["metric"] == metric]
    fig = go.Figure()
    for variant, sel in rows.groupby("variant", sort=False):
        sel = sel.sort_values(x)
        fig.add_scatter(x=sel[x], y=sel["value"], mode="lines+markers", name=variant,
                        hovertext=hover_values(metric, sel["value"]), hovertemplate=HOVER)
    fig.update_layout(xaxis_title=x, yaxis_title=metric)
    return legend_above(fig, 400)


def predicted_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Measured beside predicted, for every metric that has a prediction."""
    rows = ok_rows(frame)
    rows = rows[rows["predicted"].notna()]
    columns = ["variant"] + (["rank"] if multi_rank(rows) else []) + ["metric", "value", "predicted", "unit"]
    table = rows[columns].rename(columns={"value": "measured"})
    ratio = table["measured"] / table["predicted"].where(table["predicted"] != 0)
    return table.assign(measured_over_predicted=ratio.round(3)).reset_index(drop=True)


def metric_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Variants as columns, metrics as rows (by rank in multi-process runs): the numbers behind
    the figure."""
    rows = ok_rows(frame)
    index = ["metric", "rank"] if multi_rank(rows) else "metric"
    return rows.pivot_table(index=index, columns="variant", values="value", sort=False)


PALETTE = ("#264653", "#e76f51", "#2a9d8f", "#8e7dbe", "#f4a261", "#457b9d")  # one per variant


def frontier(frame: pd.DataFrame) -> go.Figure:
    """The OOM frontier (batch_finder rows): the largest size that fits against the other
    dimension (max batch size against seq_len, or max seq_len against batch size), one line per
    variant; the planner's answer dashed. Below a line fits, above it runs out of memory."""
    rows = ok_rows(frame)
    metric = "max_batch_size" if (rows["metric"] == "max_batch_size").any() else "max_seq_len"
    x = "seq_len" if metric == "max_batch_size" else "batch_size"
    rows = rows[rows["metric"] == metric].assign(**{x: lambda t: t["params"].map(lambda p: p[x])})
    fig = go.Figure()
    for i, (variant, sel) in enumerate(rows.groupby("variant", sort=False)):
        sel, color = sel.sort_values(x), PALETTE[i % len(PALETTE)]
        fig.add_scatter(x=sel[x], y=sel["value"], mode="lines+markers", name=f"{variant} measured",
                        line={"color": color}, legendgroup=variant,
                        hovertext=hover_values(metric, sel["value"]), hovertemplate=HOVER)
        if sel["predicted"].notna().any():
            fig.add_scatter(x=sel[x], y=sel["predicted"], mode="lines+markers",
                            name=f"{variant} predicted", legendgroup=variant,
                            hovertext=hover_values(metric, sel["predicted"]), hovertemplate=HOVER,
                            line={"color": color, "dash": "dash"}, marker={"symbol": "diamond-open"})
    fig.update_layout(title="OOM frontier: fits below the line" + _not_run_note(frame),
                      xaxis_title=x, yaxis_title=f"{metric} (fits)")
    return legend_above(fig, 440)


def mime_bundle(item: Any) -> dict:
    """`item` as a mime bundle: a plotly figure as plotly's JSON (JupyterLab's plotly renderer
    draws it), a frame as HTML and text, anything else as its text."""
    if isinstance(item, go.Figure):
        return {"application/vnd.plotly.v1+json": {**json.loads(item.to_json()), "config": {}},
                "text/plain": "figure"}
    if isinstance(item, pd.DataFrame):
        return {"text/html": item.to_html(index=False), "text/plain": item.to_string(index=False)}
    return {"text/plain": str(item)}


def show_items(output: Any, items: list) -> None:
    """Replace what the ipywidgets Output `output` shows with `items` (figures, frames, text), in
    one state update. Not `with output:` (it breaks nbclient, so papermill, when no widget state
    is stored: a KeyError in nbclient.output_widget) nor display formatting (a plotly figure
    displays itself through _ipython_display_, outside the Output). A figure is data in the
    Output, not a plotly FigureWidget: a FigureWidget's title and traces reach the browser as
    updates after its model opens, and under a 0.4-core quota JupyterLab twice drew both of a
    panel's FigureWidgets without them, the run done."""
    output.outputs = tuple({"output_type": "display_data", "data": mime_bundle(item), "metadata": {}}
                           for item in items)

