"""The troubleshooting lab: a colleague reports a symptom, the learner reads the measured evidence,
names the cause (one of DIAGNOSES, shared by every lab, "nothing is wrong" among them), then applies
a fix with labkit's own knobs; labkit measures the fixed setup again and grades the fix by the
figure of the mechanism (data_wait_pct, peak bytes against the budget, inf/nan losses, zero
gradients, a stage's busy time, padding, FLOPs), with a stated margin, never by a raw timing.

A lab's `symptoms` never name its cause. Decoys: a healthy setup (`lab_healthy`), and labs whose
symptoms overlap while their causes differ (a step slower than the planner says: data loading,
recomputation left on, or nothing at all; fp16 that stops learning: a forward overflow or
gradients that underflow). Every measured fact the evidence rests on is measured in the broken
run (the OOM row has status oom, the fp16 forward gives an inf/nan loss, ...); tests/test_labs.py
asserts it. Each diagnosis and each fix is stored as an attempt (`attempts`), with the
participant and the team.

Use: `symptoms(key)`, `investigate(key)` (the evidence), `diagnose(key, diagnosis)`,
`apply_fix(key, {knob: value})`; `reference_fix(key)` and `Lab.diagnosis` are the answer key.

A lab here is its mechanism: the setup, the evidence's figures, the knobs and the grading. Its
words (title, symptoms, hint, why, the feedback on each diagnosis) are in
notebooks/exercises/text/KEY.md, one file per lab (`text` reads them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from labkit import planner
from labkit.config import ConfigError
from labkit.study.exercises.attempts import record_attempt
from labkit.study.exercises.core import TOPICS, Rows, Run, Setup, measure_setup, mib, show
from labkit.study.exercises.formulas import FP16_MAX, tensor_core_friendly
from labkit.study.exercises.runs import FAST, RUNS, SLOW_STAGE_MS
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
OOM_BUDGET_GIB = 0.08  # between the checkpointed peak (~70 MB) and the plain one (~90 MB)
HEADROOM = 0.10  # a fix must leave this share of the budget free (the allocator varies)
CKPT = {**FAST, "batch_size": 8, "seq_len": 64, "num_layers": 2}
TRAIN = {**FAST, "batch_size": 1, "seq_len": 8, "steps": 3, "num_layers": 2}
OVERFLOW_SCALE = 3e6  # mlp_scale: the MLP's fp16 output passes 65504 at init
UNDERFLOW_WEIGHT = 1e-7  # loss_weight: every fp16 gradient below 2^-24
ZERO_GRAD_MARGIN = 5.0  # points of zero gradient elements a fix may keep above fp32's
FLOP_MARGIN = 0.02  # counted FLOPs may exceed the planner's by this share
WAIT_FACTOR = 0.5  # a loader fix at least halves data_wait_pct
PADDING_LIMIT_PCT = 5.0
# The slowest stage's busy time over the fastest's. Not 1: with 2 blocks, the embedding and the
# head to place, the best split measured about 1.6 here; the injected extra work gives about 10.
BUSY_RATIO_LIMIT = 3.0
KV_MARGIN = 0.05
LAB_RUNS = {
    "oom": Run("checkpointing", {**CKPT, "memory_budget_gib": OOM_BUDGET_GIB}, ("none", "full")),
    "ckpt": Run("checkpointing", CKPT, ("none", "full")),
    "overflow": Run("mixed_precision", {**TRAIN, "loss_scaling": False, "mlp_scale": OVERFLOW_SCALE},
                    ("fp16",)),
    "underflow": Run("mixed_precision", {**TRAIN, "loss_scaling": False,
                                         "loss_weight": UNDERFLOW_WEIGHT}, ("fp16",)),
    "loader": Run("dataloading", {**FAST, "batch_size": 1, "seq_len": 8, "steps": 4, "num_layers": 2,
                                  # storage latency (a sleep): workers overlap it even on a
                                  # busy machine, so the fix's figure does not hang on free cores
                                  "sample_cost_us": 0.0, "io_latency_us": 30000.0}, ("baseline",)),
    "serve": Run("batching", {"num_layers": 1, "num_requests": 8, "max_output_len": 8,
                              "arrival": "closed"}, ("static", "continuous")),
    "decode": Run("kv_cache", {**FAST, "prompt_len": 16, "new_tokens": 16, "num_layers": 1},
                  ("none", "dynamic")),
    "shape": Run("matmul", {**FAST, "size": 256}, ("fp16",),
                 {"alignment": ["aligned", "mult8", "off_by_one"]}),
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
    """A lab's mechanism; its words (title, symptoms, hint, why, feedback) are in
    notebooks/exercises/text/KEY.md (`labkit.study.exercises.text`)."""

    key: str
    level: int  # 2 or 3 (labkit.study.exercises.LEVELS)
    trial: Trial  # the broken setup
    diagnosis: str  # one of DIAGNOSES
    evidence: Callable[[Reading, Setup], dict[str, str]]  # label -> measured figure, before answering
    knobs: dict[str, tuple]  # the fix knobs and their valid values
    broken: dict[str, Any]  # the knobs' settings in the broken setup
    solution: dict[str, Any]  # the reference fix (knobs left out keep the broken setting)
    make_trial: Callable[[dict[str, Any]], Trial]  # full knob settings -> what to measure
    grade_fix: Callable[[Reading, Reading, Setup], FixGrade]  # (before, after, setup of after)
    words: dict[str, Any] = field(default_factory=dict)  # the text's {placeholders}: labkit's numbers

    symptoms = section("symptoms", "What a colleague reports: no cause named.")
    why = section("why", "The explanation after the right diagnosis.")

    def feedback_for(self, diagnosis: str) -> str:
        if diagnosis in self.feedback:
            return self.feedback[diagnosis]
        return (f"If it were that, the evidence would show {SIGNS[diagnosis]}; it does not. "
                f"Read the figures again: {self.hint}")


# --- helpers the labs share ----------------------------------------------------------------------

def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}%"


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


def _ckpt_evidence(r: Reading, s: Setup) -> dict[str, str]:
    c = s.cfg(r.trial.variant)
    plan = planner.training_memory(c.model, batch_size=c.batch_size, seq_len=c.seq_len,
                                   precision="fp32", device=c.device)
    ceil_ms = s.expected("none").get("step_ms")
    return {"step time": f"{show(r.get('step_ms'), 'ms')} (the planner's FLOPs-at-peak bound for "
                         f"the plain step: {show(ceil_ms, 'ms')})",
            "FLOPs counted in one step (FlopCounterMode)": show(r.get("flops") / 1e9, "GFLOP"),
            "the planner's FLOPs for one forward + backward": show(_plain_flops(s) / 1e9, "GFLOP"),
            "peak memory measured": mib(r.get("peak_mem_bytes")),
            "the planner's peak without recomputation": mib(plan.total_bytes),
            "saved activations measured": mib(r.get("activation_bytes")),
            "data wait": "none: the batch is already on the device (no loader in this loop)"}


CKPT_KNOBS = {"checkpointing": ("none", "full", "selective")}


# --- the labs ------------------------------------------------------------------------------------

def _oom_evidence(r: Reading, s: Setup) -> dict[str, str]:
    c = s.cfg("none")
    return {"status of the step": f"{r.status}: {r.message}",
            "memory budget": mib(c.memory_budget_gib * 2**30),
            "the planner's peak for this step": mib(s.expected("none")["peak_mem_bytes"]),
            "of which saved activations (planner)": mib(s.expected("none")["activation_bytes"]),
            "parameters + AdamW state (planner)": mib(3 * planner.param_bytes(c.model, "float32"))}


def _oom_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    budget = s.cfg().memory_budget_gib * 2**30
    peak = after.get("peak_mem_bytes")
    ok = after.status == "ok" and peak is not None and peak <= (1 - HEADROOM) * budget
    got = f"{mib(peak)} = {100 * peak / budget:.0f}% of the budget" if peak else after.status
    return FixGrade(ok, f"before: {before.status}; after: {after.status}, peak {got}",
                    f"the step runs (status ok) with its measured peak at most "
                    f"{1 - HEADROOM:.0%} of the {mib(budget)} budget")


def _lab_oom() -> Lab:
    run = LAB_RUNS["oom"]
    return Lab(
        "lab_oom", 2,
        Trial(run, "none"), DIAGNOSES[0], _oom_evidence, CKPT_KNOBS, {"checkpointing": "none"},
        {"checkpointing": "full"}, lambda f: _variant_trial(run, f["checkpointing"]), _oom_grade,
        words={"budget_gib": OOM_BUDGET_GIB})


def _loader_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    b, a = before.get("data_wait_pct"), after.get("data_wait_pct")
    ok = after.status == "ok" and a is not None and a <= WAIT_FACTOR * b
    return FixGrade(ok, f"data_wait_pct {pct(b)} before, {pct(a)} after",
                    f"data_wait_pct at most {WAIT_FACTOR:.0%} of the broken setup's, both measured here")


def _lab_data() -> Lab:
    run = LAB_RUNS["loader"]

    def trial(f: dict[str, Any]) -> Trial:
        n = f["num_workers"]
        return Trial(run, "baseline") if n == 0 else _variant_trial(run, "workers", {"num_workers": n})
    return Lab(
        "lab_data_loading", 2,
        Trial(run, "baseline"), DIAGNOSES[1],
        lambda r, s: {"step time": show(r.get("step_ms"), "ms"),
                      "time blocked waiting for the batch (data_ms)": show(r.get("data_ms"), "ms"),
                      "compute per step (compute_ms)": show(r.get("compute_ms"), "ms"),
                      "data_wait_pct": pct(r.get("data_wait_pct")),
                      "FLOPs counted / planner's": f"{r.get('flops') / s.expected('baseline')['flops']:.3f}",
                      "loader processes (num_workers)": "0: the batch is built in the training process"},
        {"num_workers": (0, 1, 2)}, {"num_workers": 0}, {"num_workers": 2}, trial,
        _loader_grade)


def _mp_evidence(r: Reading, s: Setup) -> dict[str, str]:
    steps = s.cfg().steps

    def loss(metric: str, variant: str | None = None) -> str:
        v = r.get(metric, variant=variant)
        return f"{v:.4f}" if v is not None else "inf/nan (not a number)"
    return {"recipe": "fp16 autocast, no GradScaler; fp32 measured alongside as the reference",
            "fp16 loss at step 1 (before any update)": loss("loss_first"),
            f"fp16 loss after {steps} steps": loss("loss"),
            f"fp32 loss at step 1 / after {steps} steps": f"{loss('loss_first', 'fp32')} / {loss('loss', 'fp32')}",
            f"fp16 steps with an inf/nan loss (of {steps})": show(r.get("nonfinite_losses")),
            "fp16 gradient norm, last step": loss("grad_norm"),
            "fp16 gradient elements exactly 0, last step": pct(r.get("zero_grad_pct")),
            "fp32 gradient elements exactly 0 (embedding rows of unseen tokens)": pct(r.reference("zero_grad_pct")),
            "check against fp32": r.status + (f": {r.message}" if r.message else "")}


MP_KNOBS = {"precision": ("fp16", "bf16", "fp32"), "loss_scaling": (False, True)}


def _mp_trial(run: Run) -> Callable[[dict[str, Any]], Trial]:
    def trial(f: dict[str, Any]) -> Trial:
        scaled = f["loss_scaling"] and f["precision"] == "fp16"  # a GradScaler only serves fp16
        return _variant_trial(run, f["precision"], {"loss_scaling": scaled})
    return trial


def _overflow_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    b, a = before.get("nonfinite_losses"), after.get("nonfinite_losses")
    skipped = after.get("skipped_steps")
    extra = f" (GradScaler skipped {skipped:g})" if skipped else ""
    return FixGrade(a == 0, f"steps with an inf/nan loss: {b:g} before, {a:g} after{extra}",
                    f"no inf or nan loss in any of the {s.cfg().steps} steps (exactly 0)")


def _lab_fp16_overflow() -> Lab:
    run = LAB_RUNS["overflow"]
    return Lab(
        "lab_fp16_overflow", 3,
        Trial(run, "fp16"), DIAGNOSES[2], _mp_evidence, MP_KNOBS,
        {"precision": "fp16", "loss_scaling": False}, {"precision": "bf16", "loss_scaling": False},
        _mp_trial(run), _overflow_grade, words={"fp16_max": FP16_MAX})


def _underflow_grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
    ref, b, a = after.reference("zero_grad_pct"), before.get("zero_grad_pct"), after.get("zero_grad_pct")
    ok = a is not None and after.get("nonfinite_losses") == 0 and a <= ref + ZERO_GRAD_MARGIN
    return FixGrade(ok, f"gradient elements exactly 0: {pct(b)} before, {pct(a)} after "
                        f"(fp32: {pct(ref)})",
                    f"at most {ZERO_GRAD_MARGIN:g} points above fp32's zero share, no inf/nan loss")


def _lab_fp16_underflow() -> Lab:
    run = LAB_RUNS["underflow"]
    return Lab(
        "lab_fp16_underflow", 3,
        Trial(run, "fp16"), DIAGNOSES[3], _mp_evidence, MP_KNOBS,
        {"precision": "fp16", "loss_scaling": False}, {"precision": "fp16", "loss_scaling": True},
        _mp_trial(run), _underflow_grade)


def _lab_padding() -> Lab:
    run = LAB_RUNS["serve"]

    def grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
        b, a = before.get("padding_waste_pct"), after.get("padding_waste_pct")
        return FixGrade(a is not None and a <= PADDING_LIMIT_PCT,
                        f"padding_waste_pct {pct(b)} before, {pct(a)} after",
                        f"at most {PADDING_LIMIT_PCT:g}% of the computed token positions are padding")
    return Lab(
        "lab_padding", 2,
        Trial(run, "static"), DIAGNOSES[4],
        lambda r, s: {"scheduler": "static: a batch starts together and ends with its longest request",
                      "positions computed for no request (padding_waste_pct)": pct(r.get("padding_waste_pct")),
                      "decode steps": show(r.get("decode_steps")),
                      "useful tokens/s": show(r.get("useful_tokens_per_s")),
                      "useful tokens/s one request at a time": show(r.get("useful_tokens_per_s", variant="sequential"))},
        {"scheduler": ("static", "dynamic", "continuous")}, {"scheduler": "static"},
        {"scheduler": "continuous"}, lambda f: _variant_trial(run, f["scheduler"]), grade)


def _pipe_evidence(r: Reading, s: Setup) -> dict[str, str]:
    c = s.cfg("gpipe", stage_delay_ms=SLOW_STAGE_MS)
    return {"schedule": f"GPipe, {c.nproc} stages (CPU ranks, gloo), {c.micro_batches} micro-batches",
            "stage 0 busy per step": show(r.get("stage_busy_ms", rank=0), "ms"),
            "stage 1 busy per step": show(r.get("stage_busy_ms", rank=1), "ms"),
            "stage 1 idle share (bubble)": pct(100 * r.get("bubble_fraction", rank=1)),
            "ideal bubble (p-1)/(m+p-1)": pct(100 * r.get("ideal_bubble_fraction")),
            "step time": show(r.get("step_ms"), "ms")}


def _busy_ratio(r: Reading) -> float:
    busy = [r.get("stage_busy_ms", rank=i) for i in (0, 1)]
    return max(busy) / min(busy)


def _lab_pipeline() -> Lab:
    run = RUNS["pipe"]

    def grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
        b, a = _busy_ratio(before), _busy_ratio(after)
        return FixGrade(a <= BUSY_RATIO_LIMIT, f"slowest stage's busy time / fastest's: {b:.2f} "
                        f"before, {a:.2f} after", f"at most {BUSY_RATIO_LIMIT:g} (whole blocks and "
                        "the head cannot be split evenly over 2 stages: 1 is out of reach)")
    return Lab(
        "lab_pipeline", 3,
        Trial(run, "gpipe", {"stage_delay_ms": SLOW_STAGE_MS}), DIAGNOSES[5], _pipe_evidence,
        {"rebalance": (False, True)}, {"rebalance": False}, {"rebalance": True},
        lambda f: Trial(run, "gpipe", {"stage_delay_ms": 0.0 if f["rebalance"] else SLOW_STAGE_MS}),
        grade, words={"slow_stage_ms": SLOW_STAGE_MS})


def _shape_dims(s: Setup, alignment: str) -> tuple[int, int, int]:
    from labkit.techniques import matmul

    return matmul.dims(s.cfg("fp16", alignment=alignment))


def _lab_shape() -> Lab:
    run = LAB_RUNS["shape"]

    def evidence(r: Reading, s: Setup) -> dict[str, str]:
        m, n, k = _shape_dims(s, "off_by_one")
        out = {"GEMM": f"m = n = k = {m}, fp16 inputs",
               f"{m} in bytes (fp16)": f"{2 * m} = 16 x {2 * m / 16:g}",
               "fp16 TFLOP/s measured at this shape": show(r.get("tflops"))}
        if not s.device.startswith("cuda"):
            out["what this device cannot show"] = ("a CPU has no tensor cores: its fp16 rate says "
                                                   "nothing about them; the rule below is NVIDIA's")
        return out

    def grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
        b, a = _shape_dims(s, "off_by_one"), _shape_dims(s, after.trial.point["alignment"])
        ratio = (after.get("tflops") or 0) / (before.get("tflops") or 1)
        return FixGrade(tensor_core_friendly(*a), f"dims {b} before, {a} after; measured fp16 "
                        f"TFLOP/s ratio {ratio:.2f} (evidence only: not graded)",
                        "every dimension a multiple of 16 bytes (8 fp16 elements); on A100 and newer "
                        "128 bytes (64) is better still (NVIDIA's matmul performance guide)")
    return Lab(
        "lab_shape", 2,
        Trial(run, "fp16", {"alignment": "off_by_one"}), DIAGNOSES[6], evidence,
        {"alignment": ("off_by_one", "mult8", "aligned")}, {"alignment": "off_by_one"},
        {"alignment": "aligned"}, lambda f: Trial(run, "fp16", {"alignment": f["alignment"]}), grade)


def _lab_healthy() -> Lab:
    run = LAB_RUNS["ckpt"]

    def grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
        g = _flops_grade(before, after, s)
        return g._replace(margin=g.margin + "; the healthy setup already meets it: leave it as it is")
    return Lab(
        "lab_healthy", 2,
        Trial(run, "none"), HEALTHY, _ckpt_evidence, CKPT_KNOBS, {"checkpointing": "none"},
        {"checkpointing": "none"}, lambda f: _variant_trial(run, f["checkpointing"]), grade)


def _lab_recompute() -> Lab:
    run = LAB_RUNS["ckpt"]
    return Lab(
        "lab_recompute", 3,
        Trial(run, "full"), DIAGNOSES[7], _ckpt_evidence, CKPT_KNOBS, {"checkpointing": "full"},
        {"checkpointing": "none"}, lambda f: _variant_trial(run, f["checkpointing"]), _flops_grade)


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
                "planner: each token runs the whole prefix": show(flops(s, False) / 1e6, "MFLOP"),
                "planner: prefill once, then one position a token": show(flops(s, True) / 1e6, "MFLOP"),
                "planner: the first token's forward / the last's": f"{one / 1e6:.1f} / {last / 1e6:.1f} MFLOP"}

    def grade(before: Reading, after: Reading, s: Setup) -> FixGrade:
        n = s.cfg().new_tokens
        b, a, want = before.get("flops") / n, after.get("flops") / n, flops(s, True) / n
        return FixGrade(a <= (1 + KV_MARGIN) * want, f"FLOPs per generated token {b / 1e6:.2f} M "
                        f"before, {a / 1e6:.2f} M after (planner with a cache: {want / 1e6:.2f} M)",
                        f"at most {1 + KV_MARGIN:.2f}x the planner's FLOPs per token with a cache")
    return Lab(
        "lab_kv_cache", 2,
        Trial(run, "none"), DIAGNOSES[8], evidence, {"kv_cache": ("none", "dynamic")},
        {"kv_cache": "none"}, {"kv_cache": "dynamic"}, lambda f: _variant_trial(run, f["kv_cache"]),
        grade)


def build_labs() -> list[Lab]:
    return [_lab_oom(), _lab_data(), _lab_padding(), _lab_shape(), _lab_kv_cache(), _lab_healthy(),
            _lab_fp16_overflow(), _lab_fp16_underflow(), _lab_pipeline(), _lab_recompute()]


LABS: dict[str, Lab] = {lab.key: lab for lab in sorted(build_labs(), key=lambda lab: lab.level)}


# --- playing a lab: symptoms, evidence, diagnosis, fix -------------------------------------------

@dataclass
class Evidence:
    lab: Lab
    figures: dict[str, str]  # label -> measured figure (and the planner's beside it)
    source: str  # where the measurement came from
    reading: Reading
    device: str  # where it was measured

    def report(self) -> str:
        lines = [f"Evidence ({self.source}):"] + [f"- {k}: {v}" for k, v in self.figures.items()]
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
        return text + (f"\nWhy: {self.lab.why}" if self.correct else "")


@dataclass
class FixOutcome:
    lab: Lab
    fix: dict[str, Any]
    grade: FixGrade
    source: str  # the re-measurement
    solution: bool = False

    @property
    def passed(self) -> bool:
        return self.grade.passed

    def report(self) -> str:
        head = "Solution mode: the reference fix. " if self.solution else ""
        verdict = "fixed" if self.passed else "not fixed"
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.fix.items())
        return (f"{head}Fix {knobs}: graded {verdict}.\nMeasured again: {self.source}.\n"
                f"Figure: {self.grade.figure}.\nRule: {self.grade.margin}.")


def get_lab(key: str) -> Lab:
    if key not in LABS:
        raise ConfigError(f"unknown lab {key!r}; valid: {', '.join(LABS)}")
    return LABS[key]


def knob_words(lab: Lab) -> str:
    return "; ".join(f"{k}: {', '.join(repr(v) for v in vals)}" for k, vals in lab.knobs.items())


def symptoms(key: str) -> str:
    """What is reported, the choices and the knobs (nothing measured: safe to show first)."""
    lab = get_lab(key)
    return (f"{lab.title} (level {lab.level}).\n\nReported: {lab.symptoms}\n\nDiagnoses: "
            + "; ".join(DIAGNOSES) + f".\nFix knobs: {knob_words(lab)}.")


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
    """Grade a diagnosis against the lab's cause, with the feedback for that choice; a learner's
    attempt (not solution mode) is stored with the evidence it was made on (`evidence`, when the
    caller has it already from `investigate`)."""
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


def parse_fix(key: str, fix: dict[str, Any] | None) -> dict[str, Any]:
    """Every knob's setting: the broken one unless `fix` sets it; a ConfigError (one line, the
    valid knobs and values) for an unknown knob or value."""
    lab = get_lab(key)
    if not isinstance(fix, dict):
        raise ConfigError(f"{key}: a fix is a dict of knobs; valid knobs: {knob_words(lab)}")
    settings = dict(lab.broken)
    for name, value in fix.items():
        if name not in lab.knobs:
            raise ConfigError(f"{key}: unknown knob {name!r}; valid knobs: {knob_words(lab)}")
        match = [v for v in lab.knobs[name] if v == value or str(v).lower() == str(value).strip().lower()]
        if not match:
            valid = ", ".join(repr(v) for v in lab.knobs[name])
            raise ConfigError(f"{key}: {name}={value!r} is not valid; valid: {valid}")
        settings[name] = match[0]
    return settings


def reference_fix(key: str) -> dict[str, Any]:
    """The answer key's fix (the healthy lab's: leave the setup as it is)."""
    return dict(get_lab(key).solution)


def apply_fix(key: str, fix: dict[str, Any] | None = None, *, solution: bool = False,
              device: str = "auto", runs_dir: str | None = None, participant: str | None = None,
              team: str | None = None) -> FixOutcome:
    """Measure the setup with `fix` applied (a stored complete run of the same settings is reused)
    and grade it by the mechanism figure against the broken setup's, with the lab's margin."""
    lab = get_lab(key)
    settings = parse_fix(key, reference_fix(key) if solution else fix)
    before, _ = _read(lab.trial, device, runs_dir)
    after, setup = _read(lab.make_trial(settings), device, runs_dir)
    with setup.formulas():
        grade = lab.grade_fix(before, after, setup)
    outcome = FixOutcome(lab, settings, grade, after.rows.source, solution)
    if not solution:
        record_attempt(kind="fix", exercise=key, topic=TOPIC, level=lab.level, prediction=settings,
                       reference=lab.solution, correct=grade.passed,
                       measured={"figure": grade.figure, "rule": grade.margin}, device=setup.device,
                       run_id=after.rows.run_id, folder=runs_dir, participant=participant, team=team)
    return outcome


def widget(key: str, *, device: str = "auto", runs_dir: str | None = None):
    """A dropdown of diagnoses with a Diagnose button, a control per fix knob with an Apply
    button, and the graded reports below them."""
    import ipywidgets as w

    lab = get_lab(key)
    choice = w.Dropdown(options=DIAGNOSES, description="Diagnosis", layout=w.Layout(width="60%"))
    knobs = {k: w.Dropdown(options=[(repr(v), v) for v in vals], value=lab.broken[k], description=k)
             for k, vals in lab.knobs.items()}
    ask, apply_, out = w.Button(description="Diagnose", button_style="primary"), w.Button(
        description="Apply fix", button_style="warning"), w.Output()

    def run(fn):
        out.clear_output()
        with out:
            try:
                print(fn().report())
            except ConfigError as e:
                print(e)

    ask.on_click(lambda _: run(lambda: diagnose(key, choice.value, device=device, runs_dir=runs_dir)))
    apply_.on_click(lambda _: run(lambda: apply_fix(key, {k: b.value for k, b in knobs.items()},
                                                    device=device, runs_dir=runs_dir)))
    return w.VBox([w.HBox([choice, ask]), w.HBox([*knobs.values(), apply_]), out])
