"""The exercises: every one graded correct in solution mode and a wrong prediction graded wrong
(through labkit.study.exercises directly), and an exercise notebook of each kind executed by
papermill in solution mode. Each run behind the exercises is measured once per session into one
shared folder; the checks and the notebooks reuse them."""
import math
from pathlib import Path

import pytest

from conftest import WALL_CLOCK, execute_notebooks
from labkit.study import exercises
from labkit.config import ConfigError

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

ROOT = Path(__file__).resolve().parents[1] / "notebooks" / "exercises"


def exercise_notebooks():
    """The exercises' notebooks (the labs' `NN_lab_*` ones are tested in tests/test_labs.py)."""
    return [p for p in sorted(ROOT.glob("*.ipynb")) if p.stem.split("_", 1)[1] not in exercises.LABS]


def one_of_each_kind():
    """The first exercise notebook of each kind: the Run whose rows it reads, formula or
    measurement, a number or a choice. The notebooks are one builder's template
    (`exercise_notebook`, to which test_notebooks.py holds every committed one) that differ only
    in the exercise's key, and every exercise's check is graded in-process below
    (test_solution_graded_correct_and_a_wrong_prediction_graded_wrong)."""
    chosen = {}
    for path in exercise_notebooks():
        ex = exercises.get(path.stem.split("_", 1)[1])
        chosen.setdefault((ex.run, ex.graded_against, bool(ex.choices)), path)
    return list(chosen.values())


def wrong_answer(ex):
    """A prediction outside the tolerance (a number) or another option (a choice)."""
    ref = exercises.reference_answer(ex.key, "cpu")
    if ex.choices:
        return next(c for c in ex.choices if c != ref)
    return ref + 2 * ex.tolerance(ref) + 1.0


def test_counts_topics_and_fields():
    assert len(exercises.EXERCISES) >= 30
    topics = {ex.topic for ex in exercises.EXERCISES.values()}
    assert topics == set(exercises.TOPICS) - {"Troubleshooting lab"}  # the labs: tests/test_labs.py
    assert len(exercises.LABS) >= 10 and not set(exercises.LABS) & set(exercises.EXERCISES)
    for ex in exercises.EXERCISES.values():
        assert ex.run in exercises.RUNS and ex.title and ex.scenario and ex.question
        assert ex.graded_against in ("formula", "measurement")
        assert (ex.measured is not None) == (ex.graded_against == "measurement")
        assert isinstance(exercises.reference_answer(ex.key, "cpu"), str) == bool(ex.choices)


def test_the_exercises_launch_ranks_eight_times():
    """Each gloo launch costs 6-12 s: the exercises of one distributed experiment share one, but
    for the pipeline's two (a delayed stage's sweep; schedules with two modules a rank) and the
    recipe's two (the ladder's rungs; the chunked loss, 8-bit AdamW and packing)."""
    from labkit.techniques import record

    dist = [r.experiment for r in exercises.RUNS.values() if record(r.experiment).distributed]
    assert sorted(dist) == sorted(["zero", "pipeline_parallel", "pipeline_parallel", "recipe", "recipe",
                                   "context_parallel", "moe", "grad_compression"])


def test_closed_forms_match_torch_and_the_papers():
    import torch

    for v in (1e-8, 3e-8, 6e-8, 1e-5, 0.1, 123.456, 65504.0, 65519.0, 65520.0, 70000.0):
        assert exercises.fp16_round(v) == torch.tensor(v).half().item(), v
    assert exercises.ring_allreduce_bytes(1000, 2) == 1000 and exercises.ring_allreduce_bytes(800, 4) == 1200
    assert exercises.tensor_core_friendly(4096, 4096, 8) and not exercises.tensor_core_friendly(4095, 4096, 8)


def test_bad_input_is_one_line_naming_the_valid_choices():
    with pytest.raises(ConfigError, match=f"valid: {next(iter(exercises.EXERCISES))}, "):
        exercises.get("nope")
    with pytest.raises(ConfigError, match="valid: compute-bound, memory-bound"):
        exercises.parse_prediction(exercises.get("roofline_bound"), "fast")
    with pytest.raises(ConfigError, match="finite number in MiB"):
        exercises.parse_prediction(exercises.get("peak_memory"), "lots")
    with pytest.raises(ConfigError, match="enter a prediction"):
        exercises.check("peak_memory", None, device="cpu")


@pytest.mark.parametrize("key", list(exercises.EXERCISES))
def test_solution_graded_correct_and_a_wrong_prediction_graded_wrong(key, shared_runs):
    ex = exercises.get(key)
    right = exercises.check(key, solution=True, device="cpu", runs_dir=shared_runs)
    assert "reused" in right.source  # the session's measurement, not a new run
    report = right.report()
    assert "{" not in report and "n/a" not in report, report
    if ex.graded_against == "measurement":
        # graded against this machine's timing (which run was faster): the verdict is the
        # measurement's, whichever it is; the grading itself is tested on given numbers below
        rows = exercises.measure(exercises.RUNS[ex.run], "cpu", shared_runs)
        assert right.reference == ex.measured(rows)
        assert right.correct == (right.prediction == right.reference), report
        wrong = next(c for c in ex.choices if c != right.reference)
    else:
        assert right.correct and report.startswith("Graded: correct"), report
        if not ex.choices:  # the answer is not the measurement
            assert right.reference == exercises.reference_answer(key, "cpu")
        wrong = wrong_answer(ex)
    wrong = exercises.check(key, wrong, device="cpu", runs_dir=shared_runs)
    assert not wrong.correct and wrong.report().startswith("Graded: wrong"), wrong.report()


def test_kv_speedup_grades_the_verdict_of_the_tokens_per_s_it_is_given():
    """The kv_speedup verdict on given tokens/s (dynamic, none): faster beyond 1.2x either way."""
    ex = exercises.get("kv_speedup")
    assert exercises.reference_answer("kv_speedup", "cpu") == "the cached run"  # FLOPs: many x
    cases = {(300.0, 100.0): "the cached run", (121.0, 100.0): "the cached run",
             (120.0, 100.0): "about the same", (100.0, 110.0): "about the same",
             (100.0, 130.0): "the uncached run"}
    for (cached, uncached), verdict in cases.items():
        rows = exercises.Rows([{"variant": v, "metric": "tokens_per_s", "value": tps, "rank": 0,
                                "status": "ok", "params": {"sweep": {}}}
                               for v, tps in (("dynamic", cached), ("none", uncached))], "given")
        measured = ex.measured(rows)
        assert measured == verdict, (cached, uncached, measured)
        assert [c for c in ex.choices if exercises.grade(ex, c, measured)] == [verdict]


def test_every_exercise_has_a_level_a_hint_a_common_mistake_and_a_check_of_its_evidence():
    for ex in exercises.EXERCISES.values():
        assert ex.level in exercises.LEVELS and ex.hint and ex.supports is not None, ex.key
        if ex.choices:
            assert set(ex.feedback) == set(ex.choices), ex.key
        else:
            assert ex.mistake is not None and ex.mistake_why, ex.key
    levels = [ex.level for ex in exercises.EXERCISES.values()]
    assert levels == sorted(levels)  # ordered by level, as the notebooks are numbered


def with_value(rows, variant: str, metric: str, value: float):
    """The rows with `variant`'s `metric` (every rank and point) set to `value`."""
    changed = [{**r, "value": value} if (r["variant"], r["metric"]) == (variant, metric) else r
               for r in rows.rows]
    return exercises.Rows(changed, rows.source, rows.run_id)


@pytest.mark.parametrize("key", list(exercises.EXERCISES))
def test_the_measurement_supports_the_answer(key, shared_runs):
    """The measured rows show what the answer claims (bytes, FLOPs, counts, statuses)."""
    ex = exercises.get(key)
    rows = exercises.measure(exercises.RUNS[ex.run], "cpu", shared_runs)
    setup = exercises.Setup(exercises.RUNS[ex.run], "cpu")
    assert "reused" in rows.source
    if key not in WALL_CLOCK:
        assert ex.supports(rows, setup) is None
        return
    variant, metric, good, bad = WALL_CLOCK[key]
    assert ex.supports(with_value(rows, variant, metric, good), setup) is None
    assert ex.supports(with_value(rows, variant, metric, bad), setup) is not None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_answer_key_holds_on_a_cpu_and_a_gpu_and_rejects_each_common_mistake(device):
    table = exercises.answer_table((device,))
    assert len(table) == len(exercises.EXERCISES)
    numeric = table[table["mistake_rejected"].notna()]
    assert numeric["mistake_rejected"].all(), numeric[~numeric["mistake_rejected"].astype(bool)]
    for key, ref in zip(table["exercise"], table[f"reference_{device}"]):
        ex = exercises.get(key)
        assert ref in ex.choices if ex.choices else math.isfinite(ref), (key, ref)


def test_measurement_graded_exercises_say_so(shared_runs):
    out = exercises.check("kv_speedup", "the cached run", device="cpu", runs_dir=shared_runs)
    assert "graded against the measurement: there is no formula" in out.report()


def test_widget_grades_what_is_entered(shared_runs, capsys):
    pytest.importorskip("ipywidgets")
    panel = exercises.widget("roofline_bound", device="cpu", runs_dir=shared_runs)
    box, button, _hint = panel.children[0].children
    assert tuple(box.options) == exercises.get("roofline_bound").choices
    box.value = next(c for c in box.options if c != exercises.reference_answer("roofline_bound", "cpu"))
    button.click()  # outside a kernel the Output widget lets the report through to stdout
    assert "Graded: wrong" in capsys.readouterr().out
    number = exercises.widget("peak_memory", device="cpu", runs_dir=shared_runs).children[0].children[0]
    assert type(number).__name__ == "FloatText"


def test_tolerance_edges():
    ex = exercises.get("peak_memory")
    ref = exercises.reference_answer("peak_memory", "cpu")
    inside, outside = ref * (1 + ex.rel_tol - 1e-3), ref * (1 + ex.rel_tol + 1e-3)
    assert exercises.grade(ex, inside, ref) and not exercises.grade(ex, outside, ref)
    assert not math.isnan(ex.tolerance(ref))


@pytest.fixture(scope="module")
def executed(shared_runs, notebook_kernel, tmp_path_factory):
    """One exercise notebook of each kind in solution mode (`one_of_each_kind`), then the first
    as a learner opens it (its default parameters), on one warm kernel: {(stem, "solution" or
    "default"): (the executed notebook's path, its printed text)}."""
    pytest.importorskip("papermill")
    folder = tmp_path_factory.mktemp("exercise-notebooks")
    solution = {"solution": True, "interactive": False, "device": "cpu", "runs_dir": shared_runs}
    jobs = [(p, folder / p.name, solution) for p in one_of_each_kind()]
    first = exercise_notebooks()[0]
    jobs.append((first, folder / "default.ipynb", {"device": "cpu"}))
    texts = execute_notebooks(notebook_kernel, jobs)
    return {(p.stem, "default" if out.name == "default.ipynb" else "solution"): (out, text)
            for (p, out, _), text in zip(jobs, texts)}


@pytest.mark.notebook
def test_an_exercise_notebook_of_each_kind_in_solution_mode(executed):
    assert {p.stem.split("_", 1)[1] for p in exercise_notebooks()} == set(exercises.EXERCISES)
    paths = one_of_each_kind()
    assert {exercises.get(p.stem.split("_", 1)[1]).run for p in paths} == \
        {exercises.get(k).run for k in exercises.EXERCISES}  # every Run's rows read in a kernel
    for path in paths:
        _, text = executed[path.stem, "solution"]
        # the textbook answer of an exercise graded against this machine's measurement (which is
        # faster) can lose to it where the cores are busy or slow: a verdict, whichever it is
        by_measurement = exercises.get(path.stem.split("_", 1)[1]).graded_against == "measurement"
        verdict = "Graded: " if by_measurement else "Graded: correct"
        assert verdict in text and "reused" in text, (path.name, text[-2000:])


@pytest.mark.notebook
def test_an_exercise_notebook_by_default_asks_for_a_prediction(executed):
    """What a learner opens: no prediction yet, so nothing is graded or run; the box is shown."""
    import nbformat

    out, text = executed[exercise_notebooks()[0].stem, "default"]
    outputs = [o for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code" for o in c.outputs]
    assert "Enter your prediction" in text and "Graded" not in text
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outputs)


def test_notebooks_committed_clean_with_one_parameters_cell():
    import nbformat

    for path in exercise_notebooks():
        nb = nbformat.read(path, as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, path
        assert "prediction = None  #" in tagged[0].source and "solution = False  #" in tagged[0].source
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), path
