"""The parts every exercise is made of: the run behind it, its resolved setup, the measured rows,
the exercise itself (its mechanism here, its words in notebooks/exercises/text/KEY.md, read by
`text`), grading and the measurement (reused when a complete stored run of the same settings
exists). The exercises live in the topic modules beside this one."""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from labkit import hardware, planner
from labkit.study import quiz
from labkit.config import ConfigError, RunConfig, Sweep
from labkit.harness.experiment import plan_points, run_experiment
from labkit.results import format_number, load_runs
from labkit.techniques import get_experiment
from labkit.views import machine_key
from labkit.study.exercises.text import Text, section

MiB, KiB = 2**20, 2**10
# The quiz's topics (defined once, in labkit.study.quiz), in this order, plus the troubleshooting lab.
TOPICS = (*(quiz.TOPICS[k] for k in ("memory", "precision", "parallelism", "distributed", "profiling",
                                     "inference")), "Troubleshooting lab")
SOURCES = {"formula": "from the formula, computed before the measurement",
           "measurement": "the textbook answer from the FLOP count, graded against the measurement",
           "fault": "the fault built into the setup"}
LEVELS = {1: "apply one formula", 2: "combine a formula with the setup's numbers",
          3: "reason across several effects or diagnose"}
# Every exercise runs the tiny preset on any device, so the numbers in its scenario hold there too.
PRESET = "tiny"
SIMULATED_GPU = "NVIDIA H200"  # the GPU a reference "for cuda" assumes on a machine without one


@dataclass(frozen=True)
class Run:
    """The measurement behind an exercise. Exercises with equal Runs share one measurement."""

    experiment: str
    overrides: dict[str, Any]
    variants: tuple[str, ...]
    sweep: Sweep = field(default_factory=dict)  # a grid or a list of points (config.expand_sweep)


def simulated_device(device: str) -> bool:
    """A CUDA device named for formulas on a machine that has none (the planner and `expected()`
    then use the GPU's implementations, e.g. multi-tensor AdamW; nothing is measured on it)."""
    return device.startswith("cuda") and device not in hardware.available_devices()


class Setup:
    """The resolved configs of an exercise's run, for formulas (nothing is measured here).
    `device` may be a CUDA device on a machine without one: the configs are resolved on the CPU
    and then carry the CUDA device, so every formula answers as it would on a GPU."""

    def __init__(self, run: Run, device: str):
        self.run, self.exp = run, get_experiment(run.experiment)
        pinned = "device" in run.overrides  # a run's own device wins (multi-process runs on CPU)
        self.simulated = simulated_device(device) and not pinned
        overrides = {"device": "cpu" if self.simulated else device, **run.overrides}
        points = plan_points(run.experiment, PRESET, overrides, run.sweep or None)
        if self.simulated:
            points = [(p, dataclasses.replace(c, device=device)) for p, c in points]
        self.points = points

    @property
    def device(self) -> str:
        return self.points[0][1].device

    def require_present(self) -> None:
        """A ConfigError (one line) when the device is simulated: formulas only, nothing measured."""
        if self.simulated:
            raise ConfigError(f"device {self.device!r} is not present here; available: "
                              f"{', '.join(hardware.available_devices())}")

    def formulas(self) -> contextlib.AbstractContextManager:
        """Where the formulas run: on a simulated GPU, `hardware.ceilings("cuda")` answers with
        SIMULATED_GPU's datasheet."""
        return hardware.simulated_gpu(SIMULATED_GPU) if self.simulated else contextlib.nullcontext()

    def cfg(self, variant: str | None = None, **point: Any) -> RunConfig:
        """The config of `variant` at the sweep point matching `point` (the first by default)."""
        cfg = next(c for p, c in self.points if all(p.get(k) == v for k, v in point.items()))
        return dataclasses.replace(cfg, variant=variant or self.exp.REFERENCE)

    def expected(self, variant: str | None = None, **point: Any) -> dict[str, float]:
        return self.exp.expected(self.cfg(variant, **point))


class Rows:
    """A measured run's rows, looked up by variant, metric and sweep point."""

    def __init__(self, rows: list[dict[str, Any]], source: str, run_id: str | None = None):
        self.rows, self.source, self.run_id = rows, source, run_id

    def row(self, variant: str, metric: str | None = None, *, rank: int = 0, **point: Any) -> dict | None:
        """The first row of `variant` (and `metric`, rank and sweep point when given), None when absent."""
        return next((r for r in self.rows
                     if r["variant"] == variant and (metric is None or r["metric"] == metric)
                     and (r.get("rank") or 0) == rank
                     and all(r["params"]["sweep"].get(k) == v for k, v in point.items())), None)

    def get(self, variant: str, metric: str | None = None, *, rank: int = 0, **point: Any) -> Any:
        """The value of `metric` (rank 0 of a multi-process run), None when absent; without a
        metric, the variant's first row (its status and message: an OOM has no metrics)."""
        r = self.row(variant, metric, rank=rank, **point)
        return r if r is None or metric is None else r["value"]

    def predicted(self, variant: str, metric: str, *, rank: int = 0, **point: Any) -> Any:
        """The row's `predicted` (the planner's or the napkin math's figure), None when absent."""
        r = self.row(variant, metric, rank=rank, **point)
        return None if r is None else r.get("predicted")


@dataclass(frozen=True)
class Exercise(Text):
    """An exercise's mechanism; its words (title, scenario, question, hint, why, mistake_why,
    feedback) are in notebooks/exercises/text/KEY.md (`labkit.study.exercises.text`)."""

    key: str
    topic: str
    run: str  # a key of RUNS
    answer: Callable[[Setup], Any]  # the reference answer: formula, planner or known fault
    evidence: Callable[[Rows, Setup], dict[str, Any]]  # measured numbers (and the formula's)
    level: int = 1  # a key of LEVELS
    mistake: Callable[[Setup], Any] | None = None  # the most common wrong answer (a number or a choice)
    # None when the measurement shows what the answer claims, else the sentence saying what it lacks
    supports: Callable[[Rows, Setup], str | None] | None = None
    unit: str = ""
    choices: tuple[str, ...] = ()
    rel_tol: float = 0.0
    abs_tol: float = 0.0
    graded_against: str = "formula"  # formula, measurement or fault
    measured: Callable[[Rows], Any] | None = None  # the measured answer (graded_against measurement)
    details: Callable[[Setup], str] | None = None  # setup facts the learner needs (from configs)
    words: dict[str, Any] = field(default_factory=dict)  # the text's {placeholders}: labkit's numbers

    scenario = section("scenario", "Everything the answer needs, in words (with `details` for the "
                                   "setup's numbers).")
    question = section("question", "The one question: a number or a choice.")
    mistake_why = section("mistake_why", "The misunderstanding behind `mistake`, said when a learner "
                                         "makes it.", optional=True)

    @property
    def why(self) -> str:
        """The explanation, to format with {answer}, {prediction} and the evidence (its words filled
        in already)."""
        return self.template("why")

    def tolerance(self, reference: float) -> float:
        return max(self.abs_tol, self.rel_tol * abs(reference))

    def tolerance_words(self) -> str:
        if self.choices:
            return "one of: " + ", ".join(self.choices)
        parts = [f"±{100 * self.rel_tol:g}%" if self.rel_tol else "",
                 f"±{self.abs_tol:g} {self.unit}".strip() if self.abs_tol else ""]
        text = " or ".join(p for p in parts if p)
        return f"a number in {self.unit or 'plain units'}, graded " + (f"within {text}" if text else "exactly")

    def is_mistake(self, prediction: Any, setup: Setup) -> bool:
        """Whether `prediction` is the common mistake (within the tolerance around it)."""
        if self.mistake is None:
            return False
        wrong = self.mistake(setup)
        if self.choices:
            return prediction == wrong
        return abs(prediction - wrong) <= self.tolerance(wrong) + 1e-12


@dataclass
class Outcome:
    exercise: Exercise
    prediction: Any
    reference: Any  # what the prediction was graded against
    correct: bool
    values: dict[str, Any]
    source: str  # where the measurement came from
    solution: bool = False  # the prediction is the reference answer (an answer key)
    mistake: bool = False  # the prediction is the exercise's common mistake
    unsupported: str | None = None  # what the measurement failed to show, when it did
    run_id: str | None = None  # the measurement's run

    def report(self) -> str:
        ex, v = self.exercise, self.values
        verdict = "correct" if self.correct else "wrong"
        against = {"formula": "the formula's answer", "fault": "the fault built into this setup",
                   "measurement": "the measurement: there is no formula for this on this machine"}
        lines = [f"Graded: {verdict}. Your prediction {show(self.prediction, ex.unit)}; graded against "
                 f"{against[ex.graded_against]}: {show(self.reference, ex.unit)}"
                 + ("" if ex.choices else f" (tolerance ±{show(ex.tolerance(self.reference), ex.unit)})."),
                 f"Measurement: {self.source}."]
        if ex.choices and self.prediction in ex.feedback:
            lines.append(f"Your choice: {ex.feedback[self.prediction]}")
        if self.mistake:
            lines.append(f"A common mistake: {ex.mistake_why}")
        if self.unsupported:
            lines.append(f"Note: this measurement does not show it: {self.unsupported}")
        lines += ["", "Why: " + ex.why.format(**v)]
        if self.solution:
            source = SOURCES[ex.graded_against]
            lines.insert(1, f"Solution mode: the prediction is the reference answer ({source}).")
        return "\n".join(lines)


def close(measured: float | None, predicted: float, rel: float) -> bool:
    """A measured value within `rel` of `predicted` (False when nothing was measured)."""
    return measured is not None and abs(measured - predicted) <= rel * abs(predicted)


def show(value: Any, unit: str = "") -> str:
    """A number in an exercise's text: `results.format_number` (4 significant digits, thousands
    separated) and `unit` as written; text quoted, None as "none"."""
    if isinstance(value, str) or value is None:
        return repr(value) if isinstance(value, str) else "none"
    return f"{format_number(value)} {unit}".strip()


def percent(fraction: float | None) -> str:
    """A fraction as a percentage in an exercise's text (`show`)."""
    return show(None if fraction is None else 100 * fraction, "%")


def mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / MiB:.2f} MiB"


def model_words(s: Setup) -> str:
    """The model and batch facts an exercise's scenario rests on, from the resolved config."""
    c, m = s.cfg(), s.cfg().model
    return (f"Model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads "
            f"({m.num_kv_heads} kv heads), vocabulary {m.vocab_size}, {planner.num_params(m):,} parameters; "
            f"batch_size {c.batch_size}, seq_len {c.seq_len}, dtype {c.dtype}.")


def grade(ex: Exercise, prediction: Any, reference: Any) -> bool:
    """Choices: the same option. Numbers: within max(rel_tol x |reference|, abs_tol)."""
    if ex.choices:
        return prediction == reference
    return abs(prediction - reference) <= ex.tolerance(reference) + 1e-12


def parse_prediction(ex: Exercise, prediction: Any) -> Any:
    """A widget's or papermill's value as the exercise's type, or a ConfigError naming the valid."""
    if ex.choices:
        text = str(prediction).strip()
        match = [c for c in ex.choices if c.lower() == text.lower()]
        if not match:
            raise ConfigError(f"unknown answer {prediction!r} for {ex.key}; valid: {', '.join(ex.choices)}")
        return match[0]
    try:
        number = float(prediction)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise ConfigError(f"{ex.key} needs a finite number in {ex.unit or 'plain units'}, got {prediction!r}")
    return number


machine = machine_key  # what identifies the machine a run measured (`views.machine_key`)


def find_stored(run: Run, setup: Setup, runs_dir: str | None) -> dict[str, Any] | None:
    """The newest complete stored run of exactly these settings, variants and sweep points,
    measured on this machine."""
    config, here = setup.points[0][1].params(), machine(hardware.fingerprint())
    points = [p for p, _ in setup.points]
    wanted = {setup.exp.REFERENCE, *run.variants}
    for record in reversed(load_runs(runs_dir, experiment=run.experiment)):
        if (record.get("status") == "complete"
                and record["config"] == config and machine(record.get("env", {})) == here
                and {r["variant"] for r in record["rows"]} == wanted
                and all(any(r["params"]["sweep"] == p for r in record["rows"]) for p in points)):
            return record
    return None


def measure(run: Run, device: str = "auto", runs_dir: str | None = None, *,
            reuse: bool = True) -> Rows:
    """The run's rows: with `reuse`, a complete stored run of the same settings on this machine
    in `runs_dir` (several exercises share one run); else a new run on `device`."""
    return measure_setup(Setup(run, device), runs_dir, reuse=reuse)


def measure_setup(setup: Setup, runs_dir: str | None = None, *, reuse: bool = True) -> Rows:
    """`measure` for a Setup already resolved (its configs are what is measured)."""
    setup.require_present()
    run, where = setup.run, setup.device
    record = find_stored(run, setup, runs_dir) if reuse else None
    if record:
        return Rows(record["rows"], f"stored run {record['run_id']} ({record['timestamp']}, {where}), "
                                    "the same settings on this machine, reused", record["run_id"])
    result = run_experiment(run.experiment, preset=PRESET, overrides={"device": where, **run.overrides},
                            sweep=run.sweep or None, variants=list(run.variants),
                            runs_dir=runs_dir, progress=False)
    return Rows(result.rows, f"run {result.run_id} on {where}, measured now", result.run_id)
