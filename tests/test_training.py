"""The plain training step's shared pieces: `gradient_difference` on known inputs, and the fp16
GradScaler's skip-and-halve path, triggered by a real fp16 overflow on a tiny model."""
import math

import numpy as np
import pytest
import torch

from conftest import TINY_TRAIN
from labkit.config import resolve
from labkit.techniques import mixed_precision
from labkit.blocks.training import CopyAdamW, Trainer, compare_grads, gradient_difference, total_norm


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


# --- compare_grads: gradient_difference, the tolerances and the Comparison in one place -------

def test_compare_grads_passes_equal_gradients_and_reports_every_difference_in_order():
    ref = {"grads": grads(w=[3.0, 4.0]), "loss": 2.0}
    same = compare_grads(ref, {"grads": grads(w=[3.0, 4.0]), "loss": 2.5}, 1e-6,
                         extra={"loss_abs_diff": 0.0})
    assert same.ok and same.message == ""
    assert list(same.metrics.items()) == [("loss", 2.5), ("loss_abs_diff", 0.0),
                                          ("grad_max_abs_diff", 0.0), ("grad_max_rel_diff", 0.0)]
    assert list(compare_grads(ref, ref, 1e-6, reported={}).metrics) == ["grad_max_abs_diff",
                                                                       "grad_max_rel_diff"]


def test_compare_grads_fails_beyond_a_tolerance_or_an_own_limit_and_on_nan():
    ref = {"grads": grads(w=[3.0, 4.0]), "loss": 2.0}
    off = {"grads": grads(w=[3.0, 4.5]), "loss": 2.0}  # normwise 0.5 / 5 = 0.1
    assert compare_grads(ref, off, 0.1).ok and not compare_grads(ref, off, 0.09).ok
    assert compare_grads(ref, off, 0.09).message == "gradients max relative 1.00e-01 (<= 0.09)"
    loose = compare_grads(ref, ref, 0.1, extra={"loss_rel_diff": 0.5}, limits={"loss_rel_diff": 0.4})
    assert not loose.ok and loose.message.endswith("loss_rel_diff 5.00e-01 (<= 0.4)")
    assert compare_grads(ref, ref, 0.1, extra={"loss_rel_diff": 0.5}, limits={"loss_rel_diff": 1}).ok
    bad = {"grads": grads(w=[3.0, np.nan]), "loss": 2.0}
    assert not compare_grads(ref, bad, 1.0).ok
    assert not compare_grads(ref, ref, 1.0, extra={"loss_rel_diff": math.nan}).ok


# --- CopyAdamW: AdamW on master (another dtype) or host (another device) copies of the weights

def adamw_steps(params: list[torch.Tensor], make, num_steps: int = 3) -> list[torch.Tensor]:
    """`num_steps` steps of the optimizer `make(params)` with fixed seeded gradients (values bf16
    holds exactly, so a bf16 weight and an fp32 copy of it get the same ones)."""
    opt, gen = make(params), torch.Generator().manual_seed(0)
    for _ in range(num_steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(torch.bfloat16).to(p.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params


def test_master_copies_update_in_fp32_and_round_into_the_16_bit_weights():
    start = torch.randn(64, generator=torch.Generator().manual_seed(1))
    weight = [torch.nn.Parameter(start.to(torch.bfloat16))]
    opt = CopyAdamW(weight, 1e-2, dtype=torch.float32)
    assert opt.copies[0].dtype == torch.float32 and opt.staging == [None]
    assert torch.equal(opt.copies[0], weight[0].float())
    adamw_steps(weight, lambda _: opt)
    # the same steps by hand: AdamW on an fp32 copy fed the upcast bf16 gradients
    master = [torch.nn.Parameter(start.to(torch.bfloat16).float())]
    adamw_steps(master, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert torch.equal(weight[0], master[0].detach().to(torch.bfloat16))
    assert torch.equal(opt.copies[0], master[0])  # the fp32 update is kept, not the rounded one
    assert opt.bytes_per_step == 2 * 64 * 2  # bf16 gradients in, bf16 weights out


def test_host_copies_stage_the_gradients_and_give_plain_adamws_weights():
    start = torch.randn(32, generator=torch.Generator().manual_seed(2))
    weight, plain = [torch.nn.Parameter(start.clone())], [torch.nn.Parameter(start.clone())]
    opt = CopyAdamW(weight, 1e-2, device="cpu")
    staging = opt.staging[0]
    adamw_steps(weight, lambda _: opt)
    adamw_steps(plain, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert torch.equal(weight[0], plain[0]) and opt.staging[0] is staging  # allocated once
    assert len(opt.state_tensors()) == 1 + 3  # the copy, two moments and the step counter


# --- fp16 with a GradScaler: an overflowing step is skipped and the scale halves ----------------

def fp16_trainer() -> Trainer:
    """A very small decoder (fp16 matmuls are emulated, slowly, on CPUs without AVX-512 FP16)."""
    overrides = {**TINY_TRAIN, "device": "cpu", "variant": "fp16", "hidden_size": 32,
                 "num_heads": 2, "num_kv_heads": 1, "num_layers": 1}
    return mixed_precision.precision_step(
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
    report = mixed_precision.report(trainer)
    assert report["loss_scale"] == 2.0**99 and report["skipped_steps"] == 1


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
    return mixed_precision.train(mixed_precision.precision_step(cfg), 3)


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


def test_global_relative_difference_weighs_every_tensor_together():
    """A zero-initialised bias that moved by ±lr, its sign flipped: 2.0 relative on its own,
    negligible against the whole model's weights."""
    from labkit.blocks.training import global_relative_difference
    ref = {"w": np.ones(100), "b": np.full(4, 1e-3)}
    got = {"w": np.ones(100), "b": -np.full(4, 1e-3)}
    assert gradient_difference(ref, got)[1] == pytest.approx(2.0)
    assert global_relative_difference(ref, got) == pytest.approx(math.sqrt(4 * 2e-3**2 / (100 + 4e-6)))
    assert global_relative_difference(ref, ref) == 0.0
    assert math.isnan(global_relative_difference(ref, {**got, "w": np.full(100, np.nan)}))


def test_total_norm_over_gradients_on_two_meshes_is_the_plain_norm(tmp_path):
    """Tensor-parallel gradients live on the (dp, tp) mesh, the norms' weights on dp's alone
    (FSDP2 over TP): their norms are made whole before they are stacked."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
        a, b = torch.arange(6.0).reshape(2, 3), torch.tensor([3.0, 4.0])
        params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(2))]
        params[0].grad = distribute_tensor(a, mesh, [Shard(0), Shard(1)])
        params[1].grad = distribute_tensor(b, mesh["dp"], [Replicate()])
        norm = total_norm(params)
    finally:
        dist.destroy_process_group()
    assert norm == pytest.approx(math.sqrt(float((a ** 2).sum() + (b ** 2).sum())))
