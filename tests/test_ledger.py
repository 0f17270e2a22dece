"""The memory ledger (labkit.harness.ledger): every storage live at a recipe's measured peak, by
the planner's categories, beside the planner's terms; the residual named from the step's own
tensors; a planner that forgets a term is caught."""
import dataclasses

import pytest

from labkit.blocks.recipe import Recipe
from labkit.config import ConfigError, resolve
from labkit.harness import ledger as ledgers
from labkit.harness.ledger import ledger_ok, memory_ledger
from labkit.techniques import recipe as recipe_experiment
from labkit.views.memory import ledger_figure

from conftest import needs

pytestmark = pytest.mark.slow


def config():
    return resolve(recipe_experiment.Config, "tiny", {"device": "cpu", "nproc": 1, "num_layers": 2,
                                                     "seq_len": 32}, experiment="recipe")


RECIPES = [Recipe(), Recipe(precision="bf16", checkpointing="full"),
           Recipe(precision="bf16", checkpointing="selective", micro_batches=2),
           Recipe(loss="chunked", loss_chunk=32), Recipe(packing=True)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: ", ".join(r.techniques()) or "plain")
def test_every_category_is_the_planners_once_the_named_residual_is_counted(recipe):
    cfg = config()
    frame = memory_ledger(cfg, recipe)
    assert ledger_ok(frame), frame
    assert frame["measured"].sum() == frame.attrs["measured_peak_bytes"]  # every live storage, once
    held = frame.set_index("category")
    rows = cfg.batch_size
    batch = rows * (cfg.seq_len * 3 if recipe.packing else cfg.seq_len + 1) * 8  # the token ids
    assert held.loc["activations", "named"] == batch
    assert set(ledgers.NOT_HELD) <= set(held.index)


@needs("torchao", "peft")
@pytest.mark.parametrize("recipe", [Recipe(finetune="qlora"), Recipe(finetune="lora_int8", checkpointing="full"),
                                    Recipe(optimizer="adamw8bit")], ids=["qlora", "lora_int8", "adamw8bit"])
def test_fine_tuning_and_8_bit_states_too(recipe):
    frame = memory_ledger(config(), recipe)
    assert ledger_ok(frame), frame
    assert frame.attrs["measured_peak_bytes"] == pytest.approx(frame.attrs["predicted_peak_bytes"], rel=0.015)


def test_a_planner_that_forgets_the_optimizer_states_is_caught(monkeypatch):
    real = ledgers.step_timeline

    def forgetful(cfg, recipe, **kw):
        timeline = real(cfg, recipe, **kw)
        timeline.plan = dataclasses.replace(timeline.plan, optimizer_bytes=timeline.plan.optimizer_bytes // 2)
        return timeline

    monkeypatch.setattr(ledgers, "step_timeline", forgetful)
    frame = memory_ledger(config(), Recipe())
    assert not ledger_ok(frame)
    assert frame.set_index("category").loc["optimizer states", "unexplained"] > 0


def test_the_figure_stacks_each_held_category_and_no_prediction_is_a_clear_error():
    frame = memory_ledger(config(), Recipe(checkpointing="full"))
    fig = ledger_figure(frame)
    assert fig.layout.barmode == "stack"
    assert [t.name for t in fig.data] == [c for c, m, p in zip(frame["category"], frame["measured"],
                                                               frame["predicted"]) if m or p]
    with pytest.raises(ConfigError, match="no ledger"):
        memory_ledger(config(), Recipe(compile=True))


def test_the_quiz_figures_are_the_ledgers():
    from labkit.study.quiz import load_bank

    text = {q.id: q.question + q.explanation for q in load_bank() if q.id.startswith("ledger-")}
    frame = memory_ledger(config(), Recipe()).set_index("category")
    cfg = config()
    assert f"{cfg.batch_size} × {cfg.seq_len + 1} × 8 = {frame.loc['activations', 'named']:,}" in text["ledger-01"]
    assert f"{frame.loc['activations', 'residual']:,} bytes" in text["ledger-01"]
    counters = frame.loc["optimizer states", "named"]
    assert f"{counters} bytes" in text["ledger-02"] and f"{counters // 4} × 4 = {counters}" in text["ledger-02"]
    assert "allocator slack" in ledgers.NOT_HELD and "KV cache" in ledgers.NOT_HELD
