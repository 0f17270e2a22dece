"""Two recipes' memory over one step: each recipe's step recorded by category
(`labkit.measure.timeline`), beside the planner's predicted peak for that recipe.

    frame = compare_timelines(cfg, [Recipe(), Recipe(checkpointing="full")])
    labkit.views.memory.timeline_figure(frame)

One process: recipes with data or tensor parallelism need ranks (compose refuses them here).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import pandas as pd

from labkit import planner
from labkit.blocks.recipe import Recipe, compose, planned_memory
from labkit.blocks.training import Trainer
from labkit.config import ConfigError, RunConfig
from labkit.measure.memory import free_device_memory
from labkit.measure.timeline import CATEGORIES, Timeline, make_recorder

TIDY_COLUMNS = ("recipe", "sample", "phase", "micro_batch", "category", "bytes", "total_bytes",
                "predicted_peak_bytes")


@dataclass
class StepTimeline:
    """One recipe's recorded step: the tidy samples (TIDY_COLUMNS, one row per sample and
    category), the marks, and the planner's predicted peak (None, with `prediction_note`
    saying why, where the planner has no case for the recipe)."""

    label: str
    frame: pd.DataFrame
    marks: list[tuple[str, int]]
    timeline: Timeline
    predicted_peak_bytes: int | None
    prediction_note: str = ""
    plan: planner.MemoryPlan | None = field(default=None, repr=False)
    trainer: Trainer | None = field(default=None, repr=False)  # kept on request (`step_timeline`)


def recipe_label(recipe: Recipe) -> str:
    """`plain`, or the recipe's techniques (`checkpointing=full, micro_batches=2`)."""
    return ", ".join(recipe.techniques()) or "plain"


class _ForwardMarks:
    """Entered around every forward (a Trainer context): marks its start and its end (the
    backward's start)."""

    def __init__(self, recorder):
        self.recorder = recorder

    def __enter__(self):
        self.recorder.mark("forward")

    def __exit__(self, *exc):
        self.recorder.mark("backward")


def record_step(trainer: Trainer) -> Timeline:
    """Record one `trainer.step()` by category, marking each forward, backward and the optimizer
    (where the gradients are named). The trainer is left as it was."""
    recorder = make_recorder(trainer.cfg.device)
    marks = _ForwardMarks(recorder)

    def optimizer_mark(s: Trainer) -> None:
        recorder.mark("optimizer", gradients=[p.grad for p in s.model.parameters()])

    context = lambda: marks  # noqa: E731
    trainer.contexts.append(context)
    trainer.grad_hooks.append(optimizer_mark)
    try:
        # the weights: parameters and buffers (a quantized base's NF4 or int8 linears are buffers)
        with recorder.recording(parameters=[*trainer.model.parameters(), *trainer.model.buffers()],
                                optimizer_state=trainer.optimizer_tensors(),
                                batch=[trainer.inputs, trainer.targets, trainer.document_ids]):
            trainer.step()
            recorder.mark("end")
    finally:
        trainer.contexts.remove(context)
        trainer.grad_hooks.remove(optimizer_mark)
    return recorder.timeline()


def step_timeline(cfg: RunConfig, recipe: Recipe | None = None, *, keep_trainer: bool = False) -> StepTimeline:
    """`compose(cfg, recipe)`, one warm-up step (AdamW's state exists after it, as in every
    later step), then one recorded step (categories: `labkit.measure.timeline`), with the
    planner's prediction for the same recipe: its precision's case, checkpointing and
    micro-batches (`cfg.batch_size` rows split into `micro_batches`, as `compose` splits them).
    `keep_trainer`: the step's trainer comes back with it (its memory is not freed)."""
    recipe = recipe or Recipe()
    trainer = compose(cfg, recipe)
    trainer.step()
    timeline = record_step(trainer)
    if not keep_trainer:
        trainer = None
        free_device_memory(cfg.device)
    try:  # the planner's step for the recipe: its training or fine-tuning case
        plan, note = planned_memory(cfg, recipe), ""
    except ConfigError as e:
        plan, note = None, str(e)
    label = recipe_label(recipe)
    predicted = plan.total_bytes if plan else None
    return StepTimeline(label, tidy(timeline, label, predicted), timeline.marks, timeline,
                        predicted, note, plan, trainer)


def tidy(timeline: Timeline, label: str, predicted: int | None) -> pd.DataFrame:
    """One row per (sample, category) of one recipe's timeline."""
    wide = timeline.samples.assign(recipe=label, predicted_peak_bytes=predicted)
    long = wide.melt(id_vars=["recipe", "sample", "phase", "micro_batch", "total_bytes",
                              "predicted_peak_bytes"], value_vars=list(CATEGORIES),
                     var_name="category", value_name="bytes")
    return long[list(TIDY_COLUMNS)].sort_values(["sample", "category"], kind="stable",
                                                key=_category_order).reset_index(drop=True)


def _category_order(column: pd.Series) -> pd.Series:
    return column.map(CATEGORIES.index) if column.name == "category" else column


def compare_timelines(cfg: RunConfig, recipes: Sequence[Recipe]) -> pd.DataFrame:
    """The tidy frames of each recipe's step, one after the other (each recorded on its own);
    `attrs` holds each recipe's marks and, where the planner has no case, why no prediction.
    Recipes with the same label are refused: the figure tells them apart by label."""
    labels = [recipe_label(r) for r in recipes]
    if not labels or len(set(labels)) != len(labels):
        raise ConfigError(f"give different recipes (one or more); got {labels}")
    timelines = [step_timeline(cfg, r) for r in recipes]
    frame = pd.concat([t.frame for t in timelines], ignore_index=True)
    frame.attrs = {"marks": {t.label: t.marks for t in timelines},
                   "prediction_notes": {t.label: t.prediction_note for t in timelines if t.prediction_note}}
    return frame
