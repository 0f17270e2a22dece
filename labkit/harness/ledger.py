"""The memory ledger of a recipe's step: every storage live at the measured peak, by the planner's
categories, beside what the planner holds at its own peak, and the residual named.

    ledger = memory_ledger(cfg, Recipe(precision="bf16", checkpointing="full"))
    labkit.views.memory.ledger_figure(ledger)

The measured side is `labkit.harness.timeline`'s recorded step (one process): its sample with the
most live bytes, each storage in one category (`labkit.measure.timeline`). The predicted side is
`planner.training_memory` for the same recipe at its peak phase, its terms mapped to the same
categories (LEDGER). Beside each category's residual (measured less predicted): the bytes the
planner leaves out on purpose, counted from the step itself (`named`), and what is left after
them (`unexplained`). What a one-process CPU step cannot hold is listed as such (KV cache: none in
training; communication buffers: a data-parallel recipe's, which need ranks: the recipe
experiment's per-rank rows; allocator slack: a CUDA caching allocator's).
"""
from __future__ import annotations

import pandas as pd

from labkit.blocks.recipe import Recipe, planned_memory
from labkit.config import ConfigError, RunConfig
from labkit.harness.timeline import StepTimeline, recipe_label, step_timeline
from labkit.measure.memory import storage_bytes

# The ledger's categories: the timeline's (measured) and the planner's terms held at its peak
LEDGER = {"weights": ("parameters", ("param", "gathered")),
          "gradients": ("gradients", ("grad",)),
          "optimizer states": ("optimizer_state", ("optimizer",)),
          # autocast's cached 16-bit weight casts are storages a forward leaves for its backward
          "activations": ("activations", ("activation", "weight_copy")),
          "temporaries": ("temporaries", ("overhead",))}
NOT_HELD = {"KV cache": "none in a training step",
            "communication buffers": "none on one process (a data-parallel recipe's are in the "
                                     "recipe experiment's per-rank rows)",
            "allocator slack": "a CUDA caching allocator's reserved, unallocated bytes; the CPU "
                               "tracker counts storages exactly"}
PHASES = {"step": "optimizer"}  # the planner's phase names where the timeline's differ


def memory_ledger(cfg: RunConfig, recipe: Recipe | None = None) -> pd.DataFrame:
    """One row per category: `measured` (bytes live at the recorded step's peak), `predicted`
    (the planner's at its peak), `residual`, `named` (the part of it the step's own tensors
    account for, `named_residuals`), `unexplained` and a `note`. `attrs`: the two peaks, their
    phases and the recipe's label. ConfigError where the planner has no case for the recipe."""
    recipe = recipe or Recipe()
    try:  # before the step is built: a recipe the planner has no case for is refused at once
        planned_memory(cfg, recipe)
    except ConfigError as e:
        raise ConfigError(f"no ledger for {recipe_label(recipe)}: {e}") from None
    timeline = step_timeline(cfg, recipe, keep_trainer=True)
    samples, plan = timeline.timeline.samples, timeline.plan
    peak = samples.loc[samples["total_bytes"].idxmax()]
    named = named_residuals(timeline, counters_planned=recipe.finetune != "none")
    rows = []
    for category, (column, terms) in LEDGER.items():
        predicted = sum(getattr(plan, f"{t}_bytes") for t in terms if t in plan.held_at_peak)
        measured = int(peak[column])
        bytes_named, note = named.get(category, (0, ""))
        rows.append({"category": category, "measured": measured, "predicted": predicted,
                     "residual": measured - predicted, "named": bytes_named,
                     "unexplained": measured - predicted - bytes_named, "note": note})
    rows += [{"category": c, "measured": 0, "predicted": 0, "residual": 0, "named": 0,
              "unexplained": 0, "note": why} for c, why in NOT_HELD.items()]
    frame = pd.DataFrame(rows)
    frame.attrs = {"recipe": timeline.label, "measured_peak_bytes": int(peak["total_bytes"]),
                   "predicted_peak_bytes": plan.total_bytes, "measured_phase": peak["phase"],
                   "predicted_phase": PHASES.get(plan.peak_phase, plan.peak_phase)}
    return frame


def named_residuals(timeline: StepTimeline, *, counters_planned: bool = False) -> dict[str, tuple[int, str]]:
    """What the planner leaves out on purpose, counted on the step's own tensors: the batch's
    token ids (and a packed batch's document ids), which the forward's embedding and loss hold
    (activations), and the optimizer's 0-dim step counters (4 bytes a tensor), unless
    `counters_planned` (the fine-tuning terms count the adapters')."""
    trainer = timeline.trainer
    batch = [trainer.inputs, trainer.targets] + ([trainer.document_ids] if trainer.document_ids is not None else [])
    named = {"activations": (storage_bytes(batch), "the batch's token ids (targets, document ids), held "
                                                   "by the embedding and the loss")}
    counters = [t for t in trainer.optimizer_tensors() if t.dim() == 0]
    if not counters_planned:
        named["optimizer states"] = (storage_bytes(counters), f"{len(counters)} step counters, one a "
                                                              "tensor (0-dim)")
    return named


def ledger_ok(frame: pd.DataFrame, within: float = 0.05, small: float = 0.01) -> bool:
    """Each category within `within` of its prediction once its named residual is counted, or
    its unexplained bytes under `small` of the predicted peak (a category of a few bytes, or a
    term the planner holds at another moment of the same phase, such as the adapters'
    gradients at a block's moment of the backward where the measured peak is the loss's)."""
    bound = (within * frame["predicted"].abs()).clip(lower=small * frame.attrs["predicted_peak_bytes"])
    return bool((frame["unexplained"].abs() <= bound).all())
