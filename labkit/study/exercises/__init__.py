"""Graded exercises, "predict, then measure", and the troubleshooting lab.

Each exercise is a short scenario and one question whose answer is a number (with a unit and a
stated tolerance) or a choice. The learner enters a prediction; `check()` then runs the experiment
behind the exercise on the attached device at a small size (or reuses a complete stored run of the
very same settings), grades the prediction and explains the why with the measured numbers and the
formula. A hint is there before the answer (`hint()`); every graded attempt is stored with the
participant and team (`attempts`).

Where the answer comes from:

- `formula`: the reference answer is computed from the planner, an experiment's `expected(cfg)`
  or a closed form, *before* and *without* the measurement; the measurement is the evidence.
  It can be computed for a CUDA device on a machine without one (`reference_answer(key, "cuda")`):
  the planner then uses the GPU's implementations.
- `measurement`: there is no formula for this machine's behaviour (which variant is faster);
  the prediction is graded against what was measured, and the grade says so. Solution mode fills
  in the textbook answer (from the FLOP count) and grades it against the measurement too.
- The troubleshooting labs (`LABS`, `labkit.study.exercises.labs`) are not exercises: a setup broken on
  purpose (or a healthy decoy) is diagnosed from the measured evidence, then fixed with labkit's
  knobs and measured again (`symptoms`, `investigate`, `diagnose`, `apply_fix`).

Solution mode (`solution=True`, the papermill parameter) fills in the reference answer as the
prediction, so `papermill ... -p solution True` produces an answer key.

The exercises live in one module per topic (`memory`, `precision`, `parallel`, `profiling`,
`inference`, `quantization`, `speculative`, `serving`, `sla`, `recipes`, `finetune`, `packing`, `context`, `moe`, `compression`, `pipelines`, `labs`); `core` holds what they are made of and `runs` the measurements they share.
Their words (every exercise's and lab's title, scenario or symptoms, question, hint, why and
feedback) are Markdown, one file per key in notebooks/exercises/text/, read by `text`.
"""
from __future__ import annotations

from typing import Any

from labkit.config import ConfigError
from labkit.study.exercises import (compression, context, finetune, inference, memory, moe, packing,
                                    parallel, pipelines, precision, profiling, quantization, recipes,
                                    serving, sla, speculative)
from labkit.study.exercises.attempts import load_attempts, record_attempt
from labkit.study.exercises.core import (LEVELS, SOURCES, TOPICS, Exercise, Outcome, Rows, Run, Setup, grade,
                                   measure, measure_setup, parse_prediction, show)
from labkit.study.exercises.formulas import (faster, fp16_demo, fp16_round, ring_allreduce_bytes,
                                       tensor_core_friendly)
from labkit.study.exercises import labs
from labkit.study.exercises.labs import (DIAGNOSES, LAB_RUNS, LABS, Lab, apply_fix, diagnose, investigate,
                                   reference_fix, symptoms)
from labkit.study.exercises.runs import RUNS

__all__ = ["DIAGNOSES", "EXERCISES", "LABS", "LAB_RUNS", "LEVELS", "RUNS", "SOURCES", "TOPICS",
           "Exercise", "Lab", "Outcome", "Rows", "Run", "Setup", "answer_table", "apply_fix", "check",
           "describe", "diagnose", "faster", "fp16_demo", "fp16_round", "get", "grade", "hint",
           "investigate", "load_attempts", "measure", "parse_prediction", "record_attempt",
           "reference_answer", "reference_fix", "ring_allreduce_bytes", "show", "symptoms",
           "tensor_core_friendly", "widget"]

# The troubleshooting labs are not exercises: they live in LABS (labkit.study.exercises.labs).
_ALL = [ex for module in (memory, precision, parallel, profiling, inference, quantization,
                         speculative, serving, sla, recipes, finetune, packing, context, moe,
                         compression, pipelines)
        for ex in module.build_exercises()]
# Ordered by level (stable: within a level, in topic order), so the notebooks' numbers climb.
EXERCISES: dict[str, Exercise] = {ex.key: ex for ex in sorted(_ALL, key=lambda ex: ex.level)}


def get(key: str) -> Exercise:
    if key not in EXERCISES:
        raise ConfigError(f"unknown exercise {key!r}; valid: {', '.join(EXERCISES)}")
    return EXERCISES[key]


def describe(key: str, device: str = "auto") -> str:
    """The scenario, the question and how it is graded (no measurement: safe to show first); on
    a machine without a GPU, first what it cannot show of this exercise, if anything."""
    ex = get(key)
    text = (f"Level {ex.level} ({LEVELS[ex.level]}).\n\n{ex.scenario}\n\nQuestion: {ex.question}\n"
            f"Answer: {ex.tolerance_words()}.")
    if ex.cpu and not labs.on_gpu(device):
        text = f"On this machine, which has no GPU: {ex.cpu}\n\n{text}"
    if ex.details:
        setup = Setup(RUNS[ex.run], device)
        with setup.formulas():
            text += "\n\n" + ex.details(setup)
    return text


def hint(key: str) -> str:
    """A nudge towards the method, before the answer is revealed."""
    return f"Hint: {get(key).hint}"


def reference_answer(key: str, device: str = "auto") -> Any:
    """The answer key: from the formula, the planner or the known fault (never a measurement).
    `device` may be a CUDA device this machine lacks: the formula answers as on that GPU."""
    ex = get(key)
    setup = Setup(RUNS[ex.run], device)
    with setup.formulas():
        return ex.answer(setup)


def check(key: str, prediction: Any = None, *, solution: bool = False, device: str = "auto",
          runs_dir: str | None = None, reuse: bool = True, participant: str | None = None,
          team: str | None = None) -> Outcome:
    """Measure, then grade `prediction` (or, with `solution`, the reference answer). A learner's
    attempt (not an answer key) is stored in `runs_dir`/attempts with the participant and team."""
    ex = get(key)
    setup = Setup(RUNS[ex.run], device)
    setup.require_present()  # before any formula: a simulated GPU is for reference_answer only
    reference = ex.answer(setup)
    if solution:
        prediction = reference
    if prediction is None:
        raise ConfigError(f"{key}: enter a prediction ({ex.tolerance_words()}), or set solution = True")
    prediction = parse_prediction(ex, prediction)
    rows = measure_setup(setup, runs_dir, reuse=reuse)
    words = {v: v if isinstance(v, str) else show(v, ex.unit) for v in (reference, prediction)}
    evidence = ex.evidence(rows, setup)
    graded = ex.measured(rows) if ex.graded_against == "measurement" else reference
    if graded is None:
        raise RuntimeError(f"{key}: the measurement has no row to grade against ({rows.source})")
    correct = grade(ex, prediction, graded)
    outcome = Outcome(ex, prediction, graded, correct, {**evidence, **{"answer": words[reference],
                      "prediction": words[prediction]}}, rows.source, solution,
                      mistake=not correct and ex.is_mistake(prediction, setup),
                      unsupported=ex.supports(rows, setup) if ex.supports else None, run_id=rows.run_id)
    if not solution:
        record_attempt(kind="exercise", exercise=key, topic=ex.topic, level=ex.level,
                       prediction=prediction, reference=graded, correct=correct, measured=evidence,
                       device=setup.device, run_id=rows.run_id, folder=runs_dir,
                       participant=participant, team=team)
    return outcome


def widget(key: str, *, device: str = "auto", runs_dir: str | None = None):
    """A number box or a dropdown, a Hint and a Check button, and the graded report below them."""
    import ipywidgets as w

    ex = get(key)
    box = (w.Dropdown(options=ex.choices, description="Answer") if ex.choices
           else w.FloatText(description=f"Answer ({ex.unit})" if ex.unit else "Answer"))
    button, out = w.Button(description="Check", button_style="primary"), w.Output()
    tip, tip_out = w.Button(description="Hint"), w.Output()

    def on_click(_):
        out.clear_output()
        with out:
            button.disabled = True
            try:
                print(check(key, box.value, device=device, runs_dir=runs_dir).report())
            except ConfigError as e:
                print(e)
            finally:
                button.disabled = False

    def on_hint(_):
        tip_out.clear_output()
        with tip_out:
            print(hint(key))

    button.on_click(on_click)
    tip.on_click(on_hint)
    return w.VBox([w.HBox([box, button, tip]), tip_out, out])


def answer_table(devices: tuple[str, ...] = ("cpu", "cuda")):
    """The answer key as a pandas DataFrame: per exercise, its level, the reference on each device
    (a CUDA device this machine lacks is simulated: formulas only), the tolerance, the common
    mistake and whether the tolerance rejects it (it must, on every device)."""
    import pandas as pd

    rows = []
    for key, ex in EXERCISES.items():
        row: dict[str, Any] = {"exercise": key, "level": ex.level, "topic": ex.topic}
        rejected = []
        for device in devices:
            setup = Setup(RUNS[ex.run], device)
            with setup.formulas():
                ref, wrong = ex.answer(setup), ex.mistake(setup) if ex.mistake else None
            row[f"reference_{device}"] = ref
            row[f"mistake_{device}"] = wrong
            rejected.append(wrong is not None and not grade(ex, wrong, ref))
        row["tolerance"] = ex.tolerance_words()
        row["mistake_rejected"] = all(rejected) if ex.mistake else None
        rows.append(row)
    return pd.DataFrame(rows)
