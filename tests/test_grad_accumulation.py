"""Gradient accumulation: the gradients of one large batch, at the memory of one micro-batch."""
import numpy as np
import pytest

from conftest import FAST
from labkit import planner
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import grad_accumulation as ga
from labkit.blocks.training import gradient_difference, step_with_gradients

TINY = {**FAST, "batch_size": 1, "seq_len": 8, "num_layers": 2, "device": "cpu"}


def config(variant="one_batch", **overrides):
    return resolve(ga.Config, "tiny", {**TINY, "variant": variant, **overrides},
                   experiment="grad_accumulation")


def by(rows, variant, metric, k):
    hits = [r for r in rows if r["variant"] == variant and r["metric"] == metric
            and r["params"]["sweep"] == {"micro_batches": k}]
    assert len(hits) == 1, (variant, metric, k, hits)
    return hits[0]["value"]


def test_micro_batches_are_the_large_batch_in_order():
    one, acc = ga.accumulation_step(config()), ga.accumulation_step(config("accumulate", batch_size=2))
    assert [piece.inputs.shape[0] for piece in one.micro_batches()] == [4]
    assert [(piece.inputs.shape[0], piece.weight) for piece in acc.micro_batches()] == [(2, 0.25)] * 4
    assert acc.inputs.shape == (8, 8)  # k*b sequences of T tokens
    big = ga.accumulation_step(config(batch_size=8, micro_batches=1))
    assert (acc.inputs == big.inputs).all()  # the same sequences as one batch of k*b


@pytest.mark.slow
def test_accumulated_gradients_equal_the_large_batch_within_fp32_rounding():
    reference = step_with_gradients(ga.accumulation_step(config(batch_size=2)))
    got = step_with_gradients(ga.accumulation_step(config("accumulate", batch_size=2)))
    max_abs, max_rel = gradient_difference(reference["grads"], got["grads"])
    assert 0 < max_rel <= ga.TOLERANCE  # not bitwise: k partial sums round differently
    assert got["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    # one micro-batch is the plain step: bitwise equal
    reference = step_with_gradients(ga.accumulation_step(config(batch_size=2, micro_batches=1)))
    got = step_with_gradients(ga.accumulation_step(config("accumulate", batch_size=2, micro_batches=1)))
    assert all(np.array_equal(got["grads"][n], g) for n, g in reference["grads"].items())


@pytest.mark.slow
def test_experiment_peak_follows_the_micro_batch_and_tokens_the_large_batch():
    # Sizes where one forward's activations, not the optimizer step, set the peak.
    rows = run_experiment("grad_accumulation", preset="tiny", progress=False,
                          overrides={**FAST, "batch_size": 2, "seq_len": 64, "num_layers": 2},
                          sweep={"micro_batches": [1, 2, 4]}).rows
    assert {r["status"] for r in rows} == {"ok"}
    for k in (1, 2, 4):
        assert by(rows, "accumulate", "grad_max_rel_diff", k) <= ga.TOLERANCE
        for v in ga.VARIANTS:
            assert by(rows, v, "flops", k) == k * by(rows, v, "flops", 1)  # k*b*T tokens each
    assert by(rows, "accumulate", "grad_max_rel_diff", 1) == 0.0
    held = {k: by(rows, "accumulate", "activation_bytes", k) for k in (1, 2, 4)}
    assert held[1] == held[2] == held[4]  # one micro-batch at a time
    assert by(rows, "one_batch", "activation_bytes", 4) > 3.5 * held[1]
    peak = {k: by(rows, "accumulate", "peak_mem_bytes", k) for k in (1, 2, 4)}
    assert peak[4] <= 1.10 * peak[1] and by(rows, "one_batch", "peak_mem_bytes", 4) > 1.25 * peak[4]
    # From the second micro-batch on, the gradients sit beside a micro-batch's activations: the
    # peak rises by at most one gradient buffer over the plain step of b, then stays flat in k.
    grad_bytes = planner.training_memory(config().model, seq_len=64).grad_bytes
    assert peak[1] < peak[2] <= peak[1] + grad_bytes
    assert peak[4] == pytest.approx(peak[2], rel=1e-3)
    for r in rows:
        if r["metric"] == "peak_mem_bytes":
            assert r["value"] == pytest.approx(r["predicted"], rel=0.02), r


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="float32"):
        run_experiment("grad_accumulation", overrides={"dtype": "bf16"})
    with pytest.raises(ConfigError, match="micro_batches=0"):
        config(micro_batches=0)
