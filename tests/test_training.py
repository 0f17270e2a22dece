"""The plain training step's shared pieces: `gradient_difference` on known inputs, and the fp16
GradScaler's skip-and-halve path, triggered by a real fp16 overflow on a tiny model."""
import math

import numpy as np
import pytest
import torch

from conftest import TINY_TRAIN
from labkit.config import resolve
from labkit.techniques import mixed_precision
from labkit.techniques.training import gradient_difference


def grads(**tensors) -> dict[str, np.ndarray]:
    return {name: np.asarray(values, dtype=np.float32) for name, values in tensors.items()}


def test_identical_gradients_differ_by_zero():
    ref = grads(w=[[1.0, -2.0], [3.0, 0.5]], b=[0.25, 0.0])
    assert gradient_difference(ref, {k: v.copy() for k, v in ref.items()}) == (0.0, 0.0)


def test_a_known_perturbation_gives_the_largest_absolute_and_normwise_relative_difference():
    ref = grads(w=[3.0, 4.0], b=[1.0, 0.0, 0.0, 0.0])  # norms 5 and 1
    got = grads(w=[3.0, 4.5], b=[1.0, 0.3, 0.4, 0.0])  # differences: norm 0.5 (max 0.5), 0.5 (max 0.4)
    max_abs, max_rel = gradient_difference(ref, got)
    assert max_abs == pytest.approx(0.5) and max_rel == pytest.approx(0.5 / 1)  # b's: 0.5 / 1
    assert gradient_difference({"w": ref["w"]}, got) == pytest.approx((0.5, 0.5 / 5))


def test_an_all_zero_reference_uses_its_own_absolute_difference_in_any_order():
    zero, big = grads(z=[0.0, 0.0]), grads(v=[1.0, 1.0])
    got = {**grads(z=[0.1, 0.0]), **grads(v=[1.0, 3.0])}  # v: max 2, normwise 2 / sqrt(2)
    for ref in ({**zero, **big}, {**big, **zero}):
        assert gradient_difference(ref, got) == pytest.approx((2.0, math.sqrt(2)))


def test_a_nan_gradient_is_never_a_match():
    ref = grads(w=[1.0, 2.0], b=[1.0])
    for bad in ({**ref, "w": grads(w=[1.0, np.nan])["w"]}, {**ref, "b": grads(b=[np.inf])["b"]}):
        max_abs, max_rel = gradient_difference(ref, bad)
        assert not max_rel <= 1e-3 and not max_abs <= 1e-3  # nan or inf: fails every tolerance


def test_missing_or_reshaped_gradients_are_refused_and_extra_ones_ignored():
    ref = grads(w=[[1.0, 2.0]])
    with pytest.raises(ValueError, match="'w': missing"):
        gradient_difference(ref, grads(v=[[1.0, 2.0]]))
    with pytest.raises(ValueError, match=r"'w': shape \(2, 1\), the reference's is \(1, 2\)"):
        gradient_difference(ref, grads(w=[[1.0], [2.0]]))
    with pytest.raises(ValueError, match="shape"):  # would broadcast silently
        gradient_difference(grads(w=[1.0]), grads(w=[1.0, 1.0]))
    assert gradient_difference(ref, {**ref, **grads(extra=[5.0])}) == (0.0, 0.0)


# --- fp16 with a GradScaler: an overflowing step is skipped and the scale halves ----------------

def fp16_trainer() -> mixed_precision.PrecisionTrainer:
    """A very small decoder (fp16 matmuls are emulated, slowly, on CPUs without AVX-512 FP16)."""
    overrides = {**TINY_TRAIN, "device": "cpu", "variant": "fp16", "hidden_size": 32,
                 "num_heads": 2, "num_kv_heads": 1, "num_layers": 1}
    return mixed_precision.PrecisionTrainer(
        resolve(mixed_precision.Config, "tiny", overrides, experiment="mixed_precision"))


def weights(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_an_fp16_overflow_skips_the_step_and_halves_the_scale():
    trainer = fp16_trainer()
    # the loss (fp32) x 2^100 stays finite, but its gradient overflows once autocast casts it to
    # fp16 (max 65504) on the way into the fp16 matmuls: inf gradients, a step to skip
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    before = weights(trainer)
    loss = trainer.step()
    assert math.isfinite(loss)
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert not trainer.optimizer.state  # AdamW never stepped
    backoff = trainer.scaler.get_backoff_factor()
    assert trainer.scaler.get_scale() == 2.0**100 * backoff == 2.0**99
    assert trainer.skipped_steps == 1
    assert trainer.report()["loss_scale"] == 2.0**99 and trainer.report()["skipped_steps"] == 1


def test_an_fp16_step_without_overflow_updates_the_weights_and_keeps_the_scale():
    trainer = fp16_trainer()
    scale, before = trainer.scaler.get_scale(), weights(trainer)
    trainer.step()
    assert trainer.skipped_steps == 0 and trainer.scaler.get_scale() == scale
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)]
    assert changed == list(before) and trainer.optimizer.state


# --- the knobs that break fp16 on purpose (the troubleshooting labs) -----------------------------

def fp16_run(**knobs) -> dict:
    """Three steps of the small fp16 trainer with `knobs`; what train() reports of them."""
    overrides = {**TINY_TRAIN, "device": "cpu", "variant": "fp16", "hidden_size": 32, "num_heads": 2,
                 "num_kv_heads": 1, "num_layers": 1, **knobs}
    cfg = resolve(mixed_precision.Config, "tiny", overrides, experiment="mixed_precision")
    return mixed_precision.PrecisionTrainer(cfg).train(3)


def test_mlp_scale_overflows_the_fp16_forward_and_loss_scaling_cannot_help():
    plain = fp16_run()
    assert plain["nonfinite_losses"] == 0 and plain["skipped_steps"] == 0
    for scaling in (False, True):  # the first loss is already nan: before any backward
        out = fp16_run(mlp_scale=1e7, loss_scaling=scaling)
        assert out["nonfinite_losses"] == 3 and math.isnan(out["loss_first"])
    assert fp16_run(mlp_scale=1e7, loss_scaling=True)["skipped_steps"] == 3


def test_a_tiny_loss_weight_flushes_fp16_gradients_to_zero_unless_scaled():
    unscaled = fp16_run(loss_weight=1e-7, loss_scaling=False)
    assert unscaled["zero_grad_pct"] == 100.0 and unscaled["grad_norm"] == 0.0
    assert unscaled["losses"][-1] == pytest.approx(unscaled["losses"][0], rel=1e-5)  # decay only
    scaled = fp16_run(loss_weight=1e-7, loss_scaling=True)
    assert scaled["zero_grad_pct"] < 90 and scaled["nonfinite_losses"] == 0
