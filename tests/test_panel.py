"""The widget panel, headless: the buttons are clicked in code, the background run joined with
`wait()`, then the store, the live figure, the monitor and the error/status areas are checked."""
import dataclasses
import json

import pytest

from conftest import TINY_DECODE

W = pytest.importorskip("ipywidgets")
pytest.importorskip("plotly")

from labkit.ui import widgets  # noqa: E402
from labkit.config import ConfigError, RunConfig, knob  # noqa: E402
from labkit.ui.widgets import Panel, config_controls, parse_sweep_text  # noqa: E402

SIZES = {**TINY_DECODE, "new_tokens": 4}


def stored(tmp_path):
    """The one run record in `tmp_path`."""
    (path,) = tmp_path.glob("*.json")
    return json.loads(path.read_text())


def outputs_text(panel) -> str:
    return "".join(o["data"]["text/plain"] for o in panel.output.outputs)


def drawn(charts) -> list[dict]:
    """The figures a panel's charts area (an Output) holds, what JupyterLab draws, as plotly's JSON."""
    return [o["data"]["application/vnd.plotly.v1+json"] for o in charts.outputs]


@dataclasses.dataclass(kw_only=True)
class Knobs(RunConfig):
    heads: int = knob(4, min=1, max=16, help="small range: a slider")
    width: int = knob(64, min=8, max=4096, help="large range: a bounded box")
    ratio: float = knob(0.5, min=0.0, max=1.0, help="a bounded float")
    fused: bool = knob(False, help="a flag")


def test_controls_take_their_kind_and_range_from_the_config():
    c = config_controls(Knobs)
    assert isinstance(c["heads"], W.IntSlider) and (c["heads"].min, c["heads"].max) == (1, 16)
    assert isinstance(c["width"], W.BoundedIntText) and (c["width"].min, c["width"].max) == (8, 4096)
    assert isinstance(c["ratio"], W.BoundedFloatText) and c["ratio"].max == 1.0
    assert isinstance(c["fused"], W.Checkbox) and isinstance(c["dtype"], W.Dropdown)
    assert isinstance(c["batch_size"], W.BoundedIntText) and c["batch_size"].min == 1
    assert "variant" not in c and "device" not in c and "preset" not in c


def test_sweep_text_uses_the_cli_syntax():
    assert parse_sweep_text("") == {}
    assert parse_sweep_text("new_tokens=2,4; batch_size=1") == {"new_tokens": ["2", "4"],
                                                                  "batch_size": ["1"]}
    with pytest.raises(ConfigError, match="key=value"):
        parse_sweep_text("new_tokens")


@pytest.mark.slow
def test_run_button_measures_in_the_background_and_draws_the_points(tmp_path):
    panel = Panel("kv_cache", device="cpu", overrides=SIZES, runs_dir=str(tmp_path), min_interval_s=0)
    panel.variants.value = ("dynamic",)
    panel.sweep.value = "new_tokens=2,3"
    panel.run_button.click()
    assert panel.wait(60) and panel.error is None and not panel.stopped
    assert not panel.run_button.disabled and panel.stop_button.disabled
    record = stored(tmp_path)
    assert record["status"] == "complete" and len(record["rows"]) == len(panel.frame) == len(panel.rows)
    assert set(panel.frame["variant"]) == {"none", "dynamic"} and panel.points_done == 2
    # the live figure holds a bar per variant at each point
    names = {t.name for t in panel.figure.data}
    assert "tokens_per_s" in names and "kv_bytes" in names
    bars = next(t for t in panel.figure.data if t.name == "tokens_per_s")
    assert set(bars.x) == {"none new_tokens=2", "dynamic new_tokens=2", "none new_tokens=3",
                           "dynamic new_tokens=3"}
    # the monitor ran beside it: samples, and one mark where each variant at each point began
    assert list(panel.monitor.markers()["phase"]) == ["none new_tokens=2", "dynamic new_tokens=2",
                                                      "none new_tokens=3", "dynamic new_tokens=3"]
    assert len(panel.monitor.frame()) >= 2
    marks = [t for t in panel.monitor_figure.data if t.mode == "markers"]
    assert marks and all(len(t.x) == 4 for t in marks)
    # and the browser is sent both as they stand: the last draw landed
    live, monitor = drawn(panel.charts)
    assert set(next(t for t in live["data"] if t["name"] == "tokens_per_s")["x"]) == set(bars.x)
    assert sum(t.get("mode") == "markers" for t in monitor["data"]) == len(marks)
    assert "done: 2 point(s)" in panel.status.value


def test_a_run_that_raises_shows_its_error_in_the_panel_and_gives_the_buttons_back(tmp_path, monkeypatch):
    panel = Panel("kv_cache", device="cpu", overrides=SIZES, runs_dir=str(tmp_path))
    panel.controls["new_tokens"].value = 5000  # the experiment refuses it (beyond the context)
    panel.run_button.click()
    assert panel.wait(30) and "longer than the model's context" in panel.error
    assert "longer than the model's context" in outputs_text(panel) and "error" in panel.status.value
    assert not panel.run_button.disabled and panel.stop_button.disabled

    def crash(*args, **kwargs):
        raise RuntimeError("the store is full")

    monkeypatch.setattr(widgets, "run_experiment", crash)
    panel.controls["new_tokens"].value = 4
    panel.run_button.click()
    assert panel.wait(30) and panel.error == "RuntimeError: the store is full"
    assert "RuntimeError: the store is full" in outputs_text(panel)
    assert not panel.run_button.disabled and not list(tmp_path.glob("*.json"))


@pytest.mark.slow
def test_stop_ends_a_sweep_early_and_keeps_the_finished_points(tmp_path):
    panel = Panel("kv_cache", device="cpu", overrides=SIZES, runs_dir=str(tmp_path), min_interval_s=0)
    panel.variants.value = ("dynamic",)
    panel.sweep.value = "new_tokens=2,3,4"
    harness_callback = panel._on_rows

    def press_stop_after_the_first_point(rows):
        harness_callback(rows)
        if panel.points_done == 1:
            panel.stop_button.click()

    panel._on_rows = press_stop_after_the_first_point
    panel.run_button.click()
    assert panel.wait(60) and panel.stopped and panel.error is None
    assert "stopped after 1 of 3 points" in panel.status.value
    assert not panel.run_button.disabled and panel.stop_button.disabled
    record = stored(tmp_path)  # the harness kept every row measured before the stop
    assert record["status"] == "interrupted" and len(record["rows"]) == len(panel.frame)
    points = [(r["variant"], r["params"]["sweep"]["new_tokens"]) for r in record["rows"]]
    # point 1 complete, then the variant measured when Stop was seen (point 2's reference)
    assert list(dict.fromkeys(points)) == [("none", 2), ("dynamic", 2), ("none", 3)]
    assert {t.name for t in panel.figure.data} >= {"tokens_per_s"}


def test_build_panel_returns_a_displayable_widget(tmp_path):
    widget = widgets.build_panel("kv_cache", preset="tiny", device="cpu", overrides=SIZES,
                                 runs_dir=str(tmp_path))
    assert isinstance(widget, W.VBox)
    charts = next(c for c in widget.children if isinstance(c, W.Output) and c.outputs)
    titles = [figure["layout"]["title"]["text"] for figure in drawn(charts)]
    assert titles == ["kv_cache: press Run", "device monitor"]  # drawn before any run
