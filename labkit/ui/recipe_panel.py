"""The recipe panel: pick a model (a preset, or a Hugging Face folder holding config.json), the
techniques of a `recipe` run, the number of GPUs and their memory; see the planner's per-GPU plan
of that recipe, whether it fits, why it cannot run when `refusal()` refuses it, and the cheapest
recipe that fits. Run measures the recipe at the size this machine holds (CPU: the tiny preset on
two gloo ranks; a GPU: the chosen sizes on the GPUs present), every row beside its prediction.

`RecipePanel` is the logic, with no widget in it (tests set values and press Run in code);
`recipe_panel()` is its ipywidgets view, imported only when called. The knobs are the `recipe`
experiment's own config fields, resolved by the same `resolve()`, and the plan is the
experiment's own prediction (`techniques.recipe.planned`, i.e. `blocks.recipe.planner_kwargs`
into `planner.training_memory`), judged on `cuda` (torch's multi-tensor AdamW, fp32 norm
statistics) since the GPUs chosen are not this machine's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import pandas as pd

from labkit import hardware, planner
from labkit.blocks import hf
from labkit.blocks import recipe as recipes
from labkit.config import PRESETS, ConfigError, resolve
from labkit.harness.ranks import RunFailed
from labkit.results import format_value
from labkit.techniques import recipe as experiment
from labkit.ui.background import BackgroundRun

GIB = 2**30
# The recipe experiment's knobs the panel shows, and the planner-side inputs around them.
TECHNIQUES = ("precision", "checkpointing", "checkpoint_every", "micro_batches", "zero_stage",
              "tensor_parallel", "context_parallel", "cp_mode", "expert_parallel", "pipeline_parallel",
              "pp_schedule", "virtual_stages", "offload", "compile",
              "finetune", "loss", "loss_chunk", "optimizer", "packing")
# The published model of notebook 08's worked example on its 4 x 24 GB: batch 8 per GPU.
DEFAULTS: dict[str, Any] = {"model": "llama-2-7b", "hf_model": "", "batch_size": 8, "seq_len": 4096,
                            "precision": "fp32", "checkpointing": "none", "checkpoint_every": 2,
                            "micro_batches": 1, "zero_stage": 0, "tensor_parallel": 1,
                            "context_parallel": 1, "cp_mode": "ring", "expert_parallel": 1,
                            "pipeline_parallel": 1, "pp_schedule": "1f1b", "virtual_stages": 2,
                            "offload": "none", "compile": False, "finetune": "none",
                            "loss": "plain", "loss_chunk": 1024, "optimizer": "adamw", "packing": False,
                            "num_gpus": 4, "gpu_mem_gib": 24.0, "scaled_budget": True}
# Run on CPU ranks: the tiny preset at sizes two cores finish in seconds (one gloo launch,
# 6-12 s of it starting the ranks). Each micro-batch holds RUN_MICRO_BATCH sequences.
CPU_RUN = {"preset": "tiny", "nproc": 2, "seq_len": 32, "num_layers": 2, "timed_steps": 2,
           "warmup": 0, "min_run_time_s": 0.0, "timeout_s": 120}
RUN_MICRO_BATCH = 2
# The rows a run shows, in this order (every rank's).
SHOWN = ("peak_mem_bytes", "param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
         "tokens_per_s", "step_ms", "loss_delta")
TERMS = ("param", "gathered", "grad", "optimizer", "activation", "weight_copy", "overhead")
LABELS = {"param": "parameters", "gathered": "gathered parameters (FSDP2)", "grad": "gradients",
          "optimizer": "optimizer states", "activation": "activations",
          "weight_copy": "autocast weight casts", "overhead": "temporaries"}
# After the chosen precision, the planner's own order (`planner.RECOMMENDED_PRECISIONS`) of those
# the recipe experiment runs: bf16 (autocast, or FSDP2's policy under ZeRO-2/3: fp32 weights and
# AdamW, 16-bit matmuls), then bf16 weights with fp32 master copies (no cached casts, 16-bit
# gradients).
FALLBACK_PRECISIONS = tuple(p for p in planner.RECOMMENDED_PRECISIONS if p in experiment.PRECISIONS)


def gib(n: float) -> str:
    return format_value("peak_mem_bytes", n)


@dataclasses.dataclass(frozen=True)
class Recommended:
    """The recipe the panel recommends: `changes` are knob values (the recipe experiment's, or
    the planner's own words when `source` is planner.recommend), `plan` the per-GPU plan."""
    changes: dict
    total_bytes: int
    fits: bool
    source: str  # "recipe search" or "planner.recommend"
    reason: str


class RecipePanel(BackgroundRun):
    """The panel's state for `values` (DEFAULTS, then the caller's): `update()` (every `set`)
    recomputes the plan, `verdict`, `refusal`, `error` and `recommended`; `run()` measures the
    recipe through `runner` (run_experiment's signature) and keeps `frame`, `run_error` and
    `run_line`. `listeners` are called after each update and each run (the view redraws)."""

    def __init__(self, *, runner: Callable[..., Any] | None = None, runs_dir: str | None = None,
                 **values: Any):
        unknown = sorted(set(values) - set(DEFAULTS))
        if unknown:
            raise ConfigError(f"unknown panel input {unknown[0]!r}; valid: {', '.join(DEFAULTS)}")
        self.values = {**DEFAULTS, **values}
        self.runner, self.runs_dir = runner, runs_dir
        self.listeners: list[Callable[[], None]] = []
        self.frame: pd.DataFrame | None = None
        self.run_error: str | None = None
        self.run_line = "press Run to measure this recipe at the size this machine holds"
        self.busy = False  # True from Run until its rows (or error) are shown
        self.update()

    def set(self, **changes: Any) -> None:
        self.values.update(changes)
        self.update()

    # --- the plan ---------------------------------------------------------------------------
    def update(self) -> None:
        self.cfg = self.plan = self.recommended = None
        self.error = self.refusal = self.not_planned = None
        self.verdict, self.fits = "", None
        try:
            self.cfg = gpu_config(self.values)
            self.refusal = experiment.refused(self.cfg)
            if self.refusal is None:
                experiment.validate(self.cfg)
                self._plan()
            self.recommended = recommend(self.cfg, self.memory_bytes)
        except ConfigError as e:  # bad input: one line in the panel, as the CLI would say it
            self.error = str(e).splitlines()[0]
        self._notify()

    @property
    def memory_bytes(self) -> int:
        mem = self.values["gpu_mem_gib"]
        if not isinstance(mem, (int, float)) or isinstance(mem, bool) or not mem > 0:
            raise ConfigError(f"gpu_mem_gib={mem!r} must be a positive number of GiB")
        return int(mem * GIB)

    def _plan(self) -> None:
        self.plan = experiment.planned(self.cfg)
        if self.plan is None:
            self.not_planned = recipes.planner_kwargs(self.cfg, experiment.recipe_of(self.cfg),
                                                      self.cfg.nproc)[1]
            return
        mem = self.memory_bytes
        room = mem - self.plan.total_bytes
        self.fits = room >= 0
        words = f"fits, {gib(room)} to spare" if self.fits else f"does NOT fit: {gib(-room)} over"
        self.verdict = (f"{gib(self.plan.total_bytes)} per GPU (peak at the {self.plan.peak_phase}) "
                        f"of {gib(mem)}: {words} (the CUDA context and allocator fragmentation "
                        "are not counted)")

    def header(self) -> str:
        c = self.cfg
        if c is None:
            return ""
        name = c.model.source or self.values["model"]
        return (f"{name}: {planner.num_params(c.model) / 1e9:.3g} B parameters | {c.nproc} GPU(s) "
                f"of {self.values['gpu_mem_gib']:g} GiB | {c.batch_size} x {c.seq_len} tokens per "
                f"GPU in {c.micro_batches} micro-batch(es) | recipe: "
                + (", ".join(experiment.recipe_of(c).techniques()) or "plain fp32"))

    def lines(self) -> list[str]:
        """What the panel says in words: the header, then the error, the refusal, or the verdict,
        then the recommendation."""
        if self.error:
            return [f"error: {self.error}"]
        out = [self.header()]
        if self.refusal:
            out.append(f"refused: {self.refusal}")
        elif self.not_planned:
            out.append(f"not planned: {self.not_planned}")
        else:
            out.append(self.verdict)
        if self.recommended is not None:
            out.append(recommendation_line(self.recommended))
        return out

    def plan_table(self) -> pd.DataFrame:
        """One row per term of the plan: bytes, whether the peak holds it, its formula."""
        if self.plan is None:
            return pd.DataFrame(columns=["term", "bytes", "at peak", "formula"])
        return terms_frame(self.plan)

    # --- the run ----------------------------------------------------------------------------
    def run_overrides(self) -> tuple[str, dict[str, Any]]:
        """(preset, overrides) of the measured run: the chosen techniques at the size this
        machine holds, and the scaled budget when asked for."""
        if self.error:
            raise ConfigError(self.error)
        return run_settings(self.cfg, self.values, self.plan, self.memory_bytes)

    def run(self) -> None:
        """The recipe experiment at this machine's size; its rows, or a one-line error (never a
        traceback): a crashed rank keeps the rows measured before it."""
        from labkit.harness.experiment import run_experiment

        runner = self.runner or run_experiment
        self.frame, self.run_error, self.busy = None, None, True
        try:
            preset, overrides = self.run_overrides()
            self.run_line = "running: " + describe_run(preset, overrides)
            self._notify()
            result = runner("recipe", preset=preset, overrides=overrides, runs_dir=self.runs_dir,
                            progress=False)
            self.frame = result.frame()
            self.run_line = "measured: " + describe_run(preset, overrides) + "; " + run_summary(self.frame)
        except RunFailed as e:
            self.frame, self.run_error = e.result.frame(), str(e).splitlines()[0]
        except ConfigError as e:
            self.run_error = str(e).splitlines()[0]
        except Exception as e:  # shown in the panel, not lost in the log console
            self.run_error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if self.run_error:
            self.run_line = f"error: {self.run_error}"
        self.busy = False
        self._notify()

    def start(self) -> None:
        """What Run does: `run()` in a background thread (one at a time)."""
        if self.running or self.busy:
            return
        self.busy = True
        self.run_in_background("labkit-recipe-panel")

    def rows_table(self) -> pd.DataFrame:
        return rows_table(self.frame) if self.frame is not None else pd.DataFrame()

    def _notify(self) -> None:
        for listener in self.listeners:
            listener()


# --- the pieces, as functions of plain values -----------------------------------------------------

def model_override(values: dict) -> tuple[str, dict]:
    """(preset, {"model": shape} or {}): the Hugging Face folder's shape when one is given (the
    tiny preset then only names default sizes, which the panel's own override), else the preset."""
    folder = str(values.get("hf_model") or "").strip()
    if folder:
        return "tiny", {"model": hf.model_config(folder)}
    return values["model"], {}


def gpu_config(values: dict) -> experiment.Config:
    """The recipe experiment's config (variant composed) for these panel values, judged on
    `cuda` over `num_gpus` ranks: resolved on the CPU (a GPU need not be here), then moved."""
    preset, model = model_override(values)
    if preset not in PRESETS:
        raise ConfigError(f"unknown model {preset!r}; valid: {', '.join(PRESETS)}")
    knobs = {k: values[k] for k in ("batch_size", "seq_len") + TECHNIQUES}
    cfg = resolve(experiment.Config, preset, {**knobs, **model, "variant": "composed",
                                              "nproc": values["num_gpus"], "device": "cpu"},
                  experiment="recipe")
    return dataclasses.replace(cfg, device="cuda")


def terms_frame(plan: planner.MemoryPlan) -> pd.DataFrame:
    rows = [{"term": LABELS[t], "bytes": getattr(plan, f"{t}_bytes"), "at peak": t in plan.held_at_peak,
             "formula": plan.formulas.get(t, "")} for t in TERMS if getattr(plan, f"{t}_bytes")]
    rows.append({"term": "total (predicted peak)", "bytes": plan.total_bytes, "at peak": True,
                 "formula": f"peak at the {plan.peak_phase}"})
    return pd.DataFrame(rows)


def recommend(cfg: experiment.Config, memory_bytes: int) -> Recommended:
    """The cheapest recipe the experiment runs that fits `memory_bytes` per GPU, at the same
    batch per GPU, sequence and GPUs (offload and compile off: the planner models neither):
    the chosen precision first, then FALLBACK_PRECISIONS; in each, the (checkpointing, ZeRO stage)
    pairs in planner.recommend's order (`planner.SEARCH`), each at the fewest micro-batches that
    fit (accumulation adds no FLOPs). When none fits, planner.recommend's answer, which also
    tries bf16_pure (16-bit AdamW states), a training the recipe experiment does not run."""
    precisions = dict.fromkeys((cfg.precision,) + FALLBACK_PRECISIONS)
    splits = [k for k in range(1, cfg.batch_size + 1) if cfg.batch_size % k == 0]
    tried = 0
    for precision in precisions:
        for ckpt, zero in planner.SEARCH:
            for k in splits:
                candidate = dataclasses.replace(cfg, precision=precision, checkpointing=ckpt,
                                                zero_stage=zero, micro_batches=k, offload="none",
                                                compile=False)
                if experiment.refused(candidate):
                    break  # refused at every split (no rule depends on the micro-batches)
                plan = experiment.planned(candidate)
                if plan is None:  # the planner has no case for it (a fine-tuning precision)
                    break
                tried += 1
                if plan.total_bytes <= memory_bytes:
                    changes = {"precision": precision, "checkpointing": ckpt, "zero_stage": zero,
                               "micro_batches": k}
                    return Recommended(changes, plan.total_bytes, True, "recipe search",
                                       f"cheapest first, {tried} tried; {_changed(cfg, changes)}")
    return planner_recommendation(cfg, memory_bytes, tried)


def _changed(cfg: experiment.Config, changes: dict) -> str:
    """The knobs the recommendation changes from `cfg`'s, in words."""
    moved = [f"{k} {getattr(cfg, k)} -> {v}" for k, v in changes.items() if getattr(cfg, k) != v]
    moved += [f"{k} {getattr(cfg, k)} -> off" for k in ("offload", "compile")
              if getattr(cfg, k) not in ("none", False)]
    return "changes: " + ", ".join(moved) if moved else "your recipe fits as it is"


def planner_recommendation(cfg: experiment.Config, memory_bytes: int, tried: int) -> Recommended:
    rec = planner.recommend(cfg.model, effective_batch=cfg.batch_size * cfg.nproc,
                            seq_len=cfg.seq_len, gpus=cfg.nproc, gpu_mem_bytes=memory_bytes,
                            device="cuda")
    changes = {"precision": rec.precision, "checkpointing": rec.checkpointing,
               "zero_stage": rec.zero_stage, "micro_batch": rec.micro_batch,
               "accumulation_steps": rec.accumulation_steps}
    return Recommended(changes, rec.total_bytes, rec.fits, "planner.recommend",
                       f"none of the {tried} recipes the experiment runs fits; {rec.reason} "
                       "(the planner's bf16_pure keeps 16-bit AdamW states, which the experiment "
                       "does not run; its ZeRO-2 keeps whole weights, the recipe's zero2 is "
                       "FSDP2's)")


def recommendation_line(rec: Recommended) -> str:
    knobs = ", ".join(f"{k}={v}" for k, v in rec.changes.items())
    head = "recommended" if rec.fits else "nothing fits"
    return f"{head} ({rec.source}): {knobs}: {gib(rec.total_bytes)} per GPU; {rec.reason}"


def run_settings(cfg: experiment.Config, values: dict, plan: planner.MemoryPlan | None,
                 memory_bytes: int) -> tuple[str, dict[str, Any]]:
    """(preset, overrides) for the measured run of `cfg`'s techniques. On a GPU: the chosen model
    and sizes on min(num_gpus, GPUs present) ranks; on the CPU: CPU_RUN (2 ranks, or 1 for a
    one-GPU recipe) with RUN_MICRO_BATCH sequences per micro-batch. `scaled_budget`: the
    composed variant's budget is the run's predicted peak x (GPU memory / the chosen recipe's
    predicted peak), so the run fits (or is an oom row) as the chosen recipe would its GPUs."""
    knobs = {k: getattr(cfg, k) for k in TECHNIQUES}
    gpus = len(hardware.gpu_info()) if "cuda" in hardware.available_devices() else 0
    if gpus:
        preset, model = model_override(values)
        overrides = {**knobs, **model, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len,
                     "nproc": min(cfg.nproc, gpus), "device": "cuda"}
    else:
        preset = CPU_RUN["preset"]
        ranks = CPU_RUN["nproc"] if cfg.nproc > 1 else 1
        overrides = {**knobs, **{k: v for k, v in CPU_RUN.items() if k != "preset"},
                     "nproc": ranks, "device": "cpu",
                     "batch_size": RUN_MICRO_BATCH * cfg.micro_batches}
    if values.get("scaled_budget") and plan is not None:
        run_cfg = resolve(experiment.Config, preset, {**overrides, "variant": "composed"},
                          experiment="recipe")
        run_plan = experiment.planned(run_cfg)
        overrides["budget_gib"] = run_plan.total_bytes * memory_bytes / plan.total_bytes / GIB
    return preset, overrides


def describe_run(preset: str, overrides: dict) -> str:
    budget = overrides.get("budget_gib")
    words = (f"recipe at preset {preset} on {overrides['nproc']} {overrides['device']} rank(s), "
             f"batch {overrides['batch_size']} x {overrides.get('seq_len')} tokens per rank")
    return words + (f", composed's budget {gib(budget * GIB)} (scaled)" if budget else "")


def run_summary(frame: pd.DataFrame) -> str:
    """Composed's peak on each rank against its prediction, or why it did not run."""
    composed = frame[frame["variant"] == "composed"]
    bad = composed[composed["status"] != "ok"].drop_duplicates("status")
    if not bad.empty:
        return "; ".join(f"composed {r.status}: {r.message}" for r in bad.itertuples())
    peaks = composed[composed["metric"] == "peak_mem_bytes"].sort_values("rank")
    return "; ".join(f"rank {int(r.rank)} peak {gib(r.value)} measured, "
                     + (f"{gib(r.predicted)} predicted" if pd.notna(r.predicted) else "not predicted")
                     for r in peaks.itertuples())


def rows_table(frame: pd.DataFrame) -> pd.DataFrame:
    """Measured beside predicted for SHOWN's metrics, every variant and rank; a variant that did
    not run (oom, skipped, error) is one row with its status and message."""
    ok = frame[(frame["status"] == "ok") & frame["metric"].isin(SHOWN)].copy()
    ok["order"] = ok["metric"].map(SHOWN.index)
    ok = ok.sort_values(["variant", "order", "rank"], kind="stable")
    bad = frame[frame["status"] != "ok"].drop_duplicates(["variant", "rank", "status"])
    table = pd.concat([ok, bad])[["variant", "rank", "metric", "status", "value", "predicted",
                                   "unit", "message"]].rename(columns={"value": "measured"})
    ratio = table["measured"] / table["predicted"].where(table["predicted"] != 0)
    return table.assign(measured_over_predicted=ratio.round(3)).reset_index(drop=True)


# --- the view -------------------------------------------------------------------------------------

def plan_figure(panel: RecipePanel) -> Any:
    """Stacked bars of the terms held at the peak (GiB): this recipe, and the recommended one
    when it is a recipe; the GPU memory as a dashed line."""
    import plotly.graph_objects as go

    from labkit.views import plots as viz

    plans = {"your recipe": panel.plan} if panel.plan is not None else {}
    rec = panel.recommended
    if rec is not None and rec.source == "recipe search":
        cfg = dataclasses.replace(panel.cfg, offload="none", compile=False, **rec.changes)
        plans["recommended"] = experiment.planned(cfg)
    fig = go.Figure()
    for term in TERMS:
        fig.add_bar(x=list(plans), name=LABELS[term],
                    y=[getattr(p, f"{term}_bytes") / GIB if term in p.held_at_peak else 0.0
                       for p in plans.values()])
    fig.add_scatter(x=list(plans), y=[panel.values["gpu_mem_gib"]] * len(plans), name="GPU memory",
                    mode="lines+markers", line={"dash": "dash", "color": "black"})
    fig.update_layout(barmode="stack", title="per GPU, predicted peak", yaxis_title="GiB per GPU")
    return viz.legend_above(fig, 420)


def plan_items(panel: RecipePanel) -> list:
    """The plan area: the verdict's lines, then the figure and the terms' table."""
    text = "\n".join(panel.lines())
    if panel.plan is None:
        return [text]
    table = panel.plan_table()
    table["bytes"] = table["bytes"].map(gib)
    return [text, plan_figure(panel), table]


def run_items(panel: RecipePanel) -> list:
    from labkit.views import plots as viz

    out = [panel.run_line]
    if panel.frame is not None and not panel.frame.empty:
        out.append(viz.readable(panel.rows_table()))
    return out


def recipe_panel(**values: Any) -> Any:
    """The panel's widget, ready to display: the inputs (the recipe experiment's own knobs, with
    their choices and ranges), the plan redrawn on every change, Run and its rows."""
    import ipywidgets as W

    panel = RecipePanel(**values)
    controls = build_controls(W, panel.values)
    plan_out, run_out = W.Output(), W.Output()
    run_button = W.Button(description="Run", button_style="primary", icon="play")

    from labkit.views import plots as viz

    def redraw():
        viz.show_items(plan_out, plan_items(panel))
        viz.show_items(run_out, run_items(panel))
        run_button.disabled = panel.busy

    def changed(_=None):
        panel.set(**{k: w.value for k, w in controls.items()})

    panel.listeners.append(redraw)
    for widget in controls.values():
        widget.observe(changed, names="value")
    run_button.on_click(lambda _: (panel.start(), redraw()))
    changed()
    grid = W.GridBox(list(controls.values()), layout=W.Layout(grid_template_columns="repeat(3, 1fr)"))
    box = W.VBox([grid, plan_out, run_button, run_out])
    box.panel, box.controls, box.run_button = panel, controls, run_button  # for tests and users
    return box


def build_controls(W, values: dict) -> dict:
    """One widget per panel input: the techniques from the recipe experiment's config fields
    (their choices and ranges), the model, the folder, the sizes and the GPUs around them."""
    import typing

    from labkit.ui.widgets import field_widget

    label = {"style": {"description_width": "initial"}}
    hints = typing.get_type_hints(experiment.Config)
    fields = {f.name: f for f in dataclasses.fields(experiment.Config)}
    out = {"model": W.Dropdown(options=list(PRESETS), description="model", **label),
           "hf_model": W.Text(placeholder="a Hugging Face folder with config.json",
                              description="hf_model", **label)}
    for name in ("batch_size", "seq_len") + TECHNIQUES:
        out[name] = field_widget(fields[name], hints[name])
    out["zero_stage"] = W.Dropdown(options=[0, 1, 2, 3], description="zero_stage", **label)
    out["num_gpus"] = W.BoundedIntText(min=1, max=4096, description="num_gpus", **label)
    out["gpu_mem_gib"] = W.BoundedFloatText(min=0.1, max=1e5, description="gpu_mem_gib", **label)
    out["scaled_budget"] = W.Checkbox(description="scaled_budget", indent=False,
                                      tooltip="the run's budget: its predicted peak x GPU memory / "
                                              "your recipe's predicted peak")
    for name, widget in out.items():
        widget.value = values[name]
    return out
