"""The finetune experiment's mechanisms on the CPU: B = 0 logits, the frozen base bitwise, the
adapters' gradients by hand, NF4's error bound and bytes, trainable parameters against the
planner, skips without the libraries, and the frontier's ordering."""
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import needs

from labkit import planner
from labkit.blocks import lora
from labkit.blocks.model import build_model
from labkit.config import ConfigError, resolve
from labkit.measure.memory import storage_bytes
from labkit.techniques import finetune

# peft's import (3 to 4 s here, paid by a worker's first test here) makes every test here slow:
# `-m "not slow"` never imports it
pytestmark = [needs("peft", "torchao"), pytest.mark.slow]

SMALL = {"batch_size": 1, "seq_len": 16, "steps": 2, "num_layers": 2, "compute": "fp32"}


def config(variant: str, **kw):
    return resolve(finetune.Config, "tiny", {**SMALL, "variant": variant, **kw}, experiment="finetune")


@pytest.mark.parametrize("variant", ["lora", "qlora", "lora_ckpt"])
@pytest.mark.slow
def test_checks_pass_in_fp32_with_exact_init_and_frozen_base(variant):
    cfg = config(variant)
    out = finetune.build(cfg).check()
    assert out["init_logits_equal"] == 1.0 and out["base_unchanged"] == 1.0
    assert out["adapter_grad_rel_diff"] <= finetune.GRAD_TOLERANCE["float32"]
    assert finetune.compare({}, out, cfg).ok


@pytest.mark.slow
def test_a_changed_base_or_a_wrong_gradient_fails_the_comparison():
    cfg = config("lora")
    good = finetune.build(cfg).check()
    assert not finetune.compare({}, {**good, "base_unchanged": 0.0}, cfg).ok
    assert not finetune.compare({}, {**good, "adapter_grad_rel_diff": 1e-2}, cfg).ok


def test_lora_forward_is_the_base_plus_the_scaled_low_rank_update_by_hand():
    model = build_model(config("lora").model)
    lora.apply_lora(model, ("q",), rank=4, alpha=8.0)
    base, A, B, s = next(lora.adapters(model))
    with torch.no_grad():
        B.weight.normal_()  # B != 0, so the update shows
    x = torch.randn(3, base.in_features)
    layer = model.layers[0].attn.wq
    by_hand = x @ (base.weight + s * B.weight @ A.weight).T
    assert s == 8.0 / 4
    torch.testing.assert_close(layer(x), by_hand, rtol=1e-5, atol=1e-6)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_adapter_gradients_match_autograd_on_a_hand_built_weight():
    cfg = config("lora", steps=1)
    trainer, _ = finetune.finetune_step(cfg)
    trainer.step()  # B moves off zero
    diff = finetune.adapter_grad_difference(trainer)
    assert diff <= 1e-5
    assert all(p.grad is None for p in trainer.model.parameters())  # dropped afterwards


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_lora_on_a_weight_only_base_trains_as_lora_on_its_dequantized_weights(scheme):
    """The int8 / int4 base (`apply_weight_only`) against a plain model holding the same
    dequantized weights: equal loss, and equal gradients for every adapter (those of the first
    block reach it through every later block's input gradient, `FrozenMatmul.backward`)."""
    cfg = config("lora")
    quantized = build_model(cfg.model)
    plain = build_model(cfg.model)
    plain.load_state_dict(quantized.state_dict())
    lora.apply_weight_only(quantized, scheme)
    with torch.no_grad():
        for (_, q), (_, p) in zip(lora.block_linears(quantized), lora.block_linears(plain)):
            p.weight.copy_(q.quantized.dequantize(torch.float32))
    grads = []
    for model in (quantized, plain):
        torch.manual_seed(0)  # the same adapters' initialisation
        lora.apply_lora(model, ("q", "v"), rank=4, alpha=8.0)
        for _, _, B, _ in lora.adapters(model):
            torch.nn.init.normal_(B.weight, std=0.02)  # B != 0: gradients reach A
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads.append((loss.item(), [p.grad for n, p in model.named_parameters() if p.requires_grad]))
    (loss_q, grads_q), (loss_p, grads_p) = grads
    assert loss_q == pytest.approx(loss_p, rel=1e-6) and len(grads_q) == len(grads_p) == 8
    for gq, gp in zip(grads_q, grads_p):
        torch.testing.assert_close(gq, gp, rtol=1e-5, atol=1e-7)


def test_nf4_error_stays_within_the_bound_and_the_bound_is_tight():
    model = build_model(config("qlora").model)
    ratio = lora.apply_nf4(model)
    assert 0.5 < ratio <= 1.0  # the bound holds, and is not loose by orders of magnitude
    assert lora.NF4_HALF_GAP == pytest.approx((1.0 - 0.6962) / 2)


def test_nf4_bytes_are_the_inner_tensors_storage_and_match_the_planner():
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    w = torch.randn(688, 256)
    nf4 = to_nf4(w, 64, planner.nf4_scaler_block(w.numel(), 64))
    names, _ = nf4.__tensor_flatten__()
    inner = sum(getattr(nf4, n).untyped_storage().nbytes() for n in names)
    # codes, int8 scalers, an fp32 factor per scaler block, the fp32 mean, the 16-entry fp32 LUT
    scaler_blocks = w.numel() // 64 // planner.nf4_scaler_block(w.numel(), 64)
    assert storage_bytes([nf4]) == inner == w.numel() // 2 + w.numel() // 64 + 4 * scaler_blocks + 4 + 64
    assert nf4.untyped_storage().nbytes() == w.numel() * 4  # the placeholder: never counted
    assert storage_bytes([nf4]) == planner.nf4_bytes(688, 256)


@pytest.mark.parametrize("variant,targets", [("full", "q,v"), ("lora", "q,v"), ("lora", "all"),
                                             ("qlora", "attn")])
def test_trainable_params_equal_the_planner(variant, targets):
    cfg = config(variant, lora_targets=targets)
    trainer, _ = finetune.finetune_step(cfg)
    counted = finetune.counts(trainer.model)["trainable_params"]
    assert counted == planner.trainable_params(cfg.model, finetune.method(variant), lora_rank=cfg.lora_rank,
                                               lora_targets=finetune.targets(cfg))


def test_qlora_linear_weights_are_about_four_bits():
    cfg = config("qlora")
    trainer, _ = finetune.finetune_step(cfg)
    weights = lora.linear_weights(trainer.model)
    num = sum(w.numel() for w in weights)
    bits = 8 * storage_bytes(weights) / num
    assert 4.0 < bits < 4.145 * 1.01  # 4 bits + int8 scalers per 64 + factors (+ a LUT per weight)


@pytest.mark.parametrize("variant,library", [("lora", "peft"), ("qlora", "torchao"), ("lora_ckpt", "peft")])
def test_variants_skip_with_a_reason_without_their_library(monkeypatch, variant, library):
    monkeypatch.setitem(sys.modules, library, None)  # `import library` now raises ImportError
    reason = finetune.skip_reason(config(variant))
    assert library in reason and "labkit[finetune]" in reason
    assert finetune.skip_reason(config("full")) is None


def test_bad_targets_are_refused_naming_the_valid_ones():
    finetune.validate(config("lora", lora_targets="attn"))
    with pytest.raises(ConfigError, match="valid"):
        finetune.validate(config("lora", lora_targets="q,nope"))
    with pytest.raises(ConfigError, match="valid"):
        finetune.validate(config("lora", dtype="bfloat16"))


@pytest.mark.slow
def test_frontier_orders_qlora_over_lora_over_full():
    cfg = resolve(finetune.Config, "tiny", {"batch_size": 1, "num_layers": 1, "vocab_size": 256,
                                            "hidden_size": 64, "ffn_size": 128, "max_seq_len": 256,
                                            "compute": "fp32"}, experiment="finetune")
    front = finetune.frontier(cfg, 0.002, ("full", "lora", "qlora"), seq_step=32).set_index("variant")
    found = front["max_seq_len"]
    assert found["qlora"] >= found["lora"] >= found["full"] > 0
    assert not front["capped"]["full"]
    # the search starts at the planner's answer: where that is right (and not the cap), two probes
    right = front[(front["predicted_max_seq_len"] == found) & ~front["capped"]]
    assert len(right) and (right["num_probes"] == 2).all()


@pytest.mark.slow
def test_frontier_search_finds_the_same_length_from_a_wrong_prediction(monkeypatch):
    cfg = resolve(finetune.Config, "tiny", {"batch_size": 1, "num_layers": 1, "vocab_size": 256,
                                            "hidden_size": 64, "ffn_size": 128, "max_seq_len": 256,
                                            "compute": "fp32"}, experiment="finetune")
    right = finetune.frontier(cfg, 0.002, ("full",), seq_step=32).set_index("variant")
    for scale in (0.25, 4.0):  # the planner's peak four times too high, then four times too low
        plan = finetune.plan
        monkeypatch.setattr(finetune, "plan", lambda c, n, scale=scale, plan=plan: SimpleNamespace(
            total_bytes=plan(c, n).total_bytes / scale))
        wrong = finetune.frontier(cfg, 0.002, ("full",), seq_step=32).set_index("variant")
        monkeypatch.undo()
        assert wrong["predicted_max_seq_len"]["full"] != right["max_seq_len"]["full"]
        assert wrong["max_seq_len"]["full"] == right["max_seq_len"]["full"]
        assert wrong["num_probes"]["full"] > 2
