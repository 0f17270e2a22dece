"""FP8's figure, a pure function of `labkit.techniques.fp8.numerics_table`'s frame: per block
linear, the amax of its input, weight and output gradient; the round-trip error of e4m3 and e5m2,
tensorwise and rowwise, beside each format's predicted RMS error; and the share of the output
gradients each rounds to zero; and the worst errors per format beside their bounds (`bounds_table`)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.blocks import fp8
from labkit.config import ConfigError
from labkit.views.plots import legend_above

ROLE_COLORS = {"input": "#264653", "weight": "#e9c46a", "grad_output": "#e76f51"}
LINES = {("e4m3", "tensorwise"): ("#2a9d8f", "solid"), ("e4m3", "rowwise"): ("#2a9d8f", "dot"),
         ("e5m2", "tensorwise"): ("#8338ec", "solid"), ("e5m2", "rowwise"): ("#8338ec", "dot")}
COLUMNS = {"index", "linear", "role", "format", "granularity", "amax", "rel_error", "underflow_fraction"}


def numerics_figure(table: pd.DataFrame, predicted: dict[str, float] | None = None, *,
                    role: str = "input", title: str = "") -> go.Figure:
    """Three panels over the block linears (x: layer.kind, in forward order). Left: amax of each
    role (log scale). Middle: `role`'s round-trip error ||x' - x|| / ||x|| for each format and
    granularity, with `predicted` ({format: error}) as dashed lines. Right: the share of the
    output gradients rounded to zero. Traces: 3 amax, 4 errors (+ the predictions), 4 underflows."""
    missing = COLUMNS - set(table.columns)
    if missing:
        raise ConfigError(f"not a numerics table: it lacks {', '.join(sorted(missing))}; make one with "
                          "labkit.techniques.fp8.numerics_table")
    names = table.drop_duplicates("index").sort_values("index")["linear"].str.removeprefix("layers.")
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08)
    first = table[(table.format == "e4m3") & (table.granularity == "tensorwise")]
    for r, color in ROLE_COLORS.items():
        rows = first[first.role == r].sort_values("index")
        fig.add_scatter(x=names, y=rows["amax"], mode="lines+markers", name=f"amax: {r}",
                        line={"color": color}, row=1, col=1)
    for (fmt, gran), (color, dash) in LINES.items():
        rows = table[(table.format == fmt) & (table.granularity == gran)]
        err, under = rows[rows.role == role].sort_values("index"), rows[rows.role == "grad_output"].sort_values("index")
        fig.add_scatter(x=names, y=err["rel_error"], mode="lines+markers", name=f"{fmt} {gran}",
                        line={"color": color, "dash": dash}, row=1, col=2)
        fig.add_scatter(x=names, y=under["underflow_fraction"], mode="lines+markers",
                        name=f"{fmt} {gran}: underflow", line={"color": color, "dash": dash},
                        showlegend=False, row=1, col=3)
    for fmt, value in (predicted or {}).items():
        fig.add_hline(y=value, line={"color": LINES[(fmt, "tensorwise")][0], "dash": "dash"},
                      annotation_text=f"{fmt} predicted {value:.3f}", row=1, col=2)
    fig.update_yaxes(type="log", title_text="amax: max |x|", row=1, col=1)
    fig.update_yaxes(title_text=f"round trip of the {role}: ||x' - x|| / ||x||", rangemode="tozero", row=1, col=2)
    fig.update_yaxes(title_text="output gradients rounded to 0", tickformat=".1%", row=1, col=3)
    fig.update_layout(title=title or "Float8 numerics per block linear")
    return legend_above(fig, 460)


def bounds_table(table: pd.DataFrame) -> pd.DataFrame:
    """Per format and granularity: the largest elementwise round-trip error over every captured
    tensor beside half an ulp, and the worst normwise error beside uniform rounding's RMS."""
    out = table.groupby(["format", "granularity"]).agg(max_rel_error=("max_rel_error", "max"),
                                                       rel_error=("rel_error", "max"))
    fmts = out.index.get_level_values("format")
    return out.assign(bound=[fp8.rounding_bound(f) for f in fmts],
                      predicted_rel_error=[fp8.rms_rounding_error(f) for f in fmts])
