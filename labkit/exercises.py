"""Graded exercises, "predict, then measure", and the troubleshooting lab.

Each exercise is a short scenario and one question whose answer is a number (with a unit and a
stated tolerance) or a choice. The learner enters a prediction; `check()` then runs the experiment
behind the exercise on the attached device at a small size (or reuses a complete stored run of the
very same settings), grades the prediction and explains the why with the measured numbers and the
formula.

Where the answer comes from:

- `formula`: the reference answer is computed from the planner, an experiment's `expected(cfg)`
  or a closed form here, *before* and *without* the measurement; the measurement is the evidence.
- `measurement`: there is no formula for this machine's behaviour (which variant is faster);
  the prediction is graded against what was measured, and the grade says so. Solution mode fills
  in the textbook answer (from the FLOP count) and grades it against the measurement too.
- `fault`: a troubleshooting setup is broken on purpose; the learner names the fault from the
  evidence, and is graded against the fault that was built in.

Solution mode (`solution=True`, the papermill parameter) fills in the reference answer as the
prediction, so `papermill ... -p solution True` produces an answer key.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from labkit import planner, quiz
from labkit.config import MODELS, ConfigError, RunConfig
from labkit.experiment import plan_points, run_experiment
from labkit.results import load_runs
from labkit.techniques import get_experiment

MiB, KiB = 2**20, 2**10
# The quiz's topics (defined once, in labkit.quiz), in this order, plus the troubleshooting lab.
TOPICS = (*(quiz.TOPICS[k] for k in ("memory", "precision", "parallelism", "distributed", "profiling",
                                     "inference")), "Troubleshooting lab")
SOURCES = {"formula": "from the formula, computed before the measurement",
           "measurement": "the textbook answer from the FLOP count, graded against the measurement",
           "fault": "the fault built into the setup"}
# The troubleshooting lab's answer choices: one of these is built into each broken setup.
FAULTS = ("out of memory", "data-loading bottleneck", "fp16 overflow (no loss scaling)",
          "mis-sized batch (padding)", "unbalanced pipeline", "tensor-core-unfriendly shape",
          "nothing is wrong")


@dataclass(frozen=True)
class Run:
    """The measurement behind an exercise. Exercises with equal Runs share one measurement."""

    experiment: str
    overrides: dict[str, Any]
    variants: tuple[str, ...]
    sweep: dict[str, list[Any]] = field(default_factory=dict)


# Every exercise runs the tiny preset on any device, so the numbers in its scenario hold there too.
PRESET = "tiny"
FAST = {"min_run_time_s": 0.0, "warmup": 0}
SLOW_STAGE_MS = 40.0  # the troubleshooting lab's injected delay in pipeline stage 0
# Two CPU ranks (gloo) on any machine: the scenarios' per-rank bytes and bubble are the same on
# every device, and one GPU cannot hold two NCCL ranks. A run's own "device" wins over check()'s.
DIST = {**FAST, "timed_steps": 2, "seq_len": 16, "num_layers": 2, "timeout_s": 60, "device": "cpu",
        "nproc": 2}
RUNS = {
    "mp": Run("mixed_precision", {**FAST, "batch_size": 1, "seq_len": 8, "steps": 1, "num_layers": 2},
              ("fp32", "fp16", "bf16_weights")),
    "oom": Run("mixed_precision", {**FAST, "batch_size": 1, "seq_len": 8, "steps": 1, "num_layers": 2,
                                   "memory_budget_gib": 0.03}, ("fp32",)),
    "ckpt": Run("checkpointing", {**FAST, "batch_size": 2, "seq_len": 32, "num_layers": 2}, ("none", "full")),
    "finder": Run("batch_finder", {**FAST, "num_layers": 1, "seq_len": 32, "memory_budget_gib": 0.05,
                                   "max_batch_size": 16, "mode": "grow", "effective_batch": 32}, ("fp32",)),
    "kv": Run("kv_cache", {**FAST, "prompt_len": 64, "new_tokens": 32, "num_layers": 1},
              ("none", "dynamic", "quantized")),
    "data": Run("dataloading", {**FAST, "batch_size": 1, "seq_len": 8, "steps": 2, "num_layers": 2,
                                "sample_cost_us": 100000.0}, ("baseline",)),
    "matmul": Run("matmul", {**FAST, "size": 256}, ("fp32",), {"alignment": ["aligned", "off_by_one"]}),
    "access": Run("memory_access", {**FAST, "size_mib": 4.0, "stride": 4}, ("contiguous", "strided")),
    "serve": Run("batching", {"num_layers": 1, "num_requests": 8, "max_output_len": 8, "arrival": "closed"},
                 ("sequential", "static", "continuous")),
    "zero": Run("zero", {**DIST, "batch_size": 2}, ("zero0", "zero1", "zero3")),
    "pipe": Run("pipeline_parallel", {**DIST, "batch_size": 4, "micro_batches": 4, "delay_stage": 0},
                ("single", "gpipe"), {"stage_delay_ms": [0.0, SLOW_STAGE_MS]}),
}


class Setup:
    """The resolved configs of an exercise's run, for formulas (nothing is measured here)."""

    def __init__(self, run: Run, device: str):
        self.run, self.exp = run, get_experiment(run.experiment)
        overrides = {"device": device, **run.overrides}
        self.points = plan_points(run.experiment, PRESET, overrides, run.sweep or None)

    def cfg(self, variant: str | None = None, **point: Any) -> RunConfig:
        """The config of `variant` at the sweep point matching `point` (the first by default)."""
        cfg = next(c for p, c in self.points if all(p.get(k) == v for k, v in point.items()))
        return dataclasses.replace(cfg, variant=variant or self.exp.REFERENCE)

    def expected(self, variant: str | None = None, **point: Any) -> dict[str, float]:
        return self.exp.expected(self.cfg(variant, **point))


class Rows:
    """A measured run's rows, looked up by variant, metric and sweep point."""

    def __init__(self, rows: list[dict[str, Any]], source: str):
        self.rows, self.source = rows, source

    def get(self, variant: str, metric: str | None = None, *, rank: int = 0, **point: Any) -> Any:
        """The value of `metric` (rank 0 of a multi-process run), None when absent; without a
        metric, the variant's first row (its status and message: an OOM has no metrics)."""
        for r in self.rows:
            if (r["variant"] == variant and (metric is None or r["metric"] == metric)
                    and (r.get("rank") or 0) == rank
                    and all(r["params"]["sweep"].get(k) == v for k, v in point.items())):
                return r["value"] if metric else r
        return None


@dataclass(frozen=True)
class Exercise:
    key: str
    topic: str
    title: str
    scenario: str
    question: str
    run: str  # a key of RUNS
    answer: Callable[[Setup], Any]  # the reference answer: formula, planner or known fault
    evidence: Callable[[Rows, Setup], dict[str, Any]]  # measured numbers (and the formula's)
    why: str  # the explanation, formatted with {answer}, {prediction} and the evidence
    unit: str = ""
    choices: tuple[str, ...] = ()
    rel_tol: float = 0.0
    abs_tol: float = 0.0
    graded_against: str = "formula"  # formula, measurement or fault
    measured: Callable[[Rows], Any] | None = None  # the measured answer (graded_against measurement)
    details: Callable[[Setup], str] | None = None  # setup facts the learner needs (from configs)

    def tolerance(self, reference: float) -> float:
        return max(self.abs_tol, self.rel_tol * abs(reference))

    def tolerance_words(self) -> str:
        if self.choices:
            return "one of: " + ", ".join(self.choices)
        parts = [f"±{self.rel_tol:.0%}" if self.rel_tol else "",
                 f"±{self.abs_tol:g} {self.unit}".strip() if self.abs_tol else ""]
        text = " or ".join(p for p in parts if p) or "exact"
        return f"a number in {self.unit or 'plain units'}, graded within {text}"


@dataclass
class Outcome:
    exercise: Exercise
    prediction: Any
    reference: Any  # what the prediction was graded against
    correct: bool
    values: dict[str, Any]
    source: str  # where the measurement came from
    solution: bool = False  # the prediction is the reference answer (an answer key)

    def report(self) -> str:
        ex, v = self.exercise, self.values
        verdict = "correct" if self.correct else "wrong"
        against = {"formula": "the formula's answer", "fault": "the fault built into this setup",
                   "measurement": "the measurement: there is no formula for this on this machine"}
        lines = [f"Graded: {verdict}. Your prediction {show(self.prediction, ex.unit)}; graded against "
                 f"{against[ex.graded_against]}: {show(self.reference, ex.unit)}"
                 + ("" if ex.choices else f" (tolerance ±{show(ex.tolerance(self.reference), ex.unit)})."),
                 f"Measurement: {self.source}.", "", "Why: " + ex.why.format(**v)]
        if self.solution:
            source = SOURCES[ex.graded_against]
            lines.insert(1, f"Solution mode: the prediction is the reference answer ({source}).")
        return "\n".join(lines)


def show(value: Any, unit: str = "") -> str:
    if isinstance(value, str) or value is None:
        return repr(value) if isinstance(value, str) else "none"
    text = f"{value:.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return f"{text} {unit}".strip()


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


def machine(env: dict[str, Any]) -> tuple:
    """What identifies the machine a run measured: a shared runs folder holds many machines'."""
    gpus = tuple(g.get("name") for g in env.get("gpus") or [] if isinstance(g, dict))
    return env.get("hostname"), env.get("device"), env.get("torch"), gpus


def find_stored(run: Run, setup: Setup, runs_dir: str | None) -> dict[str, Any] | None:
    """The newest complete stored run of exactly these settings, variants and sweep points,
    measured on this machine."""
    from labkit import hardware

    config, here = setup.points[0][1].params(), machine(hardware.fingerprint())
    points = [p for p, _ in setup.points]
    wanted = {setup.exp.REFERENCE, *run.variants}
    for record in reversed(load_runs(runs_dir)):
        if (record["experiment"] == run.experiment and record.get("status") == "complete"
                and record["config"] == config and machine(record.get("env", {})) == here
                and {r["variant"] for r in record["rows"]} == wanted
                and all(any(r["params"]["sweep"] == p for r in record["rows"]) for p in points)):
            return record
    return None


def measure(run: Run, device: str = "auto", runs_dir: str | None = None, *,
            reuse: bool = True) -> Rows:
    """The run's rows: with `reuse`, a complete stored run of the same settings on this machine
    in `runs_dir` (several exercises share one run); else a new run on `device`."""
    setup = Setup(run, device)
    where = setup.points[0][1].device
    record = find_stored(run, setup, runs_dir) if reuse else None
    if record:
        return Rows(record["rows"], f"stored run {record['run_id']} ({record['timestamp']}, {where}), "
                                    "the same settings on this machine, reused")
    result = run_experiment(run.experiment, preset=PRESET, overrides={"device": device, **run.overrides},
                            sweep=run.sweep or None, variants=list(run.variants),
                            runs_dir=runs_dir, progress=False)
    return Rows(result.rows, f"run {result.run_id} on {where}, measured now")


def get(key: str) -> Exercise:
    if key not in EXERCISES:
        raise ConfigError(f"unknown exercise {key!r}; valid: {', '.join(EXERCISES)}")
    return EXERCISES[key]


def describe(key: str, device: str = "auto") -> str:
    """The scenario, the question and how it is graded (no measurement: safe to show first)."""
    ex = get(key)
    text = f"{ex.scenario}\n\nQuestion: {ex.question}\nAnswer: {ex.tolerance_words()}."
    if ex.details:
        text += "\n\n" + ex.details(Setup(RUNS[ex.run], device))
    return text


def reference_answer(key: str, device: str = "auto") -> Any:
    """The answer key: from the formula, the planner or the known fault (never a measurement)."""
    ex = get(key)
    return ex.answer(Setup(RUNS[ex.run], device))


def check(key: str, prediction: Any = None, *, solution: bool = False, device: str = "auto",
          runs_dir: str | None = None, reuse: bool = True) -> Outcome:
    """Measure, then grade `prediction` (or, with `solution`, the reference answer)."""
    ex = get(key)
    setup = Setup(RUNS[ex.run], device)
    reference = ex.answer(setup)
    if solution:
        prediction = reference
    if prediction is None:
        raise ConfigError(f"{key}: enter a prediction ({ex.tolerance_words()}), or set solution = True")
    prediction = parse_prediction(ex, prediction)
    rows = measure(RUNS[ex.run], device, runs_dir, reuse=reuse)
    words = {v: v if isinstance(v, str) else show(v, ex.unit) for v in (reference, prediction)}
    values = {**ex.evidence(rows, setup), "answer": words[reference], "prediction": words[prediction]}
    graded = ex.measured(rows) if ex.graded_against == "measurement" else reference
    if graded is None:
        raise RuntimeError(f"{key}: the measurement has no row to grade against ({rows.source})")
    return Outcome(ex, prediction, graded, grade(ex, prediction, graded), values, rows.source, solution)


def widget(key: str, *, device: str = "auto", runs_dir: str | None = None):
    """A number box or a dropdown, a Check button and the graded report below them."""
    import ipywidgets as w

    ex = get(key)
    box = (w.Dropdown(options=ex.choices, description="Answer") if ex.choices
           else w.FloatText(description=f"Answer ({ex.unit})" if ex.unit else "Answer"))
    button, out = w.Button(description="Check", button_style="primary"), w.Output()

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

    button.on_click(on_click)
    return w.VBox([w.HBox([box, button]), out])


# ---- closed forms that are not in the planner ------------------------------------------------

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # the smallest positive fp16 (subnormal)


def fp16_round(x: float) -> float:
    """What an fp32 value becomes in fp16, in closed form (round to nearest even; inf past the
    largest finite value; subnormals step by 2^-24)."""
    if abs(x) >= FP16_MAX + 16:  # halfway to the next power step rounds to inf
        return math.copysign(math.inf, x)
    exponent = max(math.frexp(abs(x))[1] - 11, -24) if x else -24  # 11 significant bits
    step = 2.0**exponent
    return round(x / step) * step


def fp16_demo() -> dict[str, float]:
    """The same values through torch: what fp16 storage does without and with a loss scale."""
    import torch

    def half(v: float) -> float:
        return torch.tensor(v, dtype=torch.float32).half().item()

    logits = torch.tensor([300.0, 250.0], dtype=torch.float16)
    return {"grad_fp16": half(1e-8), "grad_scaled": half(1e-8 * 65536) / 65536,
            "big_fp16": half(70000.0), "square_fp16": (logits * logits).sum().item()}


def tensor_core_friendly(m: int, n: int, k: int, dtype_bytes: int = 2) -> bool:
    """cuBLAS picks tensor-core kernels when each dimension is a multiple of 16 bytes' worth of
    elements (8 for fp16/bf16): NVIDIA's matrix-multiplication performance guide."""
    multiple = 16 // dtype_bytes
    return all(d % multiple == 0 for d in (m, n, k))


def ring_allreduce_bytes(size: int, n: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-reduce of `size` bytes over n ranks:
    a reduce-scatter then an all-gather, each (n - 1) steps of size / n."""
    return 2 * (n - 1) / n * size


def faster(ratio: float) -> str:
    return "the cached run" if ratio > 1.2 else "the uncached run" if ratio < 1 / 1.2 else "about the same"




# ---- the exercises -----------------------------------------------------------------------------

def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / MiB:.2f} MiB"


def _psi(s: Setup) -> int:
    return planner.num_params(s.cfg().model)


def _zero_state(s: Setup, stage: int, which: int) -> float:
    """Per-rank bytes of params (0), grads (1) or AdamW states (2) at ZeRO `stage`, in MiB."""
    n = s.cfg().nproc
    return planner.zero_model_state_bytes(_psi(s), stage=stage, dp=n, precision="fp32",
                                          optimizer="adamw")[which] / MiB


def _pipe(s: Setup) -> tuple[int, int]:
    cfg = s.cfg("gpipe")
    return cfg.nproc, cfg.micro_batches


def _requests(s: Setup) -> str:
    from labkit.techniques import batching

    cfg = s.cfg("static")
    _, requests = batching.workload(cfg)
    listed = ", ".join(f"({r.prompt_len}, {r.output_len})" for r in requests)
    return (f"The {len(requests)} requests as (prompt tokens, output tokens), all queued at t = 0: "
            f"{listed}. Rows per step (batch_size): {cfg.batch_size}.")


def _model_words(s: Setup) -> str:
    c, m = s.cfg(), s.cfg().model
    return (f"Model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads "
            f"({m.num_kv_heads} kv heads), vocabulary {m.vocab_size}, {planner.num_params(m):,} parameters; "
            f"batch_size {c.batch_size}, seq_len {c.seq_len}, dtype {c.dtype}.")


def _memory_exercises() -> list[Exercise]:
    topic = TOPICS[0]
    return [
        Exercise(
            "peak_memory", topic, "The peak memory of one training step",
            "You train the tiny Llama-style model in fp32 with AdamW (one step, batch 1 x 8 tokens).",
            "What is the peak memory of the step, in MiB?", "mp",
            answer=lambda s: s.expected("fp32")["peak_mem_bytes"] / MiB,
            evidence=lambda r, s: {"peak": _mib(r.get("fp32", "peak_mem_bytes")),
                                   "params": _mib(r.get("fp32", "param_bytes")),
                                   "optim": _mib(r.get("fp32", "optimizer_bytes")),
                                   "acts": _mib(r.get("fp32", "activation_bytes"))},
            why="the planner adds weights (4 bytes/param), gradients (4), AdamW's two moments (8) "
                "and the activations saved for backward, plus the step's temporaries: {answer}. "
                "Measured peak {peak}: params {params}, optimizer {optim}, saved activations {acts}. "
                "At this size the model states (16 bytes/param) dominate; activations grow with "
                "batch x seq_len.",
            unit="MiB", rel_tol=0.15, details=_model_words),
        Exercise(
            "checkpoint_saving", topic, "What full activation checkpointing saves",
            "The same model (2 layers) trains on a batch of 2 x 32 tokens. You wrap every block in "
            "torch.utils.checkpoint (full recomputation).",
            "How many MiB of saved activations does full checkpointing remove?", "ckpt",
            answer=lambda s: (s.expected("none")["activation_bytes"]
                              - s.expected("full")["activation_bytes"]) / MiB,
            evidence=lambda r, s: {"none": _mib(r.get("none", "activation_bytes")),
                                   "full": _mib(r.get("full", "activation_bytes"))},
            why="each checkpointed block keeps only its input (b x s x h x 4 bytes) instead of every "
                "intermediate (Korthikanti et al.'s per-layer count, redone for this block): {answer} "
                "less. Measured saved activations: {none} without, {full} with full recomputation.",
            unit="MiB", rel_tol=0.10, details=_model_words),
        Exercise(
            "recompute_cost", topic, "The price of recomputation",
            "Same setup: full activation checkpointing on both blocks.",
            "By how many percent does full recomputation raise the FLOPs of a training step?", "ckpt",
            answer=lambda s: 100 * (s.expected("full")["flops"] / s.expected("none")["flops"] - 1),
            evidence=lambda r, s: {"none": show(r.get("none", "flops"), "FLOP"),
                                   "full": show(r.get("full", "flops"), "FLOP")},
            why="backward re-runs each checkpointed block's forward: + (block forward FLOPs) / "
                "(3 x forward of the whole model); the embedding and the head are not recomputed, so "
                "it is below the 33% rule of thumb: {answer}. FlopCounterMode counted {none} "
                "without and {full} with recomputation.",
            unit="%", abs_tol=3.0, details=_model_words),
        Exercise(
            "fitting_batch", topic, "The micro-batch that fits a memory budget",
            "A 1-layer model trains at seq_len 32 in fp32 with AdamW under a memory budget of 0.05 GiB "
            "(a virtual budget on the CPU, a real limit on a GPU).",
            "What is the largest micro-batch that fits?", "finder",
            answer=lambda s: s.expected("fp32")["max_batch_size"],
            evidence=lambda r, s: {"found": show(r.get("fp32", "max_batch_size")),
                                   "probes": show(r.get("fp32", "num_probes")),
                                   "peak": _mib(r.get("fp32", "peak_mem_bytes"))},
            why="the planner's peak is model states + batch x (activations per sequence); the largest "
                "batch whose peak stays under the budget is {answer}. The finder doubled, then "
                "bisected, through real OOMs: {found} after {probes} probes (peak at that size {peak}).",
            abs_tol=1.0, details=_model_words),
        Exercise(
            "accumulation_steps", topic, "Gradient accumulation for an effective batch",
            "Same budget; the recipe asks for 32 sequences per optimizer step.",
            "How many micro-batches must be accumulated per optimizer step at the largest fitting "
            "micro-batch?", "finder",
            answer=lambda s: s.expected("fp32")["accumulation_steps"],
            evidence=lambda r, s: {"found": show(r.get("fp32", "max_batch_size")),
                                   "steps": show(r.get("fp32", "accumulation_steps"))},
            why="ceil(effective batch / micro-batch) with the planner's micro-batch: {answer}. The "
                "finder measured a largest micro-batch of {found} and planned {steps} micro-steps.",
            abs_tol=0.0, details=_model_words),
        Exercise(
            "kv_cache_bytes", topic, "The size of a KV cache",
            "A 1-layer model (2 kv heads of 64, fp32) generates 32 tokens after a 64-token prompt with a "
            "dynamic KV cache (it holds every position but the last generated one).",
            "How many KiB does the cache hold at the end?", "kv",
            answer=lambda s: s.expected("dynamic")["kv_bytes"] / KiB,
            evidence=lambda r, s: {"kv": show(r.get("dynamic", "kv_bytes") / KiB, "KiB"),
                                   "per_token": show(r.get("dynamic", "kv_bytes_per_token"), "bytes")},
            why="2 (K and V) x layers x kv heads x head_dim x bytes per value per token, times batch x "
                "positions held (prompt + new - 1): {answer}. Measured from the cache tensors' "
                "storage: {kv} ({per_token} per token).",
            unit="KiB", rel_tol=0.02),
    ]


def _precision_exercises() -> list[Exercise]:
    topic = TOPICS[1]
    return [
        Exercise(
            "bf16_param_bytes", topic, "Weights in bf16",
            "You keep the tiny model's weights in bf16 (bf16_weights: the optimizer holds an fp32 master "
            "copy).", "How many MiB do the bf16 weights take?", "mp",
            answer=lambda s: planner.param_bytes(s.cfg().model, "bfloat16") / MiB,
            evidence=lambda r, s: {"fp32": _mib(r.get("fp32", "param_bytes")),
                                   "bf16": _mib(r.get("bf16_weights", "param_bytes")),
                                   "optim": _mib(r.get("bf16_weights", "optimizer_bytes"))},
            why="2 bytes per parameter: {answer}. Measured: {bf16} in bf16 against {fp32} in fp32; the "
                "optimizer grew to {optim} because it keeps the fp32 master weights (4 more bytes/param).",
            unit="MiB", rel_tol=0.02, details=_model_words),
        Exercise(
            "fp16_underflow", topic, "A small gradient in fp16",
            "Without loss scaling, a gradient of 1e-8 is stored in fp16.",
            "What value does fp16 store (a number)?", "mp",
            answer=lambda s: fp16_round(1e-8),
            evidence=lambda r, s: {**{k: f"{v:.3g}" for k, v in fp16_demo().items()},
                                   "scale": show(r.get("fp16", "loss_scale"))},
            why="fp16's smallest positive value is 2^-24 = 5.96e-8; 1e-8 is below half of it, so it "
                "rounds to {answer}. torch: {grad_fp16}. With the loss scaled by 65536 first the "
                "gradient survives ({grad_scaled} after unscaling); the fp16 run here used a scale of "
                "{scale} (GradScaler).", abs_tol=1e-12),
        Exercise(
            "train_flops", topic, "FLOPs of a training step",
            "The tiny model (2 layers) trains on 1 x 8 tokens in fp32.",
            "How many MFLOP does one training step (forward + backward) take?", "mp",
            answer=lambda s: s.expected("fp32")["flops"] / 1e6,
            evidence=lambda r, s: {"flops": show(r.get("fp32", "flops") / 1e6, "MFLOP"),
                                   "tflops": show(r.get("fp32", "tflops"), "TFLOP/s")},
            why="6 x (matmul parameters: all but the embedding table) x tokens, plus attention's "
                "12 x b x s^2 x h per layer: {answer}. FlopCounterMode counted {flops}; the step ran "
                "at {tflops} here.", unit="MFLOP", rel_tol=0.10, details=_model_words),
    ]


def _parallel_exercises() -> list[Exercise]:
    par, dist = TOPICS[2], TOPICS[3]
    return [
        Exercise(
            "pipeline_bubble", par, "The GPipe bubble",
            "The 2-layer model is split into p = 2 pipeline stages (one rank each) and each step's batch "
            "of 4 into m = 4 micro-batches, scheduled by GPipe.",
            "What fraction of each stage's step is idle (the bubble)?", "pipe",
            answer=lambda s: (_pipe(s)[0] - 1) / (_pipe(s)[1] + _pipe(s)[0] - 1),
            evidence=lambda r, s: {"bubble": show(r.get("gpipe", "bubble_fraction", stage_delay_ms=0.0)),
                                   "busy": show(r.get("gpipe", "stage_busy_ms", stage_delay_ms=0.0), "ms")},
            why="with equal stages and free sends, (p - 1) / (m + p - 1): {answer}. Measured from each "
                "rank's compute timestamps: {bubble} (busy {busy} per step). On a CPU the measured bubble "
                "is larger: sends, wake-ups of the other process and a shared core are idle time too; "
                "more micro-batches shrink the formula's share.", abs_tol=0.03),
        Exercise(
            "zero3_params", par, "ZeRO-3 parameters per rank",
            "Two data-parallel ranks train the 2-layer tiny model in fp32 with ZeRO-3 (FSDP2 "
            "fully_shard).", "How many MiB of parameters does each rank hold at rest?", "zero",
            answer=lambda s: _zero_state(s, 3, 0),
            evidence=lambda r, s: {"z3": _mib(r.get("zero3", "param_bytes")),
                                   "z0": _mib(r.get("zero0", "param_bytes"))},
            why="ZeRO-3 shards the weights too: 4 bytes x params / N = {answer}. Measured from rank 0's "
                "local shards: {z3} (DDP holds all of them: {z0}).", unit="MiB", rel_tol=0.02,
            details=_model_words),
        Exercise(
            "zero3_grads", dist, "ZeRO gradients per rank",
            "Same two ranks, ZeRO-3.", "How many MiB of gradients does each rank keep after the "
            "backward (reduce-scattered)?", "zero",
            answer=lambda s: _zero_state(s, 3, 1),
            evidence=lambda r, s: {"z3": _mib(r.get("zero3", "grad_bytes")),
                                   "z0": _mib(r.get("zero0", "grad_bytes"))},
            why="from stage 2 on, each rank keeps only its shard of the reduced gradients: 4 x params / "
                "N = {answer}. Measured: {z3} (DDP: {z0}, its all-reduce buckets).", unit="MiB",
            rel_tol=0.02, details=_model_words),
        Exercise(
            "zero1_optimizer", par, "ZeRO-1 optimizer states per rank",
            "Same two ranks, ZeRO-1 (ZeroRedundancyOptimizer around AdamW).",
            "How many MiB of AdamW state does each rank hold?", "zero",
            answer=lambda s: _zero_state(s, 1, 2),
            evidence=lambda r, s: {"z1": _mib(r.get("zero1", "optimizer_bytes")),
                                   "z0": _mib(r.get("zero0", "optimizer_bytes"))},
            why="AdamW keeps two fp32 moments (8 bytes/param); stage 1 shards them: 8 x params / N = "
                "{answer}. Measured: {z1} against DDP's {z0} (plus a 4-byte step counter per tensor).",
            unit="MiB", rel_tol=0.02, details=_model_words),
        Exercise(
            "ring_allreduce", dist, "Bytes a rank sends in a ring all-reduce",
            "DDP all-reduces the fp32 gradients of the 2-layer tiny model over N = 2 ranks with a ring "
            "(NCCL's and gloo's algorithm for large messages).",
            "How many MiB does each rank send per step?", "zero",
            answer=lambda s: ring_allreduce_bytes(planner.param_bytes(s.cfg().model, "float32"),
                                                  s.cfg().nproc) / MiB,
            evidence=lambda r, s: {"grads": _mib(r.get("zero0", "grad_bytes")),
                                   "step": show(r.get("zero0", "step_ms"), "ms")},
            why="a ring all-reduce is a reduce-scatter then an all-gather, each N - 1 steps of "
                "size / N: 2 (N - 1) / N x gradient bytes = {answer}. The gradients DDP reduced "
                "(measured buckets): {grads}; the whole DDP step took {step}. nccl-tests' bus bandwidth "
                "uses the same 2 (N - 1) / N factor.", unit="MiB", rel_tol=0.02, details=_model_words),
        Exercise(
            "ddp_optimizer", dist, "What plain DDP replicates",
            "Same two ranks with plain DDP (ZeRO stage 0).",
            "How many MiB of AdamW state does each rank hold?", "zero",
            answer=lambda s: _zero_state(s, 0, 2),
            evidence=lambda r, s: {"z0": _mib(r.get("zero0", "optimizer_bytes")),
                                   "z3": _mib(r.get("zero3", "optimizer_bytes"))},
            why="DDP replicates everything: 8 bytes x params on every rank = {answer}, however many "
                "ranks. Measured: {z0}; ZeRO-3 on the same ranks: {z3}.", unit="MiB", rel_tol=0.02,
            details=_model_words),
    ]


def _roofline_bound(s: Setup) -> str:
    from labkit import hardware
    from labkit.techniques import matmul

    cfg = s.cfg("fp32", alignment="aligned")
    ceil = hardware.ceilings(cfg.device, num_threads=cfg.num_threads)
    intensity = matmul.flops(cfg) / matmul.min_bytes(cfg)  # FLOP per byte
    ridge = ceil.peak_tflops["float32"] * 1e12 / (ceil.bandwidth_gbps * 1e9)
    return "compute-bound" if intensity > ridge else "memory-bound"


def _profiling_exercises() -> list[Exercise]:
    topic = TOPICS[4]
    from labkit.techniques import dataloading, memory_access as ma

    return [
        Exercise(
            "data_wait", topic, "How long the step waits for data",
            "Each sample costs 100 ms of CPU work in the loader (tokenising, augmenting); the loader runs "
            "in the training process (num_workers = 0) and the batch holds one sequence.",
            "How many ms per step does the loader take?", "data",
            answer=lambda s: dataloading.data_ms(s.cfg("baseline")),
            evidence=lambda r, s: {"data": show(r.get("baseline", "data_ms"), "ms"),
                                   "compute": show(r.get("baseline", "compute_ms"), "ms"),
                                   "wait": show(r.get("baseline", "data_wait_pct"), "%")},
            why="batch_size x sample cost: {answer}. Measured: data {data}, compute {compute}: the step "
                "waits for data {wait} of the time. Workers (num_workers > 0) prepare batches while the "
                "step computes.", unit="ms", rel_tol=0.15),
        Exercise(
            "tensor_core_shape", topic, "Shapes for tensor cores",
            "An fp16 GEMM is m = n = k = 4095 (a vocabulary one short of a round number).",
            "What makes it tensor-core friendly?", "matmul",
            choices=("pad each dimension to a multiple of 8", "switch to fp32", "transpose B",
                     "nothing: any shape uses tensor cores"),
            answer=lambda s: ("nothing: any shape uses tensor cores" if tensor_core_friendly(4095, 4095, 4095)
                              else "pad each dimension to a multiple of 8"),
            evidence=lambda r, s: {"aligned": show(r.get("fp32", "tflops", alignment="aligned"), "TFLOP/s"),
                                   "off": show(r.get("fp32", "tflops", alignment="off_by_one"), "TFLOP/s")},
            why="tensor-core kernels want each dimension a multiple of 16 bytes of elements (8 in fp16): "
                "{answer}. Measured here in fp32 at 256 against 255: {aligned} against {off}; on a "
                "GPU the off-by-one fp16 shape falls back to slower kernels (notebook 20_matmul).",
            graded_against="formula"),
        Exercise(
            "roofline_bound", topic, "Compute- or memory-bound",
            "A 256 x 256 x 256 fp32 matmul on this device.",
            "Is it compute-bound or memory-bound on the roofline?", "matmul",
            choices=("compute-bound", "memory-bound"), answer=_roofline_bound,
            evidence=lambda r, s: {"tflops": show(r.get("fp32", "tflops", alignment="aligned"), "TFLOP/s"),
                                   "gbps": show(r.get("fp32", "gbps", alignment="aligned"), "GB/s"),
                                   "pct": show(r.get("fp32", "peak_flops_pct", alignment="aligned"), "%")},
            why="arithmetic intensity 2mnk / (bytes of A, B and C) against the ridge point peak FLOP/s / "
                "bandwidth of this device's ceilings: {answer}. Measured: {tflops} ({pct} of the "
                "peak), {gbps}."),
        Exercise(
            "strided_traffic", topic, "The cost of a stride",
            "A copy reads every 4th fp32 value (stride 4) of a tensor instead of contiguous values; "
            "the same number of values is copied.",
            "How many times more bytes must memory move than for the contiguous copy?", "access",
            answer=lambda s: ma.traffic_bytes(s.cfg("strided")) / ma.traffic_bytes(s.cfg("contiguous")),
            evidence=lambda r, s: {"t_strided": show(r.get("strided", "step_ms"), "ms"),
                                   "t_contig": show(r.get("contiguous", "step_ms"), "ms")},
            why="memory moves whole cache lines: each strided value drags stride x 4 bytes (up to a line) "
                "in, against 4 bytes contiguous; the written 4 bytes are the same: {answer}. Measured: "
                "{t_strided} against {t_contig}; the time ratio can exceed the bytes ratio because "
                "the hardware prefetcher helps contiguous reads most.", rel_tol=0.05),
    ]


def _inference_exercises() -> list[Exercise]:
    topic = TOPICS[5]
    from labkit.techniques import kv_cache

    def ratio(s: Setup, a: str, b: str, metric: str) -> float:
        return s.expected(a)[metric] / s.expected(b)[metric]

    def speedup(r: Rows) -> float:
        return r.get("dynamic", "tokens_per_s") / r.get("none", "tokens_per_s")

    return [
        Exercise(
            "kv_per_token", topic, "KV bytes per token of a real model",
            "Llama-3-8B (32 layers, 8 kv heads of 128) serves in bf16. (The run below measures the same "
            "formula on the tiny model.)", "How many KiB of KV cache does one token take?", "kv",
            answer=lambda s: planner.kv_bytes_per_token(MODELS["llama-3-8b"], "bfloat16") / KiB,
            evidence=lambda r, s: {"tiny": show(r.get("dynamic", "kv_bytes_per_token"), "bytes"),
                                   "tiny_formula": show(kv_cache.bytes_per_token(s.cfg("dynamic")), "bytes")},
            why="2 x layers x kv heads x head_dim x 2 bytes = 2 x 32 x 8 x 128 x 2 = {answer}. The tiny "
                "model measured {tiny} per token, the formula {tiny_formula}.", unit="KiB", rel_tol=0.01),
        Exercise(
            "kv_int8_ratio", topic, "An int8 KV cache",
            "The tiny model's fp32 cache is quantized to int8 with one fp32 scale per token and layer "
            "for K and for V.", "What fraction of the fp32 cache's bytes per token does it take?", "kv",
            answer=lambda s: ratio(s, "quantized", "dynamic", "kv_bytes_per_token"),
            evidence=lambda r, s: {"q": show(r.get("quantized", "kv_bytes_per_token"), "bytes"),
                                   "f": show(r.get("dynamic", "kv_bytes_per_token"), "bytes"),
                                   "err": show(r.get("quantized", "attn_output_rel_error"))},
            why="1 byte instead of 4 per value, plus the scales: {answer}. Measured {q} against {f} per "
                "token; attention output relative error {err}.", abs_tol=0.02),
        Exercise(
            "kv_speedup", topic, "Does the KV cache pay off here?",
            "Generate 32 tokens after a 64-token prompt with the 1-layer model, with no cache "
            "(recompute the prefix every step) and with a dynamic cache.",
            "Which generates more tokens per second on this device?", "kv",
            choices=("the cached run", "the uncached run", "about the same"),
            answer=lambda s: faster(ratio(s, "none", "dynamic", "flops")),
            graded_against="measurement", measured=lambda r: faster(speedup(r)),
            evidence=lambda r, s: {"speedup": show(speedup(r)),
                                   "flops": show(ratio(s, "none", "dynamic", "flops"))},
            why="the uncached run recomputes the whole prefix for every new token: {flops} x the "
                "cached FLOPs (the textbook answer: {answer}). Measured speed-up {speedup} (above "
                "1.2 counts as faster). Small models at small lengths are bound by per-step overhead, "
                "so the speed-up is far below the FLOP ratio."),
        Exercise(
            "padding_waste", topic, "Padding in a static batch",
            "Static batching starts a batch of up to 8 requests together and pads every row to the "
            "longest prompt and the longest output in the batch.",
            "What percentage of the positions computed is padding?", "serve",
            answer=lambda s: s.expected("static")["padding_waste_pct"],
            evidence=lambda r, s: {"pad": show(r.get("static", "padding_waste_pct"), "%"),
                                   "tps_s": show(r.get("static", "useful_tokens_per_s"), "tokens/s"),
                                   "tps_c": show(r.get("continuous", "useful_tokens_per_s"), "tokens/s")},
            why="rows x (longest prompt + longest output - 1) positions, of which the real tokens are "
                "the sum of prompts and outputs - 1: {answer}. Measured padding {pad}; useful tokens/s "
                "static {tps_s}, continuous {tps_c}. Continuous batching pads nothing but schedules "
                "every step; at this tiny size that overhead can cost more than the padding saves.",
            unit="%", abs_tol=3.0, details=_requests),
        Exercise(
            "continuous_steps", topic, "Decode steps under continuous batching",
            "Continuous batching fills freed rows at every step; 8 rows, the same 8 requests.",
            "How many decode steps does it take?", "serve",
            answer=lambda s: s.expected("continuous")["decode_steps"],
            evidence=lambda r, s: {"steps": show(r.get("continuous", "decode_steps")),
                                   "seq": show(r.get("sequential", "decode_steps"))},
            why="at best every step is full: ceil(sum(output - 1) / rows) = {answer}. Measured {steps} "
                "(one request at a time: {seq}).", abs_tol=0.0, details=_requests),
    ]


def _oom_evidence(r: Rows, s: Setup) -> dict[str, Any]:
    row, cfg = r.get("fp32"), s.cfg("fp32")
    return {"status": row["status"] if row else "n/a", "message": row["message"] if row else "",
            "budget": _mib(cfg.memory_budget_gib * 2**30), "need": _mib(s.expected("fp32")["peak_mem_bytes"])}


def _pipe_evidence(r: Rows, s: Setup) -> dict[str, Any]:
    at = {"stage_delay_ms": SLOW_STAGE_MS}
    return {"busy0": show(r.get("gpipe", "stage_busy_ms", rank=0, **at), "ms"),
            "busy1": show(r.get("gpipe", "stage_busy_ms", rank=1, **at), "ms"),
            "bubble1": show(r.get("gpipe", "bubble_fraction", rank=1, **at)),
            "step": show(r.get("gpipe", "step_ms", **at), "ms"),
            "step0": show(r.get("gpipe", "step_ms", stage_delay_ms=0.0), "ms")}


def _trouble(key: str, title: str, scenario: str, run: str, fault: str,
             evidence: Callable[[Rows, Setup], dict[str, Any]], why: str) -> Exercise:
    return Exercise(key, TOPICS[6], title, scenario, "What is wrong with this setup?", run,
                    answer=lambda s: fault, evidence=evidence, why=why, choices=FAULTS,
                    graded_against="fault")


def _troubleshooting() -> list[Exercise]:
    return [
        _trouble(
            "trouble_oom", "Lab 1: the step that never finishes", "A colleague's fp32 AdamW run on a "
            "small device stops at the first step. The device has 0.03 GiB (here a virtual budget).",
            "oom", "out of memory", _oom_evidence,
            "the run's row says {status}: {message}. The planner needs {need} for the step against a "
            "budget of {budget}. Fixes: bf16 weights, activation checkpointing, a smaller micro-batch "
            "with accumulation, ZeRO across ranks (notebooks 07 and 08)."),
        _trouble(
            "trouble_dataloading", "Lab 2: the GPU that idles", "Training is slow though the model is "
            "tiny. The loader does heavy per-sample work in the training process.", "data",
            "data-loading bottleneck",
            lambda r, s: {"wait": show(r.get("baseline", "data_wait_pct"), "%"),
                          "data": show(r.get("baseline", "data_ms"), "ms"),
                          "compute": show(r.get("baseline", "compute_ms"), "ms")},
            "the step waits for its batch {wait} of the time: data {data} against compute {compute} "
            "per step. Move the work into DataLoader workers (num_workers, prefetch_factor, "
            "persistent_workers) and pin memory (notebook 23)."),
        _trouble(
            "trouble_fp16", "Lab 3: nan after a few steps", "A run switched to fp16 autocast without a "
            "GradScaler; the logits reach a few hundred and the loss sums their squares; later the "
            "gradients are tiny.", "mp", "fp16 overflow (no loss scaling)",
            lambda r, s: {**{k: f"{v:.3g}" for k, v in fp16_demo().items()},
                          "scale": show(r.get("fp16", "loss_scale")),
                          "skipped": show(r.get("fp16", "skipped_steps"))},
            "fp16 tops out at 65504: 300^2 + 250^2 in fp16 gives {square_fp16} and 70000 becomes "
            "{big_fp16}; at the other end a 1e-8 gradient becomes {grad_fp16}. GradScaler scales the "
            "loss (here {scale}), skips steps whose gradients overflow ({skipped} skipped) and lowers "
            "the scale; or train in bf16, which has fp32's range."),
        _trouble(
            "trouble_batch", "Lab 4: a full batch of padding", "A server starts batches of 8 requests "
            "together and finishes them together; throughput is lower than the batch size promises.",
            "serve", "mis-sized batch (padding)",
            lambda r, s: {"pad": show(r.get("static", "padding_waste_pct"), "%"),
                          "steps": show(r.get("static", "decode_steps")),
                          "tps_s": show(r.get("static", "useful_tokens_per_s"), "tokens/s")},
            "{pad} of the positions computed by the static batch are padding: every row runs to the "
            "longest prompt and the longest output of its batch ({steps} decode steps), so the step's "
            "work is paid for tokens nobody asked for; useful tokens/s {tps_s}. Size batches by "
            "tokens, bucket requests by length, or batch continuously (notebook 16)."),
        _trouble(
            "trouble_pipeline", "Lab 5: one slow stage", "A 2-stage GPipe pipeline (4 micro-batches); "
            f"stage 0 does extra work in every forward ({SLOW_STAGE_MS:g} ms injected).", "pipe",
            "unbalanced pipeline", _pipe_evidence,
            "stage 0 is busy {busy0} per step, stage 1 only {busy1}: stage 1 idles {bubble1} of the "
            "step waiting for it, and the step takes {step} against {step0} balanced. The whole "
            "pipeline runs at the slowest stage's pace: rebalance the layers by measured cost "
            "(notebook 13)."),
        _trouble(
            "trouble_shape", "Lab 6: the odd-sized matmul", "A model with hidden size 4095 in fp16 "
            "reaches a fraction of the GPU's tensor-core peak; 4096 would not.", "matmul",
            "tensor-core-unfriendly shape",
            lambda r, s: {"aligned": show(r.get("fp32", "tflops", alignment="aligned"), "TFLOP/s"),
                          "off": show(r.get("fp32", "tflops", alignment="off_by_one"), "TFLOP/s"),
                          "friendly": str(tensor_core_friendly(4095, 4095, 4095))},
            "tensor_core_friendly(4095, 4095, 4095) is {friendly}: fp16 tensor cores want multiples of "
            "8. Measured at 256 against 255 (fp32 here): {aligned} against {off}. Pad the hidden size "
            "and the vocabulary to multiples of 64 (notebook 20)."),
    ]


EXERCISES: dict[str, Exercise] = {ex.key: ex for ex in (
    _memory_exercises() + _precision_exercises() + _parallel_exercises() + _profiling_exercises()
    + _inference_exercises() + _troubleshooting())}
