import json

import pytest

from conftest import TINY_DECODE
from labkit.cli import main

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")


def test_report_reports_a_failed_notebook_runs_the_others_and_exits_1(tmp_path, capsys):
    """`labkit report` end to end on two notebooks, each in its own kernel (`--jobs 2`: the
    shared report in conftest runs every notebook on one), one made to fail by a setting its
    experiment refuses."""
    pytest.importorskip("papermill")
    out = tmp_path / "report"
    argv = ["report", "--out", str(out), "--preset", "tiny", "--only", "matmul", "--only", "25_quiz",
            "--jobs", "2", "--set", "size=100"]  # matmul's size must be a multiple of 128
    assert main(argv) == 1
    assert "20_matmul failed: ConfigError: m=100 must be a multiple of 128" in capsys.readouterr().err
    index = (out / "index.html").read_text()
    assert "class='failed'" in index and "m=100 must be a multiple of 128" in index
    assert "href='25_quiz.html'" in index and index.count("class='ok'") == 1
    failed = json.loads((out / "20_matmul.ipynb").read_text())  # the executed notebook is kept
    errors = [o for c in failed["cells"] for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert [e["ename"] for e in errors] == ["ConfigError"]
    assert "ConfigError" in (out / "20_matmul.html").read_text()  # its partial page is rendered
    assert "Why: " in (out / "25_quiz.html").read_text()  # the other one ran: its answer key
    assert (out / "summary.md").exists() and (out / "plotly.min.js").exists()


@pytest.mark.parametrize("argv, message", [
    (["--only", "nope"], "unknown experiment or notebook 'nope'; valid: mixed_precision, kv_cache"),
    (["--only", "matmul,21_nope"], "unknown experiment or notebook '21_nope'"),
    (["--preset", "huge"], "unknown preset 'huge'; valid: tiny"),
    (["--set", "no_such_knob=1"], "unknown setting 'no_such_knob'; valid: "),
])
def test_report_bad_input_is_one_line_and_exit_2_before_anything_runs(argv, message, tmp_path, capsys):
    assert main(["report", "--out", str(tmp_path / "r")] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_panel_controls_come_from_the_config_and_run_goes_through_the_harness(tmp_path):
    import ipywidgets as W

    from labkit.ui.widgets import Panel

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
    from labkit.ui.widgets import Panel

    panel = Panel("kv_cache", overrides=TINY_DECODE, runs_dir=str(tmp_path))
    panel.controls["new_tokens"].value = 5000  # beyond the tiny model's 2048-token context
    panel.run()
    assert "longer than the model's context" in panel.error and panel.frame is None
    assert not panel.run_button.disabled and not list(tmp_path.glob("*.json"))


def test_the_cpu_report_sweeps_name_notebooks_and_parameters_they_have():
    """A typo in report.CPU_REPORT_PARAMETERS would be passed to no notebook, silently."""
    import papermill

    from labkit.report import CPU_REPORT_PARAMETERS, find_notebooks

    found = find_notebooks()
    for stem, params in CPU_REPORT_PARAMETERS.items():
        assert stem in found, stem
        known = papermill.inspect_notebook(str(found[stem]))
        assert set(params) <= set(known), (stem, set(params) - set(known))


def test_notebooks_are_matched_to_experiments_by_their_records():
    from pathlib import Path

    from labkit.report import (choose_notebooks, experiment_settings, find_notebooks,
                               notebook_experiments)
    from labkit.techniques import records

    found = find_notebooks()
    for name, exp in records().items():
        assert choose_notebooks(found, [name]) == [Path(exp.notebook).stem]
    assert choose_notebooks(found, ["compile", "18_compile", "00_environment"]) == ["18_compile",
                                                                                   "00_environment"]
    assert notebook_experiments()["18_compile"].name == "compile"
    assert experiment_settings("00_environment") is None and experiment_settings("99_compare") is None
    assert "target" in experiment_settings("18_compile") and "num_layers" in experiment_settings("18_compile")
