"""Activation checkpointing: equal gradients, fewer bytes held, the FLOPs of recomputation, and the
budget variant's choice of blocks."""
import gc

import numpy as np
import pytest

from conftest import FAST, by
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.measure.flops import count_flops
from labkit.measure.memory import LiveTensorTracker
from labkit.techniques import checkpointing as ckpt
from labkit.blocks.training import Trainer, gradient_difference

TINY = {**FAST, "batch_size": 1, "seq_len": 8, "num_layers": 2, "device": "cpu"}
# The tiny preset's own sizes: the backward's start (activations) sets the peak, not the step.
ACTIVATION_BOUND = {**FAST, "batch_size": 4, "seq_len": 64, "num_layers": 4}


def config(variant="none", **overrides):
    return resolve(ckpt.Config, "tiny", {**TINY, "variant": variant, **overrides},
                   experiment="checkpointing")


def trained(cfg):
    trainer = Trainer(cfg)
    blocks = ckpt.checkpointed_blocks(cfg.model.num_layers, cfg.variant, every=cfg.every)
    ckpt.apply_checkpointing(trainer.model, cfg.variant, every=cfg.every)
    return trainer, blocks


@pytest.mark.parametrize("variant", ["full", "every_n", "selective"])
def test_recomputation_gives_bitwise_equal_gradients(variant):
    reference = ckpt.step_with_gradients(trained(config())[0])
    got = ckpt.step_with_gradients(trained(config(variant))[0])
    assert got["loss"] == reference["loss"]
    assert all(np.array_equal(got["grads"][n], g) for n, g in reference["grads"].items())
    assert gradient_difference(reference["grads"], got["grads"]) == (0.0, 0.0)


@pytest.mark.slow
def test_counted_recomputation_flops_are_one_forward_of_each_block_less_its_down_projection():
    plain = count_flops(trained(config())[0].step)
    for variant, every in [("full", 2), ("every_n", 2), ("selective", 2), ("every_n", 3)]:
        cfg = config(variant, every=every, num_layers=4)
        trainer, blocks = trained(cfg)
        extra = count_flops(trainer.step) - count_flops(trained(config(num_layers=4))[0].step)
        assert extra == ckpt.recompute_flops(cfg, len(blocks)), variant
        assert (extra == 0) == (variant == "selective")
    assert plain == ckpt.expected(config())["flops"]


@pytest.mark.slow
def test_experiment_rows_bytes_held_and_gradients_against_the_reference():
    rows = run_experiment("checkpointing", preset="tiny", overrides={**TINY, "num_layers": 4},
                          progress=False).rows
    assert {r["status"] for r in rows} == {"ok"}
    held = {v: by(rows, v, "activation_bytes")["value"] for v in ckpt.VARIANTS}
    assert held["full"] <= held["none"] / 4
    assert held["full"] < held["every_n"] < held["none"]
    assert held["full"] < held["selective"] < held["none"]
    assert held["budget"] == held["none"]  # no budget on a CPU unless one is given
    for v in ckpt.VARIANTS:
        assert by(rows, v, "grad_max_abs_diff")["value"] == 0.0
        assert by(rows, v, "flops")["value"] == by(rows, v, "flops")["predicted"]
        assert by(rows, v, "activation_bytes")["value"] == pytest.approx(
            by(rows, v, "activation_bytes")["predicted"], rel=0.02)
    assert [by(rows, v, "num_checkpointed_blocks")["value"] for v in ckpt.VARIANTS] == [0, 4, 2, 4, 0]
    assert "No budget" in by(rows, "budget", "num_checkpointed_blocks")["message"]


@pytest.mark.slow
def test_the_measured_table_frees_what_the_planner_says_and_leaks_nothing():
    cfg = config("budget", **ACTIVATION_BOUND)
    trainer = Trainer(cfg)
    gc.collect()
    tracker = LiveTensorTracker()
    with tracker:
        costs = ckpt.block_costs(trainer.model, trainer.inputs)
        gc.collect()
    assert tracker.current_bytes == 0  # the block's measuring passes are all freed
    per_layer = (ckpt.plan_memory(cfg).activation_bytes_per_layer
                 - ckpt.plan_memory(cfg, "full").activation_bytes_per_layer)
    assert [c.saved_bytes for c in costs] == [per_layer] * 4
    assert all(c.recompute_s > 0 for c in costs)


def test_greedy_choice_takes_the_most_bytes_per_second_first_then_earlier_blocks():
    costs = [ckpt.BlockCost(0, 100, 1.0), ckpt.BlockCost(1, 300, 1.0), ckpt.BlockCost(2, 300, 1.0),
             ckpt.BlockCost(3, 300, 3.0)]
    assert ckpt.choose_blocks(costs, 0) == ()
    assert ckpt.choose_blocks(costs, 1) == (1,)
    assert ckpt.choose_blocks(costs, 301) == (1, 2)
    assert ckpt.choose_blocks(costs, 601) == (0, 1, 2)  # 0 and 3 both free 100 B/s: the earlier
    assert ckpt.choose_blocks(costs, 10**6) == (0, 1, 2, 3)


@pytest.mark.slow
def test_budget_checkpoints_the_fewest_blocks_that_fit_an_activation_budget():
    sizes = ACTIVATION_BOUND
    cfg = config("budget", **sizes)
    plain = ckpt.planned_figure(cfg, "activations", 0)
    freed = plain - ckpt.planned_figure(cfg, "activations", 1)  # one block's worth
    for k in range(5):
        budget = plain - k * freed
        cfg = config("budget", **sizes, activation_budget_gib=budget / 2**30)
        trainer = Trainer(cfg)
        blocks, note = ckpt.budget_blocks(cfg, trainer.model, trainer.inputs)
        assert blocks == tuple(range(k)), (k, note)
        assert ckpt.planned_blocks(cfg) == k


@pytest.mark.slow
def test_budget_fits_under_a_memory_budget_that_none_exceeds():
    cfg = config(**ACTIVATION_BOUND)
    none, full = ckpt.plan_memory(cfg).total_bytes, ckpt.plan_memory(cfg, "full").total_bytes
    assert full < none
    budget = (none + full) / 2
    rows = run_experiment("checkpointing", preset="tiny", variants=["budget"], progress=False,
                          overrides={**ACTIVATION_BOUND, "device": "cpu",  # config()'s plan
                                     "memory_budget_gib": budget / 2**30}).rows
    assert by(rows, "none", None)["status"] == "oom"
    assert {r["status"] for r in rows if r["variant"] == "budget"} == {"ok"}
    peak = by(rows, "budget", "peak_mem_bytes")
    assert peak["value"] <= budget
    assert peak["value"] == pytest.approx(peak["predicted"], rel=0.01)
    chosen = by(rows, "budget", "num_checkpointed_blocks")
    assert 1 <= chosen["value"] == chosen["predicted"] and "checkpointed: [0" in chosen["message"]
    # the reference did not run: no gradient rows are claimed against it
    assert not [r for r in rows if r["metric"] == "grad_max_abs_diff"]


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="float32"):
        run_experiment("checkpointing", overrides={"dtype": "bf16"})
    with pytest.raises(ConfigError, match="every=0"):
        config("every_n", every=0)
    with pytest.raises(ValueError, match="unknown checkpointing mode"):
        ckpt.apply_checkpointing(Trainer(config()).model, "budget")
