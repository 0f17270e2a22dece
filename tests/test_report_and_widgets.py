import pandas as pd
import pytest

from conftest import FAST, TINY_DECODE
from labkit.cli import main

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")


def test_report_writes_table_summary_and_figures(tmp_path, capsys):
    """The report's mechanics on three experiments (every experiment runs in its notebook's test;
    all of them here would cost minutes)."""
    out = tmp_path / "report"
    settings = {**FAST, "num_layers": 1, "seq_len": 8, "batch_size": 2}
    chosen = ["mixed_precision", "kv_cache", "memory_pool"]
    argv = ["report", "--out", str(out), "--only", "mixed_precision,kv_cache", "--only", "memory_pool"]
    assert main(argv + [f"--set={k}={v}" for k, v in settings.items()]) == 0
    table = pd.read_csv(out / "results.csv")
    assert set(table["experiment"]) == set(chosen)
    assert set(table["variant"]) >= {"fp32", "bf16_weights", "none", "dynamic"}
    summary = (out / "summary.md").read_text()
    assert "## kv_cache" in summary and "kv_bytes_per_token" in summary
    html = (out / "figures.html").read_text()
    assert html.count("plotly-graph-div") == len(chosen) and "tokens_per_s" in html
    assert len(list((out / "runs").glob("*.json"))) == len(chosen)
    assert main(["report", "--out", str(out), "--only", "nope"]) == 2
    assert "unknown experiment 'nope'; valid: " in capsys.readouterr().err


def test_panel_controls_come_from_the_config_and_run_goes_through_the_harness(tmp_path):
    import ipywidgets as W

    from labkit.widgets import Panel

    panel = Panel("kv_cache", overrides=TINY_DECODE, runs_dir=str(tmp_path))
    assert panel.preset.value == "tiny" and panel.controls["new_tokens"].value == 6
    assert isinstance(panel.controls["attention"], W.Dropdown)
    assert panel.controls["batch_size"].min == 1  # the valid range comes from the config
    panel.variants.value = ("dynamic",)
    panel.run()
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert not panel.run_button.disabled
    assert panel.error is None and set(panel.frame["variant"]) == {"none", "dynamic"}
    assert "kv_bytes_per_token" in set(panel.frame["metric"])


def test_panel_shows_bad_settings_inside_the_panel(tmp_path):
    from labkit.widgets import Panel

    panel = Panel("kv_cache", overrides=TINY_DECODE, runs_dir=str(tmp_path))
    panel.controls["new_tokens"].value = 5000  # beyond the tiny model's 2048-token context
    panel.run()
    assert "longer than the model's context" in panel.error and panel.frame is None
    assert not panel.run_button.disabled and not list(tmp_path.glob("*.json"))
