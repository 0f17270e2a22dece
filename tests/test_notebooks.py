"""Every notebook is executed once, by papermill at the tiny preset in report mode (one with its
panel shown, as in JupyterLab), through `labkit report`'s own code path (`run_report`, two
notebooks at a time: conftest's session fixture `report`); the tests below read those executed
notebooks, their HTML pages and the index."""
import json
import re
from pathlib import Path

import pandas as pd
import pytest

from conftest import PARAMETERS, needs

from labkit.report import find_notebooks

pytestmark = needs("papermill", "nbconvert")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.notebook
def test_the_plan_sized_every_notebook_down_to_its_quickest(report):
    """Every notebook predicted beside measured; each one sized down to its quickest size (the
    budget is one second), where its parameters leave a smaller size to take."""
    import papermill

    from labkit.report.plan import levels
    from labkit.techniques import notebook_names

    names = notebook_names()
    for run in report.notebooks:
        known = papermill.inspect_notebook(str(NOTEBOOKS / f"{run.stem}.ipynb"))
        count = len(levels(run.stem, names.get(run.stem), known))
        assert run.predicted_s > 0 and run.seconds > 0, run
        assert bool(run.sizing) == (run.level > 0), run
        if run.level:  # its quickest: a budget of one second fits nothing
            assert 0 < run.level < count and "still over it at its quickest size" in run.sizing, run


def test_every_notebook_is_covered_committed_clean_with_one_parameters_cell():
    assert sorted(find_notebooks(NOTEBOOKS)) == sorted(PARAMETERS)
    for path in NOTEBOOKS.glob("*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        assert not any(c.get("outputs") for c in cells), path
        tagged = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
        assert len(tagged) == 1, path
        assert "interactive" in "".join(tagged[0]["source"]) or path.stem == "00_environment", path


def outputs_of(nb: dict) -> list[dict]:
    return [o for c in nb["cells"] for o in c.get("outputs", [])]


@pytest.mark.notebook
@pytest.mark.parametrize("stem", sorted(PARAMETERS))
def test_notebook_runs_in_report_mode(stem, report):
    run = next(n for n in report.notebooks if n.stem == stem)
    assert (run.status, run.error) == ("ok", "")
    nb = json.loads((report.out / f"{stem}.ipynb").read_text())
    outputs = outputs_of(nb)
    assert not [o for o in outputs if o["output_type"] == "error"]
    text = json.dumps(outputs)
    if stem != "25_quiz":  # the quiz measures nothing
        assert "cpu" in (text.lower() if stem == "98_leaderboard" else text)  # its machine: "CPU ..."
    # report mode: no panel (but where the notebook's parameters turn interactive on)
    assert ("application/vnd.jupyter.widget-view+json" in text) == PARAMETERS[stem].get("interactive", False)
    figures = text.count("application/vnd.plotly.v1+json")
    if stem == "25_quiz":  # report mode: an answer key, no figures
        assert text.count("Why: ") == 3 and "questions" in text
    elif stem == "98_leaderboard":  # results of others, no predictions: the tables and the bars
        assert figures == 1 and "fastest decoding" in text and "run_id" in text and "kv_cache" in text
    elif stem != "00_environment":
        assert figures >= 1  # the comparison figure
        assert "predicted" in text and "measured" in text  # predicted beside measured
        assert (report.out / f"{stem}.ipynb").stat().st_size < 1_000_000  # static, no plotly.js
    else:
        assert "peak TFLOP/s" in text and "reason" in text
    if "nproc" in PARAMETERS[stem]:  # a multi-process experiment: every rank's bars
        assert "rank 1" in text and "every rank" in text
    page = (report.out / f"{stem}.html").read_text()
    assert page.count('class="plotly-graph-div"') == figures  # every figure drawn on its page


@pytest.mark.notebook
def test_index_lists_every_notebook_with_its_page_and_the_headline_numbers(report):
    index = (report.out / "index.html").read_text()
    stems = sorted(find_notebooks(NOTEBOOKS))
    assert [n.stem for n in report.notebooks] == stems
    for stem in stems:
        assert f"href='{stem}.html'" in index and (report.out / f"{stem}.html").exists()
    assert index.count("class='ok'") == len(stems) and "class='failed'" not in index
    assert "<details id='kv_cache'>" in index and "kv_bytes_per_token" in index
    # the H200 reference beside this machine's runs, in the experiments' and the compare notebooks
    assert "NVIDIA H200" in json.dumps(outputs_of(json.loads((report.out / "20_matmul.ipynb").read_text())))
    assert "bf16 matmul TFLOP/s" in json.dumps(outputs_of(json.loads((report.out / "99_compare.ipynb").read_text())))
    assert "git commit" in index and "torch" in index
    assert set(pd.read_csv(report.out / "results.csv")["experiment"]) >= {"kv_cache", "matmul", "zero"}


# A tag that loads from a network address: src= or href= with http(s):// or protocol-relative //.
NETWORK_REF = re.compile(r"""<(?:script|link|img|iframe|source|embed)\b[^>]*\b(?:src|href)\s*=\s*"""
                         r"""["']?(?:https?:)?//""", re.IGNORECASE)


@pytest.mark.notebook
def test_pages_load_nothing_from_the_network_and_share_one_plotly_js(report):
    pages = sorted(report.out.glob("*.html"))
    assert len(pages) == len(report.notebooks) + 1  # one per notebook and the index
    assert [p.name for p in report.out.rglob("plotly.min.js")] == ["plotly.min.js"]
    assert (report.out / "plotly.min.js").stat().st_size > 1_000_000
    for page in pages:
        text = page.read_text()
        assert not NETWORK_REF.findall(text), page
        assert not re.search(r"@import|url\(\s*['\"]?(?:https?:)?//", text), page  # no remote CSS/fonts
        assert text.count("<script src='plotly.min.js'>") + text.count('<script src="plotly.min.js">') == 1
        assert page.stat().st_size < 2_000_000, page  # plotly.js is not embedded


@pytest.mark.notebook
def test_interactive_mode_shows_the_panel(report):
    """With `interactive` on (what JupyterLab gets by default), the widget panel is displayed;
    widget state is not stored, so the executed notebook stays small."""
    stem, = (s for s, p in PARAMETERS.items() if p.get("interactive"))
    path = report.out / f"{stem}.ipynb"
    assert "application/vnd.jupyter.widget-view+json" in json.dumps(outputs_of(json.loads(path.read_text())))
    assert path.stat().st_size < 1_000_000


def _built(names: dict) -> dict[str, str]:
    """What a rebuild writes (stable cell ids, as the builder's __main__ sets them), by file name."""
    import nbformat

    out = {}
    for filename, nb in names.items():
        for i, cell in enumerate(nb.cells):
            cell.id = f"cell-{i:02d}"
        out[filename] = nbformat.writes(nb) + "\n"
    return out


@pytest.mark.parametrize("folder", ["", "exercises"])
@pytest.mark.slow
def test_committed_notebooks_are_what_their_builder_writes(folder, monkeypatch):
    """Every notebook regenerated in memory equals the committed file (cells' source and
    metadata, ids, the notebook's metadata): the cells live in the builders and the prose in
    notebooks/text/, so a notebook edited by hand, or a builder or text edited without a
    rebuild, is drift."""
    import importlib.util

    root = NOTEBOOKS / folder
    builder = root / ("build_exercises.py" if folder else "build_notebooks.py")
    monkeypatch.syspath_prepend(str(root))
    spec = importlib.util.spec_from_file_location(f"_builder_{folder or 'main'}", builder)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names = module.notebook_names() if folder else module.NOTEBOOKS
    if folder:
        names = {f: module.exercise_notebook(ex) for f, ex in names.items()}
    built = _built(names)
    assert sorted(built) == sorted(p.name for p in root.glob("*.ipynb"))
    stale = [f for f, text in built.items() if (root / f).read_text() != text]
    assert not stale, f"rebuild with python {builder.relative_to(NOTEBOOKS.parent)}: {stale}"


# Readings from one machine go stale on any other: core counts, "this CPU", measured times and
# rates in prose. Predicted numbers are rendered at run time instead (plan_view.show_predicted).
SINGLE_MACHINE = re.compile(r"\b\d+-core\b|\bthis (?:loaded |shared )?CPU\b|\bin one run here\b"
                            r"|\b(?:reached|measured|ran at|took) \d|\b\d[\d.,]*(?:-\d[\d.,]*)? ?(?:ms|s)\b"
                            r"|\b\d[\d.,]* tokens/s\b", re.IGNORECASE)


def _markdown(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


def test_no_notebook_text_holds_one_machines_readings():
    texts = {p.name: p.read_text() for p in (NOTEBOOKS / "text").glob("*.md")}
    texts.update({p.name: _markdown(p) for p in NOTEBOOKS.glob("*.ipynb")})
    assert len(texts) > 2 * 28
    found = {name: SINGLE_MACHINE.findall(text) for name, text in texts.items()}
    assert not {name: hits for name, hits in found.items() if hits}
    for reading in ("on a 2-core CPU", "on this CPU", "reached 0.22 TFLOP/s", "85-90 ms", "2.4 s",
                    "348 tokens/s", "in one run here"):
        assert SINGLE_MACHINE.search(reading), reading  # the check can fail


def _builder():
    import importlib.util
    import sys

    sys.path.insert(0, str(NOTEBOOKS))
    try:
        spec = importlib.util.spec_from_file_location("_builder_text", NOTEBOOKS / "build_notebooks.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(NOTEBOOKS))
    return module


@pytest.mark.slow
def test_every_experiment_notebook_comes_from_its_record_and_every_section_is_used():
    """The builder makes one notebook per experiment record with a notebook, with the record's
    CPU ranks; each text file is a notebook's (or the template's), and no section goes unread."""
    from labkit.techniques import records

    builder = _builder()
    for name, rec in records().items():
        nb = builder.NOTEBOOKS[Path(rec.notebook).name]
        parameters = "".join(nb.cells[1].source)
        assert (f"else {rec.cpu_ranks} CPU ranks" in parameters) == rec.distributed, name
    stems = {Path(f).stem for f in builder.NOTEBOOKS} | {"_experiment"}
    assert {p.stem for p in (NOTEBOOKS / "text").glob("*.md")} == stems
    sources = "\n".join("".join(c.source) for nb in builder.NOTEBOOKS.values() for c in nb.cells)
    for stem in stems:
        for section, body in builder.read_text(stem).items():
            assert body and body in sources, (stem, section)


@pytest.mark.slow
def test_each_notebooks_predicted_metrics_are_predicted_on_the_cpu():
    """A metric named for a notebook's predictions that expected() never returns would always
    read "not predicted": every one is predicted at the tiny preset on the CPU."""
    from labkit.views import plan as plan_view

    builder = _builder()
    for name, spec in builder.EXPERIMENTS.items():
        sweep = json.loads(spec.get("sweep", "{}"))
        first = {k: v[:1] for k, v in sweep.items()}
        text = plan_view.predicted_lines(name, spec["predicted"], preset="tiny",
                                         overrides={"device": "cpu"}, sweep=first)
        assert "not predicted for this config" not in text, (name, text)
        assert all(f"`{m}`" in text for m in spec["predicted"]), name


def test_predicted_lines_render_expected_for_the_notebooks_own_config():
    import dataclasses

    from labkit.views import plan as plan_view
    from labkit.config import ConfigError
    from labkit.harness.experiment import plan_points
    from labkit.results import format_value
    from labkit.techniques import record

    settings = dict(preset="tiny", overrides={"device": "cpu", "nproc": 2}, sweep={"micro_batches": [1, 2]})
    text = plan_view.predicted_lines("pipeline_parallel", ("ideal_bubble_fraction",), **settings)
    blocks = text.split("\n\n")
    assert len(blocks) == 2 and blocks[0].startswith("**Predicted by `expected()` at micro_batches=1**")
    assert "preset tiny" in blocks[0] and "nproc 2" in blocks[0] and "on cpu" in blocks[0]
    # (p - 1) / (m + p - 1) on 2 stages: 1/2 at m = 1, 1/3 at m = 2; 1F1B needs m >= p
    assert "gpipe 50%" in blocks[0] and "not predicted, cannot run here: 1f1b" in blocks[0]
    (_, cfg), = plan_points("pipeline_parallel", "tiny", {"device": "cpu", "nproc": 2}, {"micro_batches": [2]})
    third = record("pipeline_parallel").expected(dataclasses.replace(cfg, variant="1f1b"))
    assert third["ideal_bubble_fraction"] == pytest.approx(1 / 3)
    assert f"1f1b {format_value('ideal_bubble_fraction', third['ideal_bubble_fraction'])}" in blocks[1]
    same = plan_view.predicted_lines("load_balance", ("param_bytes", "wait_ms"), preset="tiny",
                                     overrides={"device": "cpu"})
    assert "(every variant)" in same and "- `wait_ms`: not predicted for this config" in same
    with pytest.raises(ConfigError, match="valid"):
        plan_view.predicted_lines("load_balance", ("param_bytes",), preset="tiny", variants=["nope"])
