"""The lab's main job: run every experiment on the default device and write a folder with the
result table (`results.csv`), a text summary (`summary.md`) and the figures (`figures.html`)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from labkit import hardware
from labkit.config import ConfigError
from labkit.distributed import RunFailed
from labkit.experiment import run_experiment
from labkit.results import format_rows
from labkit.techniques import EXPERIMENTS


def run_report(out: str | Path, *, preset: str | None = None, overrides: dict[str, Any] | None = None,
               runs_dir: str | Path | None = None, experiments: list[str] | None = None,
               progress: bool = True) -> Path:
    """Run the experiments (all by default) and write the report folder; returns its path.
    Runs are stored under `out/runs` unless `runs_dir` says otherwise."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(runs_dir or out / "runs")
    frames, refused = {}, {}
    for name in experiments or list(EXPERIMENTS):
        try:
            frames[name] = run_experiment(name, preset=preset, overrides=overrides,
                                          runs_dir=str(runs_dir), progress=progress).frame()
        except ConfigError as e:  # e.g. a setting this experiment does not take: say so, go on
            refused[name] = str(e)
        except RunFailed as e:  # a rank crashed or hung: keep what was measured, say why
            frames[name], refused[name] = e.result.frame(), str(e)
    table = pd.concat(frames.values(), ignore_index=True)
    table.drop(columns=["params", "env"]).to_csv(out / "results.csv", index=False)
    (out / "summary.md").write_text(summary_markdown(frames, refused))
    write_figures(frames, out / "figures.html")
    return out


def summary_markdown(frames: dict[str, pd.DataFrame], refused: dict[str, str]) -> str:
    parts = ["# labkit report", "", "```", hardware.describe(), "```"]
    for name, frame in frames.items():
        parts += ["", f"## {name}", "", "```", format_rows(frame.to_dict(orient="records")), "```"]
        parts += ["", f"ended early: {refused[name]}"] if name in refused else []
    for name, reason in refused.items():
        parts += [] if name in frames else ["", f"## {name}", "", f"not run: {reason}"]
    return "\n".join(parts) + "\n"


def write_figures(frames: dict[str, pd.DataFrame], path: Path) -> None:
    """One HTML page with every experiment's figure; plotly.js is embedded once (works offline)."""
    try:
        from labkit import viz
    except ImportError:  # the core environment has no plotly: the table and summary still stand
        path.with_suffix(".txt").write_text("figures need plotly: pip install plotly\n")
        return
    html = [viz.variant_comparison(frame, title=name).to_html(full_html=False,
                                                              include_plotlyjs=i == 0)
            for i, (name, frame) in enumerate(frames.items())]
    path.write_text("<html><head><meta charset='utf-8'><title>labkit report</title></head><body>"
                    + "".join(html) + "</body></html>")
