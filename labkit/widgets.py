"""Widget panels built from an experiment's config: choices become dropdowns, numbers become
bounded boxes (the valid range comes from the config), plus the variants, preset, device and a
Run button. A run goes through the same `run_experiment` as the CLI; results land in the store."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from IPython.display import display

from labkit import hardware, viz
from labkit.config import PRESETS, ConfigError, default_preset, resolve, resolve_device
from labkit.distributed import RunFailed
from labkit.experiment import run_experiment
from labkit.techniques import get_experiment

# Fields the panel shows in its own controls (or not at all).
_SPECIAL = {"variant", "preset", "device", "model"}


def field_widget(f: dataclasses.Field, hint: Any) -> W.Widget | None:
    """A control for one config field, or None for a type the panel does not edit."""
    meta, label = f.metadata, {"description": f.name, "tooltip": f.metadata.get("help", ""),
                               "style": {"description_width": "initial"}}
    if meta.get("choices"):
        return W.Dropdown(options=list(meta["choices"]), value=f.default, **label)
    if hint is bool:
        return W.Checkbox(value=f.default, **label)
    lo = meta.get("min")
    if hint is int:
        return W.BoundedIntText(value=f.default, min=int(lo or 0), max=10**9, **label)
    if hint is float:
        return W.BoundedFloatText(value=f.default, min=float(lo or 0), max=1e12, **label)
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


class Panel:
    """Controls, a Run button, a figure and a table for one experiment."""

    def __init__(self, name: str, *, preset: str | None = None, device: str = "auto",
                 overrides: dict[str, Any] | None = None, runs_dir: str | None = None):
        self.name, self.runs_dir = name, runs_dir
        exp = get_experiment(name)
        self.variants = W.SelectMultiple(options=list(exp.VARIANTS), value=list(exp.VARIANTS),
                                         description="variants", rows=len(exp.VARIANTS))
        preset = preset or default_preset(resolve_device(device))
        self.preset = W.Dropdown(options=list(PRESETS), value=preset, description="preset")
        self.device = W.Dropdown(options=["auto"] + hardware.available_devices(), value=device,
                                 description="device")
        self.controls = config_controls(exp.Config)
        self.load(overrides or {})
        self.preset.observe(lambda _: self.load({}), names="value")
        self.run_button = W.Button(description="Run", button_style="primary", icon="play")
        self.run_button.on_click(lambda _: self.run())
        self.output = W.Output()
        self.frame, self.error = None, None  # the last run's rows, or why it could not run
        self.widget = W.VBox([W.HBox([self.variants, W.VBox([self.preset, self.device])]),
                              W.GridBox(list(self.controls.values()),
                                        layout=W.Layout(grid_template_columns="repeat(3, 1fr)")),
                              self.run_button, self.output])

    def load(self, overrides: dict[str, Any]) -> None:
        """Fill the controls with the resolved config of the chosen preset (plus `overrides`)."""
        cfg = resolve(get_experiment(self.name).Config, self.preset.value,
                      {**overrides, "device": self.device.value}, experiment=self.name)
        for key, widget in self.controls.items():
            value = getattr(cfg, key)
            if isinstance(widget, W.Text):  # an optional number: blank means none
                value = "" if value is None else str(value)
            widget.value = value

    def overrides(self) -> dict[str, Any]:
        values = {k: w.value for k, w in self.controls.items()}
        return {**values, "device": self.device.value}

    def run(self) -> None:
        """Run with the panel's settings; errors appear in the panel, measured rows are kept."""
        self.run_button.disabled = True
        self.output.clear_output()
        self.frame, self.error = None, None
        with self.output:
            try:
                result = run_experiment(self.name, preset=self.preset.value, overrides=self.overrides(),
                                        variants=list(self.variants.value), runs_dir=self.runs_dir)
                self.frame = result.frame()
                show_result(self.frame, self.name)
            except RunFailed as e:  # a rank crashed or hung: show what was measured before
                self.frame, self.error = e.result.frame(), str(e)
                show_result(self.frame, self.name)
                print(f"error: {self.error}")
            except Exception as e:  # shown in the panel, not lost in the log console
                self.error = str(e) if isinstance(e, ConfigError) else f"{type(e).__name__}: {e}"
                print(f"error: {self.error}")
            finally:
                self.run_button.disabled = False


def show_result(frame, title: str) -> None:
    """The comparison figure (a static plotly figure) and predicted-beside-measured table."""
    go.Figure(viz.variant_comparison(frame, title=title)).show()
    if viz.multi_rank(frame):
        go.Figure(viz.rank_comparison(frame, title=f"{title}: every rank")).show()
    display(viz.predicted_table(frame))
    skipped = viz.not_run(frame)
    if not skipped.empty:
        display(skipped)


def build_panel(name: str, **kwargs: Any) -> W.Widget:
    """The panel's widget, ready to display."""
    return Panel(name, **kwargs).widget
