"""The troubleshooting lab: a colleague reports a symptom, the learner reads the measured evidence,
names the cause (one of DIAGNOSES, shared by every lab, "nothing is wrong" among them), and only
then sees the fix knobs: one table, the same for every lab (`KNOBS`), so that the fix is a choice.
A fix changes one knob; labkit maps it onto this lab's setup where the setup has it (a knob it
does not have leaves the setup as it is: measured again, graded, not fixed), measures it again
and grades it by the figure of the mechanism (data_wait_pct, the peak against the budget, inf/nan
losses, zero gradients, the stages' busy-time ratio, padding, FLOPs), with a stated margin, never
by a raw timing.

A lab's key, notebook, title and `symptoms` say what the colleague reports, never its cause, and
show no knob; its evidence is measured figures with their units (and the planner's beside them),
never a conclusion. Decoys: a healthy setup, and labs whose symptoms overlap while their causes
differ, which share a title, a symptoms text and a level and are told apart by a letter only
(`lab_slow_step_*`, a step slower than the planner says: data loading, recomputation left on, or
nothing at all; `lab_fp16_stalls_*`, fp16 that stops learning: a forward overflow or gradients
that underflow). The old keys, which named the causes, are mapped to these where attempts are
read (`attempts.RENAMED`). Every measured fact the evidence rests on is measured in the broken
run (the OOM row has status oom, the fp16 forward gives an inf/nan loss, ...); tests/test_labs.py
asserts it. Each diagnosis and each fix is stored as an attempt (`attempts`), with the
participant and the team. A lab whose mechanism a CPU cannot show (tensor cores) says so at its
top there and grades the formula, citing the H200 record (`h200`).

Use: `symptoms(key)`, `investigate(key)` (the evidence), `diagnose(key, diagnosis)` (its report
lists the knobs), `knobs(key)`, `apply_fix(key, {knob: value})`; `reference_fix(key)` and
`Lab.diagnosis` are the answer key.

A lab here is its mechanism: the setup, the evidence's figures, the knobs it maps and the grading.
Its words (title, symptoms, hint, why, the feedback on each diagnosis, what a CPU cannot show) are
in notebooks/exercises/text/KEY.md, one file per lab (`text` reads them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from labkit import hardware, planner
from labkit.config import ConfigError
from labkit.planner import pipeline as pipe_plan
from labkit.study.exercises import h200
from labkit.study.exercises.attempts import record_attempt
from labkit.study.exercises.core import TOPICS, Rows, Run, Setup, measure_setup, mib, show
from labkit.study.exercises.formulas import FP16_MAX, tensor_core_friendly
from labkit.study.exercises.runs import BLOCK_COST_MS, FAST, RUNS, STAGE_LAYERS
from labkit.study.exercises.text import Text, section
from labkit.techniques import get_experiment

TOPIC = TOPICS[6]
DIAGNOSES = (
    "out of memory: the activations do not fit",
    "data loading starves the step",
    "fp16 overflow in the forward pass",
    "fp16 gradients underflow to zero (no loss scaling)",
    "padding waste from static batching",
    "unbalanced pipeline stages",
    "matmul shape not aligned for tensor cores",
    "recomputation (activation checkpointing) left on",
    "no KV cache: every token recomputes the prefix",
    "nothing is wrong",
)
HEALTHY = DIAGNOSES[-1]
# What each cause would leave in the evidence: the generic feedback for a wrong choice.
SIGNS = dict(zip(DIAGNOSES, (
    "a row with status oom and a measured or planned peak above the memory budget",
    "a high data_wait_pct: the step blocked in next(iterator) for much of its time",
    "an inf or nan loss from the very first forward, before any gradient exists",
    "finite losses that barely move, a gradient norm near 0 and most gradient elements exactly 0",
    "a large padding_waste_pct: positions computed for no request",
    "one stage busy much longer than the other per step, the other idling",
    "a GEMM dimension that is not a multiple of 8 fp16 elements (16 bytes)",
    "counted FLOPs above the planner's for the plain step: forwards run twice",
    "counted FLOPs near the no-cache sum: each token runs the whole prefix again",
    "every mechanism figure as the planner predicts",
)))
# The fix knobs: one table, the same for every lab (a lab maps the ones its setup has).
KNOBS: dict[str, tuple] = {
    "checkpointing": ("none", "full", "selective"),
    "micro_batches": (1, 2, 4, 8),
    "offload": ("none", "activations", "optimizer"),
    "precision": ("fp32", "fp16", "bf16"),
    "loss_scaling": (False, True),
    "num_workers": (0, 1, 2),
    "scheduler": ("static", "dynamic", "continuous"),
    "stage_layers": STAGE_LAYERS,
    "kv_cache": ("none", "dynamic"),
    "gemm_multiple": (1, 8, 64),
}
KNOB_HELP = {
    "checkpointing": "activation checkpointing of the blocks (full: each keeps its input and "
                     "recomputes the rest in backward; selective: keeps the matmul outputs)",
    "micro_batches": "the step's batch split into this many micro-batches, their gradients "
                     "accumulated before one optimizer step (the same tokens per step)",
    "offload": "what lives in host memory: the activations saved for backward, or the "
               "optimizer's states and update",
    "precision": "fp32, or fp16 / bf16 autocast over fp32 weights",
    "loss_scaling": "with fp16: a GradScaler multiplies the loss before backward and divides the "
                    "gradients before the step",
    "num_workers": "data-loader worker processes building batches ahead (0: none)",
    "scheduler": "how a server batches requests (static: a batch starts and ends together; "
                 "dynamic; continuous: a finished row takes a new request at the next step)",
    "stage_layers": "blocks each pipeline stage holds, stage 0 first (the embedding is on the "
                    "first stage, the head on the last)",
    "kv_cache": "decoding keeps every layer's keys and values (dynamic), or not (none)",
    "gemm_multiple": "every GEMM dimension rounded up to a multiple of this many elements (1: as it is)",
}
OOM_BUDGET_GIB = 0.08  # between the fixed setups' peaks (~59-67 MiB) and the plain one (~90 MB)
HEADROOM = 0.10  # a fix must leave this share of the budget free (the allocator varies)
CKPT = {**FAST, "batch_size": 8, "seq_len": 64, "num_layers": 2}
OOM = {**CKPT, "memory_budget_gib": OOM_BUDGET_GIB}
TRAIN = {**FAST, "batch_size": 1, "seq_len": 8, "steps": 3, "num_layers": 2}
OVERFLOW_SCALE = 3e6  # mlp_scale: the MLP's fp16 output passes 65504 at init
UNDERFLOW_WEIGHT = 1e-7  # loss_weight: every fp16 gradient below 2^-24
ZERO_GRAD_MARGIN = 5.0  # points of zero gradient elements a fix may keep above fp32's
FLOP_MARGIN = 0.02  # counted FLOPs may exceed the planner's by this share
WAIT_FACTOR = 0.5  # a loader fix at least halves data_wait_pct
PADDING_LIMIT_PCT = 5.0
# The slowest stage's busy time over the fastest's. Not 1: stage 0 holds the embedding, the last
# the head and the loss; with every block's injected cost (BLOCK_COST_MS) the balanced split
# measured about 1.2 here, both blocks on one stage about 17.
BUSY_RATIO_LIMIT = 2.0
KV_MARGIN = 0.05
SHAPE_MARGIN = 0.05  # on a GPU: the fixed shape's measured fp16 rate at least 1.05x the broken one's
LAB_RUNS = {
    "oom": Run("checkpointing", OOM, ("none", "full")),
    "ckpt": Run("checkpointing", CKPT, ("none", "full")),
    "overflow": Run("mixed_precision", {**TRAIN, "loss_scaling": False, "mlp_scale": OVERFLOW_SCALE},
                    ("fp16", "bf16")),
    "underflow": Run("mixed_precision", {**TRAIN, "loss_scaling": False,
                                         "loss_weight": UNDERFLOW_WEIGHT}, ("fp16",)),
    "loader": Run("dataloading", {**FAST, "batch_size": 1, "seq_len": 8, "steps": 4, "num_layers": 2,
                                  # storage latency (a sleep): workers overlap it even on a
                                  # busy machine, so the fix's figure does not hang on free cores
                                  "sample_cost_us": 0.0, "io_latency_us": 30000.0,
                                  "num_workers": 2}, ("baseline", "workers")),
    "serve": Run("batching", {"num_layers": 1, "num_requests": 8, "max_output_len": 8,
                              "arrival": "closed"}, ("static", "continuous")),
    "decode": Run("kv_cache", {**FAST, "prompt_len": 16, "new_tokens": 16, "num_layers": 1},
                  ("none", "dynamic")),
    # no size: the matmul's own default, 512 on a CPU and 8192 on a GPU, where the tensor cores'
    # difference shows (at a few hundred a launch's fixed cost hides it)
    "shape": Run("matmul", {**FAST}, ("fp16",), {"alignment": ["aligned", "off_by_one"]}),
}


@dataclass(frozen=True)
class Trial:
    """One measured setting: the Run, and the variant and sweep point its figures are read at."""

    run: Run
    variant: str
    point: dict[str, Any] = field(default_factory=dict)


class Reading:
    """A trial's figures in measured rows (rank 0 unless asked)."""

    def __init__(self, rows: Rows, trial: Trial):
        self.rows, self.trial = rows, trial

    def get(self, metric: str, *, rank: int = 0, variant: str | None = None) -> Any:
        return self.rows.get(variant or self.trial.variant, metric, rank=rank, **self.trial.point)

    def predicted(self, metric: str, *, rank: int = 0) -> Any:
        """The planner's (or the experiment's napkin math's) figure beside the measured one."""
        return self.rows.predicted(self.trial.variant, metric, rank=rank, **self.trial.point)

    def reference(self, metric: str) -> Any:
        """The same metric for the Run's reference variant (measured in the same run)."""
        return self.get(metric, variant=get_experiment(self.trial.run.experiment).REFERENCE)

    @property
    def status(self) -> str:
        row = self.rows.get(self.trial.variant, **self.trial.point)
        return row["status"] if row else "missing"

    @property
    def message(self) -> str:
        row = self.rows.get(self.trial.variant, **self.trial.point)
        return row["message"] if row else ""


class FixGrade(NamedTuple):
    passed: bool
    figure: str  # the mechanism figure, measured before and after
    margin: str  # the rule it was graded by, with its margin


@dataclass(frozen=True)
class Lab(Text):
    """A lab's mechanism; its words (title, symptoms, hint, why, feedback, cpu) are in
    notebooks/exercises/text/KEY.md (`labkit.study.exercises.text`)."""

    key: str
    level: int  # 2 or 3 (labkit.study.exercises.LEVELS)
    trial: Trial  # the broken setup
    diagnosis: str  # one of DIAGNOSES
    evidence: Callable[[Reading, Setup], dict[str, str]]  # label -> measured figure, before answering
    broken: dict[str, Any]  # the knobs this setup has (of KNOBS), at their broken settings
    solution: dict[str, Any]  # the reference fix: one knob changed (the healthy lab's: none)
    fixes: dict[str, Callable[[Any], Trial]]  # knob -> its value -> what to measure (the knobs of `broken`)
    grade_fix: Callable[[Reading, Reading, Setup], FixGrade]  # (before, after, setup of after)
    words: dict[str, Any] = field(default_factory=dict)  # the text's {placeholders}: labkit's numbers

    symptoms = section("symptoms", "What a colleague reports: no cause named, no knob.")
    why = section("why", "The explanation after the right diagnosis.")

    def feedback_for(self, diagnosis: str) -> str:
        if diagnosis in self.feedback:
            return self.feedback[diagnosis]
        return (f"If it were that, the evidence would show {SIGNS[diagnosis]}; it does not. "
                f"Read the figures again: {self.hint}")

    def changed(self, settings: dict[str, Any]) -> list[str]:
        """The knobs `settings` set away from the broken setup (any setting of a knob the setup
        does not have counts: the learner chose it)."""
        return [k for k, v in settings.items() if k not in self.broken or self.broken[k] != v]

    def trial_for(self, settings: dict[str, Any]) -> Trial:
        """What to measure for `settings` (at most one knob changed): the knob mapped onto this
        setup, or the broken setup itself when it has no such knob (or nothing changed)."""
        changed = self.changed(settings)
        if not changed or changed[0] not in self.fixes:
            return self.trial
        return self.fixes[changed[0]](settings[changed[0]])


# --- helpers the labs share ----------------------------------------------------------------------

def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}%"


def on_gpu(device: str) -> bool:
    """Whether `device` ("auto" included) is a GPU that is here."""
    resolved = hardware.default_device() if device == "auto" else device
    return resolved.startswith("cuda") and resolved in hardware.available_devices()


def _variant_trial(run: Run, variant: str, changes: dict[str, Any] | None = None,
                   point: dict[str, Any] | None = None) -> Trial:
    """The broken run itself when it measured `variant` with these overrides already (reused),
    else a run of just that variant (and the reference, which the harness always runs)."""
    overrides = {**run.overrides, **(changes or {})}
    measured = (get_experiment(run.experiment).REFERENCE, *run.variants)
    if overrides == run.overrides and variant in measured:
        return Trial(run, variant, point or {})
    return Trial(Run(run.experiment, overrides, (variant,), run.sweep), variant, point or {})


def _plain_flops(s: Setup) -> float:
    c = s.cfg()
    return planner.train_step_flops(c.model, batch=c.batch_size, seq_len=c.seq_len, attention=c.attention)


def _flops_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    plain, got = _plain_flops(s), after.get("flops")
    ratio = got / plain if got else float("nan")
    return FixGrade(after.status == "ok" and ratio <= 1 + FLOP_MARGIN,
                    f"counted FLOPs {before.get('flops') / plain:.3f}x the planner's plain step "
                    f"before, {ratio:.3f}x after",
                    f"at most {1 + FLOP_MARGIN:.2f}x the planner's FLOPs for the step without "
                    "recomputation (FlopCounterMode counts every forward it runs)")


def _fp32_plan(c) -> planner.MemoryPlan:
    """The planner's fp32 training memory of config `c` (no recomputation)."""
    return planner.training_memory(c.model, batch_size=c.batch_size, seq_len=c.seq_len,
                                   precision="fp32", device=c.device)


def _ckpt_evidence(r: Reading, s: Setup) -> dict[str, str]:
    c = s.cfg(r.trial.variant)
    plan = _fp32_plan(c)
    ceil_ms = s.expected("none").get("step_ms")
    return {"step time": f"{show(r.get('step_ms'), 'ms')} (the planner's FLOPs-at-peak bound for "
                         f"the plain step: {show(ceil_ms, 'ms')})",
            "FLOPs counted in one step (FlopCounterMode)": show(r.get("flops") / 1e9, "GFLOP"),
            "the planner's FLOPs for one forward + backward": show(_plain_flops(s) / 1e9, "GFLOP"),
            "peak memory measured": mib(r.get("peak_mem_bytes")),
            "the planner's peak without recomputation": mib(plan.total_bytes),
            "saved activations measured": mib(r.get("activation_bytes")),
            "time waiting for the batch per step": "0 ms (the batch is made once, before the steps)"}


def _ckpt_fixes(run: Run) -> dict[str, Callable[[Any], Trial]]:
    return {"checkpointing": lambda v: _variant_trial(run, v)}


def _train_words(overrides: dict[str, Any]) -> dict[str, Any]:
    return {k: overrides[k] for k in ("num_layers", "batch_size", "seq_len")}


# --- the labs ------------------------------------------------------------------------------------

def _oom_evidence(r: Reading, s: Setup) -> dict[str, str]:
    c = s.cfg("none")
    plan = _fp32_plan(c)
    return {"status of the step": f"{r.status}: {r.message}",
            "memory budget": mib(c.memory_budget_gib * 2**30),
            "the planner's peak for this step": mib(s.expected("none")["peak_mem_bytes"]),
            "of which saved activations (planner)": mib(plan.activation_bytes),
            "parameters / gradients / AdamW's two moments (planner)":
                f"{mib(plan.param_bytes)} / {mib(plan.grad_bytes)} / {mib(plan.optimizer_bytes)}"}


def _oom_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    budget = OOM_BUDGET_GIB * 2**30
    peak, plan = after.get("peak_mem_bytes"), after.predicted("peak_mem_bytes")
    ok = after.status == "ok" and peak is not None and peak <= (1 - HEADROOM) * budget
    got = (f"{mib(peak)} = {100 * peak / budget:.0f}% of the budget (planner: {mib(plan)})" if peak
           else f"{after.message or 'no peak measured'}")
    return FixGrade(ok, f"before: {before.status}; after: {after.status}, peak {got}",
                    f"the step runs (status ok) with its measured peak at most "
                    f"{1 - HEADROOM:.0%} of the {mib(budget)} budget")


def _lab_oom() -> Lab:
    run = LAB_RUNS["oom"]

    def micro_batches(k: int) -> Trial:  # the same 8 sequences a step, k micro-batches of 8 / k
        return Trial(Run("grad_accumulation", {**OOM, "batch_size": OOM["batch_size"] // k,
                                               "micro_batches": k}, ("accumulate",)), "accumulate")

    def offload(where: str) -> Trial:
        return Trial(Run("offload", {**OOM, "steps": 2}, (where,)), where)
    return Lab(
        "lab_stops_at_first_step", 2, Trial(run, "none"), DIAGNOSES[0], _oom_evidence,
        {"checkpointing": "none", "micro_batches": 1, "offload": "none"}, {"checkpointing": "full"},
        {"checkpointing": lambda v: _variant_trial(run, v), "micro_batches": micro_batches,
         "offload": offload},
        _oom_grade, words={"budget_gib": OOM_BUDGET_GIB, **_train_words(OOM)})


def _loader_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    b, a = before.get("data_wait_pct"), after.get("data_wait_pct")
    ok = after.status == "ok" and a is not None and a <= WAIT_FACTOR * b
    return FixGrade(ok, f"data_wait_pct {pct(b)} before, {pct(a)} after",
                    f"data_wait_pct at most {WAIT_FACTOR:.0%} of the broken setup's, both measured here")


def _data_evidence(r: Reading, s: Setup) -> dict[str, str]:
    return {"step time": show(r.get("step_ms"), "ms"),
            "time blocked waiting for the next batch (data_ms)": show(r.get("data_ms"), "ms"),
            "compute per step (compute_ms)":
                f"{show(r.get('compute_ms'), 'ms')} (the planner's FLOPs at this device's peak: "
                f"{show(r.predicted('compute_ms'), 'ms')})",
            "data_wait_pct": pct(r.get("data_wait_pct")),
            "FLOPs counted in one step": f"{show(r.get('flops') / 1e6, 'MFLOP')} (the planner's: "
                                         f"{show(s.expected('baseline')['flops'] / 1e6, 'MFLOP')})"}


def _lab_data() -> Lab:
    run = LAB_RUNS["loader"]

    def workers(n: int) -> Trial:
        return Trial(run, "baseline") if n == 0 else _variant_trial(run, "workers", {"num_workers": n})
    return Lab(
        "lab_slow_step_c", 3, Trial(run, "baseline"), DIAGNOSES[1], _data_evidence,
        {"num_workers": 0}, {"num_workers": 2}, {"num_workers": workers}, _loader_grade,
        words=_train_words(run.overrides))


def _mp_evidence(r: Reading, s: Setup) -> dict[str, str]:
    steps = s.cfg().steps

    def value(metric: str, at: str, variant: str | None = None) -> str:
        v = r.get(metric, variant=variant)
        return f"{v:.4f}" if v is not None else f"inf/nan (not finite) {at}"
    first, last = "at step 1", f"at step {steps}"
    return {"fp16 loss at step 1 (before any update)": value("loss_first", first),
            f"fp16 loss after {steps} steps": value("loss", last),
            f"fp32 loss at step 1 / after {steps} steps":
                f"{value('loss_first', first, 'fp32')} / {value('loss', last, 'fp32')}",
            f"fp16 steps with an inf/nan loss (of {steps})": show(r.get("nonfinite_losses")),
            "fp16 gradient norm, last step": value("grad_norm", last),
            "fp16 gradient elements exactly 0, last step": pct(r.get("zero_grad_pct")),
            "fp32 gradient elements exactly 0 (embedding rows of unseen tokens)":
                pct(r.reference("zero_grad_pct")),
            f"fp16 loss less fp32's after {steps} steps": value("loss_delta", last)}


MP_BROKEN = {"precision": "fp16", "loss_scaling": False}


def _mp_fixes(run: Run) -> dict[str, Callable[[Any], Trial]]:
    return {"precision": lambda p: _variant_trial(run, p),
            "loss_scaling": lambda on: _variant_trial(run, "fp16", {"loss_scaling": on})}


def _overflow_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    b, a = before.get("nonfinite_losses"), after.get("nonfinite_losses")
    skipped = after.get("skipped_steps")
    extra = f" (GradScaler skipped {skipped:g})" if skipped else ""
    return FixGrade(a == 0, f"steps with an inf/nan loss: {b:g} before, {a:g} after{extra}",
                    f"no inf or nan loss in any of the {s.cfg().steps} steps (exactly 0)")


def _lab_fp16_overflow() -> Lab:
    run = LAB_RUNS["overflow"]
    return Lab(
        "lab_fp16_stalls_b", 3, Trial(run, "fp16"), DIAGNOSES[2], _mp_evidence, MP_BROKEN,
        {"precision": "bf16"}, _mp_fixes(run), _overflow_grade, words={"fp16_max": FP16_MAX})


def _underflow_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    ref, b, a = after.reference("zero_grad_pct"), before.get("zero_grad_pct"), after.get("zero_grad_pct")
    ok = a is not None and after.get("nonfinite_losses") == 0 and a <= ref + ZERO_GRAD_MARGIN
    return FixGrade(ok, f"gradient elements exactly 0: {pct(b)} before, {pct(a)} after "
                        f"(fp32: {pct(ref)})",
                    f"at most {ZERO_GRAD_MARGIN:g} points above fp32's zero share, no inf/nan loss")


def _lab_fp16_underflow() -> Lab:
    run = LAB_RUNS["underflow"]
    return Lab(
        "lab_fp16_stalls_a", 3, Trial(run, "fp16"), DIAGNOSES[3], _mp_evidence, MP_BROKEN,
        {"loss_scaling": True}, _mp_fixes(run), _underflow_grade)


def _padding_evidence(r: Reading, s: Setup) -> dict[str, str]:
    c = s.cfg("static")

    def beside(metric: str, say: Callable[[Any], str] = show) -> str:
        return f"{say(r.get(metric))} (planner: {say(r.predicted(metric))})"
    return {"requests": f"{c.num_requests}, up to {c.max_output_len} output tokens each, "
                        f"{show(r.get('max_concurrent'))} at most in flight",
            "positions computed for no request (padding_waste_pct)": beside("padding_waste_pct", pct),
            "positions prefilled": beside("prefill_tokens"),
            "decode steps": beside("decode_steps"),
            "useful tokens/s": show(r.get("useful_tokens_per_s")),
            "useful tokens/s one request at a time": show(r.get("useful_tokens_per_s", variant="sequential"))}


def _lab_padding() -> Lab:
    run = LAB_RUNS["serve"]

    def grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
        b, a = before.get("padding_waste_pct"), after.get("padding_waste_pct")
        return FixGrade(a is not None and a <= PADDING_LIMIT_PCT,
                        f"padding_waste_pct {pct(b)} before, {pct(a)} after",
                        f"at most {PADDING_LIMIT_PCT:g}% of the computed token positions are padding")
    return Lab(
        "lab_low_throughput", 2, Trial(run, "static"), DIAGNOSES[4], _padding_evidence,
        {"scheduler": "static"}, {"scheduler": "continuous"},
        {"scheduler": lambda v: _variant_trial(run, v)}, grade,
        words={"num_requests": run.overrides["num_requests"]})


def _split_trial(layers: str) -> Trial:
    """GPipe with `layers` blocks per stage, every block at its injected cost: a point of the
    exercises' pipeline run when it measured that split, else a run of it alone."""
    pipe, point = RUNS["pipe"], {"stage_layers": layers, "block_cost_ms": BLOCK_COST_MS}
    run = pipe if point in pipe.sweep else Run(pipe.experiment, pipe.overrides, ("gpipe",), [point])
    return Trial(run, "gpipe", {"stage_layers": layers})


def _pipe_evidence(r: Reading, s: Setup) -> dict[str, str]:
    c = s.cfg("gpipe", **r.trial.point)
    blocks = c.stage_layers.split(",")
    alone = [r.get("stage_fwd_ms", rank=i) + r.get("stage_bwd_ms", rank=i) for i in (0, 1)]

    def both(values: list) -> str:
        return " / ".join(show(v, "ms") for v in values)
    return {"schedule": f"GPipe over {c.nproc} stages (CPU ranks, gloo), {c.micro_batches} micro-batches",
            "blocks on stage 0 / stage 1": f"{blocks[0]} (+ the embedding) / {blocks[1]} (+ the head "
                                           "and the loss)",
            "busy per step, stage 0 / stage 1": both([r.get("stage_busy_ms", rank=i) for i in (0, 1)]),
            "one micro-batch's forward + backward, timed alone, stage 0 / stage 1": both(alone),
            "idle share of the step, stage 0 / stage 1":
                " / ".join(pct(100 * r.get("bubble_fraction", rank=i)) for i in (0, 1)),
            "the schedule's ideal bubble (p-1)/(m+p-1)": pct(100 * r.get("ideal_bubble_fraction")),
            "step time": show(r.get("step_ms"), "ms")}


def _busy_ratio(r: Reading) -> float:
    busy = [r.get("stage_busy_ms", rank=i) for i in (0, 1)]
    return max(busy) / min(busy)


def _pipe_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    b, a = _busy_ratio(before), _busy_ratio(after)
    return FixGrade(a <= BUSY_RATIO_LIMIT, f"slowest stage's busy time / fastest's: {b:.2f} before, "
                    f"{a:.2f} after", f"at most {BUSY_RATIO_LIMIT:g} (the embedding and the head "
                    "stay on their stages: 1 is out of reach)")


def _lab_pipeline() -> Lab:
    pipe = RUNS["pipe"].overrides
    p, m = pipe["nproc"], pipe["micro_batches"]
    return Lab(
        "lab_slow_pipeline", 3, _split_trial(STAGE_LAYERS[0]), DIAGNOSES[5], _pipe_evidence,
        {"stage_layers": STAGE_LAYERS[0]}, {"stage_layers": STAGE_LAYERS[1]},
        {"stage_layers": _split_trial}, _pipe_grade,
        words={"block_cost_ms": BLOCK_COST_MS, "stages": p, "micro_batches": m,
               "ideal_bubble": pct(100 * pipe_plan.ideal_bubble_fraction("gpipe", p, m, 1))})


def _shape_dims(s: Setup, alignment: str) -> tuple[int, int, int]:
    from labkit.techniques import matmul

    return matmul.dims(s.cfg("fp16", alignment=alignment))


def _shape_trial(multiple: int) -> Trial:
    """The broken dimensions (each one short of a multiple of 128) rounded up to `multiple`."""
    from labkit.techniques import matmul

    offset = matmul.OFFSET["off_by_one"] // multiple * multiple
    alignment = next(a for a, o in matmul.OFFSET.items() if o == offset)
    return Trial(LAB_RUNS["shape"], "fp16", {"alignment": alignment})


def _shape_evidence(r: Reading, s: Setup) -> dict[str, str]:
    m, n, k = _shape_dims(s, "off_by_one")
    return {"GEMM m, n, k": f"{m}, {n}, {k} (fp16 inputs, 2 bytes an element)",
            "fp16 rate measured": f"{show(r.get('tflops'), 'TFLOP/s')}, {pct(r.get('peak_flops_pct'))} "
                                  f"of this device's fp16 peak ({show(r.predicted('tflops'), 'TFLOP/s')})",
            "fp32 rate measured at the same shape": show(r.reference("tflops"), "TFLOP/s")}


def _shape_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    """On a GPU the measured fp16 rate too; on a CPU, which has no tensor cores, the formula."""
    b, a = (_shape_dims(s, x.trial.point["alignment"]) for x in (before, after))
    figure = (f"m, n, k {b} before, {a} after; in fp16 bytes {2 * b[0]} = 16 x {2 * b[0] / 16:g} "
              f"before, {2 * a[0]} = 16 x {2 * a[0] / 16:g} after")
    rule = ("every dimension a multiple of 16 bytes (8 fp16 elements); on A100 and newer 128 bytes "
            "(64) is better still (NVIDIA's matmul performance guide)")
    friendly = tensor_core_friendly(*a)
    if on_gpu(s.device):
        rb, ra = before.get("tflops"), after.get("tflops")
        ratio = ra / rb if ra and rb else float("nan")
        return FixGrade(friendly and ratio >= 1 + SHAPE_MARGIN,
                        f"{figure}; fp16 measured {show(rb, 'TFLOP/s')} before, {show(ra, 'TFLOP/s')} "
                        f"after ({ratio:.2f}x)",
                        f"{rule}, and the measured fp16 rate at least {1 + SHAPE_MARGIN:.2f}x the "
                        "broken shape's")
    return FixGrade(friendly, f"{figure}; a CPU has no tensor cores, so the formula is graded (the "
                              f"H200 record: {h200.matmul_words()})",
                    f"{rule}: the formula (tensor_core_friendly), since a CPU cannot show it")


def _lab_shape() -> Lab:
    return Lab(
        "lab_slow_matmul", 2, _shape_trial(1), DIAGNOSES[6], _shape_evidence,
        {"gemm_multiple": 1}, {"gemm_multiple": 64}, {"gemm_multiple": _shape_trial}, _shape_grade,
        words={"h200_matmul": h200.matmul_words()})


def _lab_healthy() -> Lab:
    run = LAB_RUNS["ckpt"]

    def grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
        g = _flops_grade(before, after, s)
        return g._replace(margin=g.margin + "; the healthy setup already meets it: leave it as it is")
    return Lab(
        "lab_slow_step_b", 3, Trial(run, "none"), HEALTHY, _ckpt_evidence, {"checkpointing": "none"},
        {"checkpointing": "none"}, _ckpt_fixes(run), grade, words=_train_words(CKPT))


def _lab_recompute() -> Lab:
    run = LAB_RUNS["ckpt"]
    return Lab(
        "lab_slow_step_a", 3, Trial(run, "full"), DIAGNOSES[7], _ckpt_evidence,
        {"checkpointing": "full"}, {"checkpointing": "none"}, _ckpt_fixes(run), _flops_grade,
        words=_train_words(CKPT))


def _lab_kv_cache() -> Lab:
    run = LAB_RUNS["decode"]

    def flops(s: Setup, cached: bool) -> float:
        c = s.cfg()
        return planner.generate_flops(c.model, batch=c.batch_size, prompt_len=c.prompt_len,
                                      new_tokens=c.new_tokens, cached=cached)

    def evidence(r: Reading, s: Setup) -> dict[str, str]:
        c = s.cfg()
        one = planner.forward_flops(c.model, batch=c.batch_size, new=c.prompt_len, keys=c.prompt_len, logits=1)
        last = planner.forward_flops(c.model, batch=c.batch_size, new=c.prompt_len + c.new_tokens - 1,
                                     keys=c.prompt_len + c.new_tokens - 1, logits=1)
        return {"generation": f"{c.new_tokens} new tokens after a {c.prompt_len}-token prompt",
                "FLOPs counted (FlopCounterMode)": show(r.get("flops") / 1e6, "MFLOP"),
                "the planner's FLOPs without a KV cache": show(flops(s, False) / 1e6, "MFLOP"),
                "the planner's FLOPs with a KV cache": show(flops(s, True) / 1e6, "MFLOP"),
                "the planner's forward of the first token / of the last, without a cache":
                    f"{one / 1e6:.1f} / {last / 1e6:.1f} MFLOP"}

    def grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
        n = s.cfg().new_tokens
        b, a, want = before.get("flops") / n, after.get("flops") / n, flops(s, True) / n
        return FixGrade(a <= (1 + KV_MARGIN) * want, f"FLOPs per generated token {b / 1e6:.2f} M "
                        f"before, {a / 1e6:.2f} M after (planner with a cache: {want / 1e6:.2f} M)",
                        f"at most {1 + KV_MARGIN:.2f}x the planner's FLOPs per token with a cache")
    return Lab(
        "lab_slow_generation", 2, Trial(run, "none"), DIAGNOSES[8], evidence, {"kv_cache": "none"},
        {"kv_cache": "dynamic"}, {"kv_cache": lambda v: _variant_trial(run, v)}, grade)


def build_labs() -> list[Lab]:
    return [_lab_oom(), _lab_data(), _lab_padding(), _lab_shape(), _lab_kv_cache(), _lab_healthy(),
            _lab_fp16_overflow(), _lab_fp16_underflow(), _lab_pipeline(), _lab_recompute()]


# By level, then key: the notebooks' numbers follow the keys, so labs whose symptoms overlap are
# numbered in their letters' order, which does not follow DIAGNOSES'.
LABS: dict[str, Lab] = {lab.key: lab for lab in sorted(build_labs(), key=lambda lab: (lab.level, lab.key))}


# --- playing a lab: symptoms, evidence, diagnosis, knobs, fix ------------------------------------

@dataclass
class Evidence:
    lab: Lab
    figures: dict[str, str]  # label -> measured figure (and the planner's beside it)
    source: str  # where the measurement came from
    reading: Reading
    device: str  # where it was measured

    def report(self) -> str:
        """The figures, under where they were measured (not the run's id: it names the experiment,
        a cause's name; it is in the attempt record)."""
        where = ("a stored run of the same settings on this machine, reused" if "reused" in self.source
                 else "measured now")
        lines = [f"Evidence ({where}, on {self.device}):"] + [f"- {k}: {v}" for k, v in self.figures.items()]
        return "\n".join(lines)


def knob_table() -> str:
    """The fix knobs, the same for every lab, with their values and what each does."""
    lines = ["Fix knobs (the same for every lab): change one, e.g. apply_fix(key, {knob: value});",
             "labkit measures the setup again with it and grades the figure of the mechanism."]
    lines += [f"- {k}: {', '.join(repr(v) for v in vals)}: {KNOB_HELP[k]}" for k, vals in KNOBS.items()]
    return "\n".join(lines)


@dataclass
class DiagnosisOutcome:
    lab: Lab
    diagnosis: str
    correct: bool
    feedback: str
    solution: bool = False

    def report(self) -> str:
        head = "Solution mode: the reference diagnosis. " if self.solution else ""
        verdict = "correct" if self.correct else "wrong"
        text = f"{head}Diagnosis {self.diagnosis!r}: {verdict}.\n{self.feedback}"
        return text + (f"\nWhy: {self.lab.why}" if self.correct else "") + "\n\n" + knob_table()


@dataclass
class FixOutcome:
    lab: Lab
    fix: dict[str, Any]  # the knobs set, as given
    grade: FixGrade
    source: str  # the re-measurement
    solution: bool = False

    @property
    def unmapped(self) -> str:
        """The knob set, when this setup has nothing it sets ("" otherwise)."""
        changed = self.lab.changed(self.fix)
        return changed[0] if changed and changed[0] not in self.lab.fixes else ""

    @property
    def passed(self) -> bool:
        return self.grade.passed

    def report(self) -> str:
        head = "Solution mode: the reference fix. " if self.solution else ""
        verdict = "fixed" if self.passed else "not fixed"
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.fix.items()) or "none (the setup as it is)"
        same = (f" (nothing in this setup is set by {self.unmapped}: it is measured as it was)"
                if self.unmapped else "")
        return (f"{head}Fix {knobs}: graded {verdict}.\nMeasured again: {self.source}{same}.\n"
                f"Figure: {self.grade.figure}.\nRule: {self.grade.margin}.")


def get_lab(key: str) -> Lab:
    if key not in LABS:
        raise ConfigError(f"unknown lab {key!r}; valid: {', '.join(LABS)}")
    return LABS[key]


def knob_words() -> str:
    """Every knob and its valid values, on one line (for errors)."""
    return "; ".join(f"{k}: {', '.join(repr(v) for v in vals)}" for k, vals in KNOBS.items())


def knobs(key: str) -> str:
    """The fix knobs (the same for every lab): for after the diagnosis."""
    get_lab(key)
    return knob_table()


def cpu_note(lab: Lab, device: str = "auto") -> str:
    """What this machine cannot show of the lab's mechanism ("" on a GPU, or when a CPU shows it)."""
    return f"On this machine, which has no GPU: {lab.cpu}" if lab.cpu and not on_gpu(device) else ""


def symptoms(key: str, device: str = "auto") -> str:
    """What is reported and the diagnoses to choose from (nothing measured, no knob: safe to show
    first); on a CPU, first what it cannot show of this lab."""
    lab = get_lab(key)
    note = cpu_note(lab, device)
    return ((note + "\n\n" if note else "") + f"{lab.title} (level {lab.level}).\n\n"
            f"Reported: {lab.symptoms}\n\nDiagnoses: " + "; ".join(DIAGNOSES) + ".")


def _read(trial: Trial, device: str, runs_dir: str | None, reuse: bool = True) -> tuple[Reading, Setup]:
    setup = Setup(trial.run, device)
    return Reading(measure_setup(setup, runs_dir, reuse=reuse), trial), setup


def investigate(key: str, device: str = "auto", runs_dir: str | None = None, *,
                reuse: bool = True) -> Evidence:
    """The broken setup measured (or a stored complete run of it reused) and its evidence."""
    lab = get_lab(key)
    reading, setup = _read(lab.trial, device, runs_dir, reuse)
    with setup.formulas():
        figures = lab.evidence(reading, setup)
    return Evidence(lab, figures, reading.rows.source, reading, setup.device)


def parse_diagnosis(key: str, diagnosis: Any) -> str:
    text = str(diagnosis).strip().lower()
    match = [d for d in DIAGNOSES if d.lower() == text]
    if not match:
        raise ConfigError(f"unknown diagnosis {diagnosis!r} for {key}; valid: {'; '.join(DIAGNOSES)}")
    return match[0]


def diagnose(key: str, diagnosis: Any = None, *, solution: bool = False, device: str = "auto",
             runs_dir: str | None = None, participant: str | None = None,
             team: str | None = None, evidence: Evidence | None = None) -> DiagnosisOutcome:
    """Grade a diagnosis against the lab's cause, with the feedback for that choice (its report
    then lists the fix knobs); a learner's attempt (not solution mode) is stored with the
    evidence it was made on (`evidence`, when the caller has it already from `investigate`)."""
    lab = get_lab(key)
    chosen = lab.diagnosis if solution else parse_diagnosis(key, diagnosis)
    outcome = DiagnosisOutcome(lab, chosen, chosen == lab.diagnosis, lab.feedback_for(chosen), solution)
    if not solution:
        ev = evidence or investigate(key, device, runs_dir)
        record_attempt(kind="diagnosis", exercise=key, topic=TOPIC, level=lab.level,
                       prediction=chosen, reference=lab.diagnosis, correct=outcome.correct,
                       measured=ev.figures, device=ev.device,
                       run_id=ev.reading.rows.run_id, folder=runs_dir, participant=participant,
                       team=team)
    return outcome


def _knob_value(key: str, name: str, value: Any) -> Any:
    """`value` as the knob's own (a widget's or papermill's text included), or a one-line
    ConfigError naming the valid knobs or values."""
    if name not in KNOBS:
        raise ConfigError(f"{key}: unknown knob {name!r}; valid knobs: {knob_words()}")
    match = [v for v in KNOBS[name] if v == value or str(v).lower() == str(value).strip().lower()]
    if not match:
        raise ConfigError(f"{key}: {name}={value!r} is not valid; valid: "
                          + ", ".join(repr(v) for v in KNOBS[name]))
    return match[0]


def given_fix(key: str, fix: dict[str, Any] | None) -> dict[str, Any]:
    """The knobs `fix` sets, each as the knob's own value; a ConfigError (one line, the valid
    knobs and values) for an unknown knob or value, or for more than one knob changed."""
    lab = get_lab(key)
    if not isinstance(fix, dict):
        raise ConfigError(f"{key}: a fix is a dict of one knob and its value; valid knobs: {knob_words()}")
    given = {name: _knob_value(key, name, value) for name, value in fix.items()}
    changed = lab.changed(given)
    if len(changed) > 1:
        raise ConfigError(f"{key}: change one knob at a time (got {', '.join(changed)}), so that "
                          f"the re-measurement shows what it does; valid knobs: {', '.join(KNOBS)}")
    return given


def parse_fix(key: str, fix: dict[str, Any] | None) -> dict[str, Any]:
    """The settings of the knobs this setup has (the broken ones unless `fix` sets them), with the
    knob `fix` sets; a ConfigError as `given_fix` says."""
    return {**get_lab(key).broken, **given_fix(key, fix)}


def reference_fix(key: str) -> dict[str, Any]:
    """The answer key's fix (the healthy lab's: leave the setup as it is)."""
    return dict(get_lab(key).solution)


def apply_fix(key: str, fix: dict[str, Any] | None = None, *, solution: bool = False,
              device: str = "auto", runs_dir: str | None = None, participant: str | None = None,
              team: str | None = None) -> FixOutcome:
    """Measure the setup with `fix` (one knob) applied, mapped onto this lab's setup (a stored
    complete run of the same settings is reused; a knob the setup does not have leaves it as it
    was) and grade it by the mechanism figure against the broken setup's, with the lab's margin."""
    lab = get_lab(key)
    given = given_fix(key, reference_fix(key) if solution else fix)
    before, _ = _read(lab.trial, device, runs_dir)
    after, setup = _read(lab.trial_for({**lab.broken, **given}), device, runs_dir)
    with setup.formulas():
        grade = lab.grade_fix(before, after, setup)
    outcome = FixOutcome(lab, given, grade, after.rows.source, solution)
    if not solution:
        record_attempt(kind="fix", exercise=key, topic=TOPIC, level=lab.level, prediction=given,
                       reference=lab.solution, correct=grade.passed,
                       measured={"figure": grade.figure, "rule": grade.margin}, device=setup.device,
                       run_id=after.rows.run_id, folder=runs_dir, participant=participant, team=team)
    return outcome


def widget(key: str, *, device: str = "auto", runs_dir: str | None = None):
    """A dropdown of diagnoses with a Diagnose button; after a diagnosis, a knob and its value
    with an Apply button (hidden before: the knobs come after the diagnosis); the graded reports
    below them."""
    import ipywidgets as w

    get_lab(key)
    choice = w.Dropdown(options=DIAGNOSES, description="Diagnosis", layout=w.Layout(width="60%"))
    knob = w.Dropdown(options=list(KNOBS), description="Knob")
    value = w.Dropdown(options=[(repr(v), v) for v in KNOBS[knob.value]], description="Value")
    knob.observe(lambda _: setattr(value, "options", [(repr(v), v) for v in KNOBS[knob.value]]), "value")
    ask, apply_, out = w.Button(description="Diagnose", button_style="primary"), w.Button(
        description="Apply fix", button_style="warning"), w.Output()
    fix_row = w.HBox([knob, value, apply_], layout=w.Layout(display="none"))

    def run(fn):
        out.clear_output()
        with out:
            try:
                print(fn().report())
            except ConfigError as e:
                print(e)

    def on_ask(_):
        run(lambda: diagnose(key, choice.value, device=device, runs_dir=runs_dir))
        fix_row.layout.display = "flex"

    ask.on_click(on_ask)
    apply_.on_click(lambda _: run(lambda: apply_fix(key, {knob.value: value.value},
                                                    device=device, runs_dir=runs_dir)))
    return w.VBox([w.HBox([choice, ask]), fix_row, out])
