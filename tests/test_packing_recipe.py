"""The recipe's `packing=True`: documents packed into the rows (labkit.blocks.recipe.compose) train
as the same documents one per padded row (plain's), through micro-batches, the chunked loss,
checkpointing and 8-bit AdamW; the step's loss is the mean over the tokens with a target however
the rows are split; the planner's mask and position terms byte for byte against the forward."""
import contextlib
import dataclasses

import pytest
import torch

from labkit import planner
from labkit.blocks import packing
from labkit.blocks.recipe import Recipe, compose, packed_documents, planned_memory
from labkit.blocks.training import Trainer
from labkit.config import MODELS, resolve
from labkit.measure.memory import ActivationMeter
from labkit.techniques import recipe as recipe_experiment

pytestmark = pytest.mark.slow


def config(**overrides):
    return resolve(recipe_experiment.Config, "tiny", {"device": "cpu", "nproc": 1, "num_layers": 2,
                                                     "seq_len": 64, **overrides}, experiment="recipe")


def padded(cfg):
    """plain's step: the same documents, one per row, right-padded, no mask needed."""
    return packing.apply_packing(Trainer(cfg, lr=1e-3), packing.pad_batch(packed_documents(cfg, 1)),
                                 document_mask=False)


def weights(trainer):
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def relative(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("recipe", [Recipe(packing=True), Recipe(packing=True, micro_batches=2),
                                    Recipe(packing=True, loss="chunked", loss_chunk=48),
                                    Recipe(packing=True, checkpointing="full")],
                         ids=["packed", "micro_batches", "chunked", "checkpointing"])
def test_packed_rows_train_as_each_document_alone(recipe):
    cfg = config()
    packed, reference = compose(cfg, recipe, lr=1e-3), padded(cfg)
    assert len(packed.inputs) == cfg.batch_size < len(reference.inputs)  # fewer rows, same documents
    assert int((packed.targets != packing.IGNORE).sum()) == int((reference.targets != packing.IGNORE).sum())
    losses = [(packed.step(), reference.step()) for _ in range(2)]
    assert all(a == pytest.approx(b, rel=1e-5) for a, b in losses)
    assert relative(weights(packed), weights(reference)) < recipe_experiment.FP32_TOLERANCE


def test_weighing_the_micro_batches_by_rows_is_not_the_mean_over_tokens():
    """The mechanism the check relies on: with pieces of unequal document tokens, a row-weighted
    sum of their means is another loss (the bug a packed batch invites)."""
    cfg = config()
    right = compose(cfg, Recipe(packing=True, micro_batches=2), lr=1e-3)
    wrong = compose(cfg, Recipe(packing=True, micro_batches=2), lr=1e-3)
    wrong.loss_tokens = None  # each piece weighted by its rows
    pieces = [int((p.targets != packing.IGNORE).sum()) for p in right.micro_batches()]
    assert pieces[0] != pieces[1]
    assert [p.weight for p in right.micro_batches()] == [n / sum(pieces) for n in pieces]
    assert abs(right.step() - wrong.step()) > 1e-4 * right.losses[-1]


def test_the_packed_step_with_8_bit_adamw_and_qlora_passes_its_check():
    pytest.importorskip("torchao"), pytest.importorskip("peft")
    cfg = config(vocab_size=32768, variant="composed", packing=True, loss="chunked", loss_chunk=128,
                 optimizer="adamw8bit", finetune="qlora", steps=2)
    from labkit.harness.experiment import run_experiment
    rows = run_experiment("recipe", preset="tiny", overrides={
        "device": "cpu", "nproc": 1, "num_layers": 2, "seq_len": 64, "vocab_size": 32768, "packing": True,
        "loss": "chunked", "loss_chunk": 128, "optimizer": "adamw8bit", "finetune": "qlora",
        "min_run_time_s": 0.0, "warmup": 0, "timed_steps": 1, "min_repeats": 1}).rows
    assert cfg.packing and all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    composed = {r["metric"]: r for r in rows if r["variant"] == "composed"}
    for metric in ("loss_rel_diff", "weight_rel_diff"):
        assert composed[metric]["value"] <= recipe_experiment.tolerance(cfg)
    # the planner's fine-tuning step with the chunked loss, the packed batch and 8-bit states
    for metric, within in (("activation_bytes", 0.001), ("optimizer_bytes", 0.0), ("peak_mem_bytes", 0.01)):
        assert composed[metric]["value"] == pytest.approx(composed[metric]["predicted"], rel=within), metric


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("precision, checkpointing", [("fp32", "none"), ("fp32", "full"), ("bf16", "every_n"),
                                                      ("fp32", "selective")])
def test_the_planners_mask_and_position_terms_are_what_the_forward_keeps(arch, precision, checkpointing):
    m = dataclasses.replace(MODELS["tiny"], arch=arch, num_layers=3, **({"tie_embeddings": True} if arch == "gpt2" else {}))
    cfg = dataclasses.replace(config(), model=m)
    recipe = Recipe(packing=True, precision=precision, checkpointing=checkpointing)
    trainer = compose(cfg, recipe, lr=1e-3)
    measured = ActivationMeter(trainer.model.parameters()).measure(trainer.forward).total_bytes
    plan = planned_memory(cfg, recipe)
    unpacked = planned_memory(cfg, dataclasses.replace(recipe, packing=False))
    assert plan.activation_bytes == measured  # byte-exact on torch 2.13
    assert plan.activation_bytes > unpacked.activation_bytes  # the mask and per-row positions


def test_packing_06s_weights_are_the_trainers():
    from labkit.study.quiz import load_bank

    text = next(q.question + q.explanation for q in load_bank() if q.id == "packing-06")
    trainer = Trainer(config(batch_size=2, seq_len=100), lr=1e-3)
    trainer.targets[1, 60:] = packing.IGNORE  # two pieces of one row: 100 and 60 tokens with a target
    trainer.sizes, trainer.loss_tokens = [1, 1], 160.0
    weights = [piece.weight for piece in trainer.micro_batches()]
    assert weights == [0.625, 0.375]
    assert all(f"{w:g}" in text for w in weights) and "0.5 each" in text


def test_the_mask_drills_answer_by_hand():
    from labkit.study import exercises
    from labkit.study.exercises.core import Setup

    c = Setup(exercises.RUNS["chunked"], "cpu").cfg("composed", packing=True)
    b, s, hd, layers = c.batch_size, c.seq_len, c.model.head_dim, c.model.num_layers
    by_hand = b * s * s * 4 * layers + 2 * (b - 1) * s * hd * 4 - 8 * b * s
    assert exercises.reference_answer("packed_mask_bytes", "cpu") == by_hand
