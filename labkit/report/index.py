"""The report's index page and tables (see `labkit.report`): the headline numbers of the runs the
notebooks stored, measured beside predicted; provenance; `index.html`, `results.csv`,
`summary.md` and the shared `plotly.min.js`."""
from __future__ import annotations

import html
import json
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd

from labkit import hardware
from labkit.results import expand_row, format_rows, format_value, load_runs, metric_skipped, now


# --- what the notebooks stored: the headline numbers


def report_frames(runs_dir: Path, since: str) -> dict[str, pd.DataFrame]:
    """Each experiment's main run stored since `since`, as rows: the run with the most rows (a
    notebook's sweep; side checks, such as the planner notebook's, run fewer variants)."""
    records = [r for r in load_runs(runs_dir) if r["timestamp"] >= since]
    main: dict[str, dict] = {}
    for record in records:
        best = main.get(record["experiment"])
        if best is None or len(record["rows"]) > len(best["rows"]):
            main[record["experiment"]] = record
    return {name: pd.DataFrame([expand_row(row, rec) for row in rec["rows"]])
            for name, rec in sorted(main.items())}


def headline_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Rank 0's measured values that have a prediction, beside it, one line per variant, sweep
    point and metric."""
    from labkit.views import plots as viz

    rows = frame[(frame["status"] == "ok") & frame["metric"].notna() & frame["predicted"].notna()
                 & (frame["rank"].fillna(0) == 0)]
    ratio = rows["value"] / rows["predicted"].where(rows["predicted"] != 0)
    table = pd.DataFrame({"variant": viz.point_labels(rows) if len(rows) else [],
                          "metric": rows["metric"], "measured": rows["value"],
                          "predicted": rows["predicted"], "unit": rows["unit"],
                          "measured_over_predicted": ratio})
    shown = viz.readable(table.reset_index(drop=True))
    return shown.rename(columns={"measured_over_predicted": "measured / predicted"})


def ratio_figure(frames: dict[str, pd.DataFrame]):
    """Measured over predicted for every headline number, one column of points per experiment."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, frame in frames.items():
        rows = frame[(frame["status"] == "ok") & frame["predicted"].notna()
                     & (frame["predicted"] != 0) & (frame["rank"].fillna(0) == 0)]
        rows = rows[rows["value"] / rows["predicted"] > 0]
        text = [f"{v} {m}: {format_value(m, a, u)} measured, {format_value(m, b, u)} predicted"
                for v, m, a, b, u in zip(rows["variant"], rows["metric"], rows["value"],
                                         rows["predicted"], rows["unit"])]
        fig.add_scatter(x=[name] * len(rows), y=rows["value"] / rows["predicted"], mode="markers",
                        name=name, hovertext=text, showlegend=False)
    fig.add_hline(y=1, line_dash="dash", line_color="grey")
    fig.update_layout(title="measured / predicted (1: as predicted)", yaxis_type="log", height=420)
    return fig


# --- the files


def write_outputs(report: Any, runs_dir: Path, since: str, settings: dict[str, Any]) -> None:
    from plotly.offline import get_plotlyjs

    frames = report_frames(runs_dir, since)
    (report.out / "plotly.min.js").write_text(get_plotlyjs())
    if frames:
        table = pd.concat(frames.values(), ignore_index=True)
        table.drop(columns=["params", "env"]).to_csv(report.out / "results.csv", index=False)
    (report.out / "summary.md").write_text(summary_markdown(report, frames))
    (report.out / "timings.json").write_text(timings_json(report))
    (report.out / "index.html").write_text(index_html(report, frames, settings))


def timings_json(report: Any) -> str:
    """Each notebook's predicted and measured seconds, ranks and sizing, with the pace they were
    predicted from and the pace measured again now, at the end (`python -m labkit.harness.budget
    --from-report` reads both)."""
    from labkit.measure.pace import measure_now, measure_pace

    notebooks = {n.stem: {"status": n.status, "seconds": round(n.seconds, 2), "ranks": n.ranks,
                          "predicted_s": None if n.predicted_s != n.predicted_s else round(n.predicted_s, 2),
                          "level": n.level, "sizing": n.sizing} for n in report.notebooks}
    return json.dumps({"pace": json.loads(measure_pace().to_json()),
                       "pace_after": json.loads(measure_now().to_json()), "cores": report.cores,
                       "seconds": round(report.seconds, 1), "notebooks": notebooks}, indent=1) + "\n"


def _seconds(value: float) -> str:
    return "–" if value != value else f"{value:.1f} s"  # nan: not predicted


def summary_markdown(report: Any, frames: dict[str, pd.DataFrame]) -> str:
    parts = ["# labkit report", "", "```", hardware.describe(), "```", ""]
    parts += [f"- {n.stem}: {n.status} in {n.seconds:.1f} s (predicted {_seconds(n.predicted_s)})"
              + (f": {n.error}" if n.error else "") for n in report.notebooks]
    for name, frame in frames.items():
        parts += ["", f"## {name}", "", "```", format_rows(frame.to_dict(orient="records")), "```"]
    return "\n".join(parts) + "\n"


def provenance() -> dict[str, str]:
    fp = hardware.fingerprint()
    versions = {name: _version(name) for name in ("plotly", "papermill", "nbconvert", "pandas")}
    return {"date": now(), "device": fp["device"], "torch": fp["torch"], "python": platform.python_version(),
            "git commit": fp.get("git_commit") or "none", "cuda": fp.get("cuda") or "none",
            **versions}


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:72em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.2em .6em;text-align:left}
.ok{color:#1b7f3b}.failed{color:#c0392b;font-weight:bold}
pre{background:#f6f6f6;padding:.6em;white-space:pre-wrap}"""


def index_html(report: Any, frames: dict[str, pd.DataFrame], settings: dict[str, Any]) -> str:
    """The index page: provenance, the notebooks, the headline numbers."""
    esc = html.escape
    shown = {k: ", ".join(f"{a}={b}" for a, b in v.items()) if isinstance(v, dict) else str(v)
             for k, v in settings.items() if v not in (None, {})}
    facts = {**provenance(), **shown,
             "notebooks": f"{len(report.notebooks)} run, {len(report.failed)} failed, "
                          f"{report.seconds:.0f} s in all"}
    rows = "".join(
        f"<tr><td><a href='{esc(n.stem)}.html'>{esc(n.stem)}</a></td><td>{esc(n.title)}</td>"
        f"<td class='{esc(n.status)}'>{esc(n.status)}</td><td>{_seconds(n.predicted_s)}</td>"
        f"<td>{n.seconds:.1f} s</td><td>{n.ranks}</td>"
        f"<td>{esc('; '.join(filter(None, (n.error, n.note, n.sizing))))}</td>"
        f"<td><a href='{esc(n.stem)}.ipynb'>.ipynb</a></td></tr>"
        for n in report.notebooks)
    from labkit.techniques import by_notebook as notebook_experiments  # the records' notebooks

    reported = {n.stem for n in report.notebooks}
    pages = {exp.name: stem for stem, exp in notebook_experiments().items() if stem in reported}
    sections = "".join(_experiment_html(name, frame, pages.get(name)) for name, frame in frames.items())
    figure = ratio_figure(frames).to_html(include_plotlyjs=False, full_html=False) if frames else ""
    return (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>labkit report</title>"
        f"<script src='plotly.min.js'></script><style>{STYLE}</style></head><body>"
        "<h1>labkit report</h1><h2>Provenance</h2><table>"
        + "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts.items())
        + f"</table><pre>{esc(hardware.describe())}</pre>"
        "<h2>Notebooks</h2><table><tr><th>notebook</th><th>title</th><th>status</th>"
        "<th>predicted here</th><th>measured</th><th>ranks</th>"
        f"<th>error, note or sizing</th><th>executed</th></tr>{rows}</table>"
        f"<h2>Headline numbers: measured beside predicted</h2>{figure}"
        f"{sections or '<p>no runs were stored</p>'}</body></html>")


def _experiment_html(name: str, frame: pd.DataFrame, page: str | None) -> str:
    """One experiment's headline table, folded under a line: how many numbers, how many variants
    did not run, a link to its notebook's page."""
    table, esc = headline_table(frame), html.escape
    skipped = frame[(frame["status"] != "ok") & ~metric_skipped(frame)]["variant"].nunique()
    link = f" (<a href='{esc(page)}.html'>{esc(page)}</a>)" if page else ""
    return (f"<details id='{esc(name)}'><summary><b>{esc(name)}</b>{link}: {len(table)} numbers "
            f"measured beside predicted; {skipped} variant(s) not run</summary>"
            f"{table.to_html(index=False, border=0)}{_not_run_html(frame)}</details>")


def _not_run_html(frame: pd.DataFrame) -> str:
    bad = frame[(frame["status"] != "ok") & ~metric_skipped(frame)].drop_duplicates("variant")
    items = "".join(f"<li>{html.escape(str(r.variant))}: {html.escape(str(r.status))}"
                    f"{': ' + html.escape(str(r.message)) if isinstance(r.message, str) else ''}</li>"
                    for r in bad.itertuples())
    return f"<p>not run:</p><ul>{items}</ul>" if items else ""
