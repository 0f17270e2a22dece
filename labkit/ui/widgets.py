"""Widget panels built from an experiment's config: choices become dropdowns, numbers become sliders
(both bounds known, a small range) or bounded boxes (the valid range comes from the config), flags
become checkboxes; plus the variants, preset, device, a sweep box ("key=v1,v2; key2=...") and Run and
Stop buttons. A run goes through the same `run_experiment` as the CLI; results land in the store.

The Run button starts the run in a background thread, so the notebook stays responsive and Stop
works: Stop is a request the harness honours after the variant it is measuring (the `on_rows`
callback raises `StopRun`; the run record is kept as `interrupted`, every row measured stays in the
store). Threads are never killed. While it runs, a plotly figure is redrawn from the rows measured
so far, at most every `min_interval_s` (a long sweep does not flood the browser; the last update
always lands), and a device monitor (NVML on a GPU; CPU % and RSS of this process otherwise)
plots beside it with a marker where each variant at each point began. The monitor samples from
Python in its own thread: a little CPU, so for the cleanest timings untick `monitor`. Errors appear
inside the panel (its status line and output area), never only in the log console, and the buttons
come back.
"""
from __future__ import annotations

import dataclasses
import html
import threading
import time
import typing
from typing import Any

import ipywidgets as W
import pandas as pd
import plotly.graph_objects as go
from IPython.display import display

from labkit import hardware
from labkit.views import plots as viz
from labkit.harness import budget
from labkit.config import (PRESETS, ConfigError, default_preset, expand_sweep, parse_sweep, resolve,
                           resolve_device)
from labkit.harness.ranks import RunFailed
from labkit.harness.experiment import choose_variants, run_experiment
from labkit.measure.monitor import DeviceMonitor, timeline_figure
from labkit.techniques import record
from labkit.ui.background import BackgroundRun

# Fields the panel shows in its own controls (or not at all).
_SPECIAL = {"variant", "preset", "device", "model"}
SLIDER_MAX_STEPS = 64  # an int range with at most this many values gets a slider, else a box
# The monitor beside the live figure, small: the first two of these with readings
MONITOR_FIELDS = ("utilization_pct", "memory_used_bytes", "cpu_pct", "rss_bytes")


class StopRun(Exception):
    """Raised from the harness's `on_rows` callback when Stop was pressed: ends the run there."""


def field_widget(f: dataclasses.Field, hint: Any) -> W.Widget | None:
    """A control for one config field, or None for a type the panel does not edit."""
    meta, label = f.metadata, {"description": f.name, "tooltip": f.metadata.get("help", ""),
                               "style": {"description_width": "initial"}}
    if meta.get("choices"):
        return W.Dropdown(options=list(meta["choices"]), value=f.default, **label)
    if meta.get("name"):  # participant, team: filled by load() (their default is $LABKIT_...)
        return W.Text(value="", placeholder="your name" if f.name == "participant" else "team", **label)
    if hint is bool:
        return W.Checkbox(value=f.default, **label)
    lo, hi = meta.get("min"), meta.get("max")
    if hint is int:
        if lo is not None and hi is not None and hi - lo <= SLIDER_MAX_STEPS:
            return W.IntSlider(value=f.default, min=int(lo), max=int(hi), **label)
        return W.BoundedIntText(value=f.default, min=int(lo or 0),
                                max=int(hi) if hi is not None else 10**9, **label)
    if hint is float:
        return W.BoundedFloatText(value=f.default, min=float(lo or 0),
                                  max=float(hi) if hi is not None else 1e12, **label)
    if typing.get_args(hint) and float in typing.get_args(hint):  # optional float: blank = none
        return W.Text(value="" if f.default is None else str(f.default), placeholder="none", **label)
    return None


def config_controls(config_cls: type) -> dict[str, W.Widget]:
    hints = typing.get_type_hints(config_cls)
    controls = {}
    for f in dataclasses.fields(config_cls):
        if f.name not in _SPECIAL:
            widget = field_widget(f, hints[f.name])
            if widget is not None:
                controls[f.name] = widget
    return controls


def parse_sweep_text(text: str) -> dict[str, list[str]]:
    """`"batch_size=1,2,4; seq_len=8,16"` -> {"batch_size": ["1", "2", "4"], "seq_len": [...]}
    (the CLI's --sweep syntax, several separated by ';'); blank means no sweep."""
    return parse_sweep([item for item in text.split(";") if item.strip()])


class Panel(BackgroundRun):
    """Controls, Run and Stop, a live figure, a device monitor and an output area for one
    experiment. `start()` is what Run does (a background thread; `wait()` joins it); `run()` is the
    same run in the calling thread."""

    def __init__(self, name: str, *, preset: str | None = None, device: str = "auto",
                 overrides: dict[str, Any] | None = None, runs_dir: str | None = None,
                 min_interval_s: float = 0.5):
        self.name, self.runs_dir, self.min_interval_s = name, runs_dir, min_interval_s
        exp = record(name)
        self.distributed = exp.distributed
        self.variants = W.SelectMultiple(options=list(exp.variants), value=list(exp.variants),
                                         description="variants", rows=len(exp.variants))
        preset = preset or default_preset(resolve_device(device))
        self.preset = W.Dropdown(options=list(PRESETS), value=preset, description="preset")
        self.device = W.Dropdown(options=["auto"] + hardware.available_devices(), value=device,
                                 description="device")
        self.sweep = W.Text(value="", placeholder="key=v1,v2; key2=...", description="sweep")
        self.monitor_on = W.Checkbox(value=True, description="monitor", indent=False)
        self.controls = config_controls(exp.Config)
        self.load(overrides or {})
        self.preset.observe(lambda _: self.load({}), names="value")
        self.run_button = W.Button(description="Run", button_style="primary", icon="play")
        self.stop_button = W.Button(description="Stop", button_style="warning", icon="stop",
                                    disabled=True, tooltip="end the run after the current variant"
                                    + (" (not for multi-process runs)" if self.distributed else ""))
        self.run_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())
        self.status = W.HTML(html.escape(self.sizing))
        self.output = W.Output()
        # the live figure and the monitor: plotly figures drawn in `charts` (viz.show_items)
        self.charts = W.Output()
        self.figure = go.Figure(layout={"height": 440, "title": f"{name}: press Run"})
        self.monitor_figure = go.Figure(layout={"height": 230, "title": "device monitor"})
        self.frame, self.error = None, None  # the last run's rows, or why it could not run
        self.stopped, self.points_done, self.points_total = False, 0, 0
        self.rows: list[dict[str, Any]] = []
        self.monitor: DeviceMonitor | None = None
        self._stop, self._thread, self._last_draw = threading.Event(), None, 0.0
        self.widget = W.VBox([
            W.HBox([self.variants, W.VBox([self.preset, self.device, self.sweep, self.monitor_on])]),
            W.GridBox(list(self.controls.values()),
                      layout=W.Layout(grid_template_columns="repeat(3, 1fr)")),
            W.HBox([self.run_button, self.stop_button, self.status]),
            self.charts, self.output])  # the figures stacked: both at full width
        viz.show_items(self.charts, [self.figure, self.monitor_figure])

    def load(self, overrides: dict[str, Any]) -> None:
        """Fill the controls with the resolved config of the chosen preset (plus `overrides`),
        on a CPU sized for this CPU so that the first point comes within seconds
        (`budget.PANEL_TARGET_S` for the whole default run; `sizing` says what changed)."""
        exp, settings = record(self.name), {**overrides, "device": self.device.value}
        fit = budget.fit_run(self.name, self.preset.value, settings, list(exp.variants),
                             budget.PANEL_TARGET_S)
        self.sizing = fit.note
        cfg = resolve(exp.Config, self.preset.value, {**fit.settings, **settings}, experiment=self.name)
        for key, widget in self.controls.items():
            value = getattr(cfg, key)
            if isinstance(widget, W.Text):  # an optional number: blank means none
                value = "" if value is None else str(value)
            widget.value = value

    def overrides(self) -> dict[str, Any]:
        values = {k: w.value for k, w in self.controls.items()}
        return {**values, "device": self.device.value}

    # --- the buttons
    def start(self) -> None:
        """What Run does: the run in a background thread (one at a time)."""
        if self.running:
            return
        self._set_running(True)
        self.run_in_background(f"labkit-panel-{self.name}")

    def stop(self) -> None:
        """What Stop does: the run ends after the variant being measured; its rows are kept."""
        if self.running and not self.distributed:
            self._stop.set()
            self._set_status("stopping after the current variant...")

    # --- the run
    def run(self) -> None:
        """Run with the panel's settings; errors appear in the panel, measured rows are kept."""
        self._set_running(True)
        self._stop.clear()
        viz.show_items(self.output, [])
        self.frame, self.error, self.stopped, self.rows = None, None, False, []
        self.monitor = None
        try:
            self._run()
        except StopRun:
            self.stopped, self.frame = True, pd.DataFrame(self.rows)
            self._set_status(f"stopped after {self.points_done} of {self.points_total} points; "
                             f"{len(self.frame)} rows kept in the store")
        except RunFailed as e:  # a rank crashed or hung: show what was measured before
            self.frame, self.error = e.result.frame(), str(e)
        except Exception as e:  # shown in the panel, not lost in the log console
            self.error = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
        finally:
            if self.monitor is not None:
                self.monitor.stop()
            self._finish()

    def _run(self) -> None:
        exp = record(self.name)
        variants, sweep = list(self.variants.value), parse_sweep_text(self.sweep.value)
        chosen = choose_variants(exp, variants)
        points = expand_sweep(sweep)
        self.points_done, self.points_total = 0, len(points)
        # the phase each variant at each point runs in, in the harness's order
        self._phases = [" ".join([v] + [f"{k}={x}" for k, x in p.items()]) for p in points for v in chosen]
        self._set_status(f"running {self.points_total} point(s) x {len(chosen)} variant(s)...")
        if self.monitor_on.value:
            device = resolve_device(self.device.value)
            self.monitor = DeviceMonitor(device, interval_s=0.25).start()
            self.monitor.mark(self._phases[0])
        result = run_experiment(self.name, preset=self.preset.value, overrides=self.overrides(),
                                sweep=sweep or None, variants=variants, runs_dir=self.runs_dir,
                                progress=False, on_rows=self._on_rows)
        self.frame = result.frame()
        self._set_status(f"done: {self.points_total} point(s), {len(self.frame)} rows, run "
                         f"{html.escape(result.run_id)}")

    def _on_rows(self, rows: list[dict[str, Any]]) -> None:
        """The harness's callback after each variant at each point (its rows are stored)."""
        self.rows.extend(rows)
        done = len({(r["variant"], str((r["params"] or {}).get("sweep"))) for r in self.rows
                    if not r.get("rank")})  # variants measured so far (rank 0's)
        per_point = max(len(self._phases) // max(self.points_total, 1), 1)
        self.points_done = done // per_point
        if self.monitor is not None and done < len(self._phases):
            self.monitor.mark(self._phases[done])
        self._draw()
        if self._stop.is_set() and not self.distributed:
            raise StopRun(f"stopped after {self.points_done} points")
        self._set_status(f"{self.points_done} of {self.points_total} points measured...")

    def _draw(self, force: bool = False) -> None:
        """Redraw the live figures from the rows so far: at most every `min_interval_s`."""
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval_s:
            return
        self._last_draw = now
        frame = self.frame if self.frame is not None else pd.DataFrame(self.rows)
        if not frame.empty:
            self.figure = viz.variant_comparison(frame, title=self.name)
        if self.monitor is not None:
            title = f"device monitor ({self.monitor.device}, {self.monitor.source})"
            self.monitor_figure = timeline_figure(self.monitor.frame(), self.monitor.markers(),
                                                  title=title, fields=MONITOR_FIELDS, max_fields=2)
        viz.show_items(self.charts, [self.figure, self.monitor_figure])

    def _finish(self) -> None:
        """The last update always lands; tables and errors go to the output area (viz.show_items:
        not ipywidgets' append_display_data, whose InteractiveShell.instance() makes a shell in
        a plain Python process and so changes every later display() there); buttons back."""
        items = []
        try:
            self._draw(force=True)
            if self.frame is not None and not self.frame.empty:
                items.append(viz.readable(viz.predicted_table(self.frame)))
                skipped = viz.not_run(self.frame)
                if not skipped.empty:
                    items.append(skipped)
        except Exception as e:  # a drawing failure is shown too
            self.error = self.error or f"{type(e).__name__}: {e}"
        finally:
            if self.error:
                items.append(f"error: {self.error}")
                self._set_status(f"<span style='color:#c0392b'>error: {html.escape(self.error)}</span>")
            viz.show_items(self.output, items)
            self._set_running(False)

    def _set_running(self, running: bool) -> None:
        self.run_button.disabled = running
        self.stop_button.disabled = not running or self.distributed

    def _set_status(self, text: str) -> None:
        self.status.value = text


def show_result(frame, title: str) -> None:
    """The comparison figure (a static plotly figure) and predicted-beside-measured table (its
    numbers with their units)."""
    go.Figure(viz.variant_comparison(frame, title=title)).show()
    if viz.multi_rank(frame):
        go.Figure(viz.rank_comparison(frame, title=f"{title}: every rank")).show()
    display(viz.readable(viz.predicted_table(frame)))
    skipped = viz.not_run(frame)
    if not skipped.empty:
        display(skipped)


def build_panel(name: str, **kwargs: Any) -> W.Widget:
    """The panel's widget, ready to display."""
    return Panel(name, **kwargs).widget
