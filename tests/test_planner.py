"""The memory planner (labkit.planner.training_memory and `labkit plan`) against the papers'
formulas, computed here independently from their definitions, and against what one training
step of our model holds on the CPU (fp32 and tiny: bf16 is slow on CPUs without AVX-512 BF16).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import torch

from labkit import planner
from labkit.cli import main
from labkit.config import MODELS, ConfigError, RunConfig, resolve
from labkit.measure.memory import ActivationMeter, MemoryMeter, storage_bytes
from labkit.blocks.model import build_model
from labkit.techniques import mixed_precision
from labkit.techniques.checkpointing import apply_checkpointing
from labkit.techniques.kv_cache import DynamicCache
from labkit.blocks.training import Trainer

GIB = 2**30
TINY = MODELS["tiny"]
# A GPT-2-style block small enough for the CPU: LayerNorm with biases, GELU, learned positions.
TINY_GPT2 = dataclasses.replace(MODELS["gpt2-124m"], num_layers=2, hidden_size=64, num_heads=2,
                                num_kv_heads=2, ffn_size=256, vocab_size=512, max_seq_len=256)


def run_config(overrides: dict, cls=RunConfig, model=None):
    cfg = resolve(cls, "tiny", {"device": "cpu", **overrides})
    return dataclasses.replace(cfg, model=model) if model is not None else cfg


# --- The papers' formulas, written here from their definitions ------------------------------------

def paper_activations_per_layer(s, b, h, a, t=1, sp=False, recompute="none"):
    """Korthikanti et al. 2022, section 4 and table 2 (bytes, fp16, dropout masks of 1 byte).
    Attention: QKV input 2sbh, Q and K 4sbh, softmax 2as²b, its dropout mask as²b, dropout output
    2as²b, V 2sbh, projection input 2sbh, dropout mask sbh: 11sbh + 5as²b. MLP: 2sbh + 8sbh +
    8sbh + sbh = 19sbh. Two layernorms: 4sbh. Tensor parallel: 10sbh stay whole (the layernorms'
    4sbh, two dropout masks 2sbh, the inputs of QKV and of the first MLP linear 4sbh)."""
    if recompute == "full":
        return 2 * s * b * h
    whole, split = (0, 34 * s * b * h) if sp else (10 * s * b * h, 24 * s * b * h)
    core = 5 * a * s * s * b
    if recompute == "selective":
        return whole + split / t
    return whole + (split + core) / t


@pytest.mark.parametrize("s,b,h,a,t,sp,recompute", [
    (2048, 1, 12288, 96, 1, False, "none"),  # GPT-3 175B's shape
    (2048, 4, 12288, 96, 8, False, "none"),
    (2048, 4, 12288, 96, 8, True, "none"),
    (2048, 1, 20480, 128, 8, False, "selective"),  # MT-NLG 530B's shape
    (2048, 1, 20480, 128, 8, True, "selective"),
    (1024, 2, 4096, 32, 4, False, "full"),
])
def test_korthikanti_formulas_match_the_paper(s, b, h, a, t, sp, recompute):
    got = planner.korthikanti_activation_bytes(s=s, b=b, h=h, a=a, L=3, t=t,
                                               sequence_parallel=sp, recompute=recompute)
    assert got == pytest.approx(3 * paper_activations_per_layer(s, b, h, a, t, sp, recompute))
    if t == 1 and recompute == "none":  # the headline 34sbh + 5as²b
        assert got == 3 * (34 * s * b * h + 5 * a * s * s * b)


def paper_zero_bytes(psi, stage, nd, k=12, w=2):
    """ZeRO, figure 1 (w = 2-byte weights and gradients): (2 + 2 + K)Ψ; P_os 2Ψ + 2Ψ + KΨ/Nd;
    P_os+g 2Ψ + (2 + K)Ψ/Nd; P_os+g+p (2 + 2 + K)Ψ/Nd."""
    return [(w + w + k) * psi, w * psi + w * psi + k * psi / nd, w * psi + (w + k) * psi / nd,
            (w + w + k) * psi / nd][stage]


@pytest.mark.parametrize("stage,expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_stages_reproduce_the_papers_worked_example(stage, expected_gb):
    # 7.5B parameters, Nd = 64, mixed-precision Adam (K = 12): the paper's 120, 31.4, 16.6, 1.9 GB.
    states = sum(planner.zero_model_state_bytes(7_500_000_000, stage=stage, dp=64,
                                                precision="bf16_weights", optimizer="adam"))
    assert states == pytest.approx(paper_zero_bytes(7.5e9, stage, 64))
    assert round(states / 1e9, 1) == expected_gb
    plan = planner.training_memory(num_params=7_500_000_000, precision="bf16_weights", optimizer="adam",
                                   zero_stage=stage, gpus=64)
    assert plan.model_states_bytes == states


@pytest.mark.parametrize("precision,optimizer,k", [
    ("bf16_weights", "adam", 12), ("bf16_weights", "adamw", 12), ("fp32", "adamw", 8),
    ("bf16_pure", "adam", 4), ("bf16", "adam", 8), ("bf16_weights", "sgd", 8), ("fp32", "sgd", 4)])
def test_optimizer_bytes_per_parameter(precision, optimizer, k):
    assert planner.optimizer_bytes_per_param(precision, optimizer) == k
    for stage in range(4):
        params, grads, states = planner.zero_model_state_bytes(1000, stage=stage, dp=8,
                                                               precision=precision, optimizer=optimizer)
        w = planner.PRECISION_BYTES[precision].weight
        assert params + grads + states == pytest.approx(paper_zero_bytes(1000, stage, 8, k, w))


# --- The model's shapes ---------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(MODELS))
def test_one_stage_holds_every_parameter_in_the_modules_order(preset):
    m = MODELS[preset]
    model = build_model(m, device="meta")
    assert planner.stage_tensors(m) == [p.numel() for p in model.parameters()]
    assert planner.stage_params(m).total == planner.num_params(m)


def test_tensor_and_pipeline_shards_add_up():
    m = MODELS["llama-3-8b"]  # 8 kv heads: tp=8 gives one each
    one = planner.stage_params(m, tp=8, first=True, last=True)
    per_layer, _ = planner.layer_params(m, planner.local_shape(m, 8))
    norms = 2 * m.hidden_size
    assert (per_layer - norms) * 8 == planner.block_linear_params(m)  # linears split, norms not
    first = planner.stage_params(m, tp=8, pp=4, first=True, last=False)
    last = planner.stage_params(m, tp=8, pp=4, first=False, last=True)
    assert first.total + last.total + 2 * 8 * per_layer == one.total  # two middle stages


# --- Activations: derived per layer, checked against what the forward leaves held ----------------

def measured_activations(cfg, mode: str = "none", **kw) -> int:
    trainer = Trainer(cfg)
    apply_checkpointing(trainer.model, mode, **kw)
    return ActivationMeter(trainer.model.parameters()).measure(trainer.forward).total_bytes


@pytest.mark.parametrize("model", [TINY, TINY_GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_activation_bytes_match_what_the_forward_holds(model, mode):
    cfg = run_config({"batch_size": 2, "seq_len": 32}, model=model)
    plan = planner.training_memory(model, batch_size=2, seq_len=32, checkpointing=mode, device="cpu")
    measured = measured_activations(cfg, mode)
    assert plan.activation_bytes == pytest.approx(measured, rel=0.01)  # byte-exact on torch 2.13
    one_layer = dataclasses.replace(model, num_layers=1)
    fewer = measured_activations(dataclasses.replace(cfg, model=one_layer), mode)
    per_layer = (measured - fewer) / (model.num_layers - 1)
    assert plan.activation_bytes_per_layer == pytest.approx(per_layer, rel=0.01)


def test_activation_bytes_of_16_bit_weights():
    # mixed: 16-bit weights, so 16-bit activations except the fp32 norm inputs, rsqrt, logsumexp
    # and log-probs. One tiny layer: bf16 matmuls are emulated, 15-70x slower, on CPUs without
    # native bf16 (AVX-512 BF16, AMX).
    m = dataclasses.replace(TINY, num_layers=1)
    cfg = run_config({"batch_size": 1, "seq_len": 16, "variant": "bf16_weights"},
                     cls=mixed_precision.Config, model=m)
    trainer = mixed_precision.precision_step(cfg)
    measured = ActivationMeter(trainer.model.parameters()).measure(trainer.forward).total_bytes
    plan = planner.training_memory(m, batch_size=1, seq_len=16, precision="bf16_weights", device="cpu")
    assert plan.activation_bytes == pytest.approx(measured, rel=0.01)


def test_partial_recomputation_keeps_plain_layers_whole():
    cfg = run_config({"batch_size": 2, "seq_len": 32})
    measured = measured_activations(cfg, "every_n", every=2)  # blocks 0 and 2 of 4
    plan = planner.training_memory(TINY, batch_size=2, seq_len=32, checkpointing="full",
                                   checkpointed_layers=2, device="cpu")
    assert plan.activation_bytes == pytest.approx(measured, rel=0.01)


def test_tensor_parallel_holds_the_embeddings_whole_gradient_at_the_backwards_end():
    # labkit's embedding is RowwiseParallel over the vocabulary: its backward makes the whole
    # V x d gradient on every rank (measured on 4 gloo ranks: test_hybrid, within 0.01%)
    m = dataclasses.replace(MODELS["tiny"], num_layers=1, num_kv_heads=4)
    kw = dict(batch_size=4, seq_len=16, device="cpu")
    one, four = planner.training_memory(m, **kw), planner.training_memory(m, tp=4, gpus=4, **kw)
    assert "embedding" not in one.phase_bytes and four.peak_phase == "embedding"
    states = four.param_bytes + four.grad_bytes + four.optimizer_bytes
    whole = 4 * m.vocab_size * m.hidden_size
    assert four.total_bytes == states + whole and four.overhead_bytes == whole
    # and the head's output is gathered: the logits and the loss span the whole vocabulary
    shape = planner.local_shape(m, 4)
    assert (shape.vocab, shape.logits) == (m.vocab_size // 4, m.vocab_size)


def test_tensor_parallel_splits_all_but_the_norms():
    m, kw = MODELS["llama-2-7b"], dict(batch_size=1, seq_len=2048, precision="bf16_pure")
    one = planner.layer_activation_bytes(m, tp=1, **kw)
    two = planner.layer_activation_bytes(m, tp=2, **kw)
    tokens, d = 2048, m.hidden_size
    norms = tokens * 2 * (4 * d + 4 + 2 * 2 * d)  # fp32 input copy, rsqrt, normalised, output
    assert one - two == (one - norms) // 2


# --- The peak of one training step, measured --------------------------------------------------------

def measured_peak(cfg, mode: str = "none", trainer_cls=Trainer) -> int:
    """Peak bytes of the second training step (the first creates AdamW's state)."""
    with MemoryMeter("cpu") as meter:
        trainer = trainer_cls(cfg)
        apply_checkpointing(trainer.model, mode)
        trainer.step()
        meter.reset_peak()
        trainer.step()
        return meter.peak_bytes


PEAK_CASES = [  # (batch, seq, checkpointing, precision, layers, vocab): each moment of the peak
    (4, 64, "none", "fp32", 4, 4096),  # the backward's start: activations + the loss's gradients
    (1, 64, "none", "fp32", 4, 4096),  # the optimizer step: gradients + Adam's temporaries
    (4, 128, "selective", "fp32", 4, 4096),
    (4, 128, "full", "fp32", 2, 4096),
    (4, 128, "full", "fp32", 2, 512),  # a small vocabulary: the last block's recomputed backward
    (4, 32, "none", "bf16_weights", 1, 4096),  # 16-bit weights, fp32 master weights
]


@pytest.mark.parametrize("batch,seq,mode,precision,layers,vocab", PEAK_CASES)
@pytest.mark.slow
def test_predicted_peak_is_within_10_percent_of_the_measured_one(batch, seq, mode, precision, layers,
                                                                  vocab):
    overrides = {"batch_size": batch, "seq_len": seq, "num_layers": layers, "vocab_size": vocab}
    if precision == "bf16_weights":
        cfg = run_config({**overrides, "variant": "bf16_weights"}, cls=mixed_precision.Config)
        measured = measured_peak(cfg, mode, mixed_precision.precision_step)
    else:
        measured = measured_peak(run_config(overrides), mode)
    plan = planner.training_memory(dataclasses.replace(TINY, num_layers=layers, vocab_size=vocab),
                                   batch_size=batch,
                                   seq_len=seq, precision=precision, optimizer="adamw",
                                   checkpointing=mode, device="cpu")
    print(f"tiny L={layers} V={vocab} b={batch} s={seq} {mode} {precision}: measured {measured} "
          f"predicted {plan.total_bytes} ratio {plan.total_bytes / measured:.4f} ({plan.peak_phase})")
    assert plan.total_bytes == pytest.approx(measured, rel=0.10)


# --- The timeline -----------------------------------------------------------------------------------

def test_total_is_the_larger_phase_and_sums_what_it_holds():
    for batch in (1, 64):
        plan = planner.training_memory(TINY, batch_size=batch, seq_len=256, device="cpu")
        assert plan.total_bytes == max(plan.phase_bytes.values())
        assert plan.total_bytes == sum(getattr(plan, f"{t}_bytes") for t in plan.held_at_peak)
        assert plan.model_states_bytes == plan.param_bytes + plan.grad_bytes + plan.optimizer_bytes
    assert planner.training_memory(TINY, batch_size=1, seq_len=16).peak_phase == "step"
    assert planner.training_memory(TINY, batch_size=64, seq_len=256).peak_phase == "backward"


def test_accumulation_keeps_gradients_through_the_backward():
    kw = dict(batch_size=8, seq_len=256, device="cpu")
    one, many = planner.training_memory(TINY, **kw), planner.training_memory(TINY, accumulation_steps=4, **kw)
    assert "grad" not in one.held_at_peak and "grad" in many.held_at_peak
    assert many.total_bytes - one.total_bytes <= one.grad_bytes


def test_first_pipeline_stage_holds_a_micro_batch_per_stage():
    m, kw = MODELS["llama-2-7b"], dict(batch_size=1, seq_len=2048, precision="bf16_weights", gpus=4)
    plan = planner.training_memory(m, pp=4, **kw)
    layer = planner.training_memory(m, **kw).activation_bytes_per_layer
    rope = 2 * 2048 * m.head_dim * 4
    assert plan.stage == "first"
    assert plan.activation_bytes == 4 * (8 * layer + rope)  # 4 in flight x 32/4 layers


# --- The KV cache -----------------------------------------------------------------------------------

def test_kv_cache_is_bytes_per_token_times_tokens_and_what_a_cache_holds():
    m, batch, seq = dataclasses.replace(TINY, num_layers=2), 2, 24
    expected = planner.kv_bytes_per_token(m, "float32") * batch * seq
    assert planner.kv_cache_bytes(m, batch_size=batch, seq_len=seq, precision="fp32") == expected
    cache = DynamicCache(m.num_layers)
    with torch.no_grad():
        build_model(m)(torch.zeros(batch, seq, dtype=torch.long), cache=cache)
    assert storage_bytes(cache.tensors()) == expected
    big = MODELS["llama-3-70b"]  # 8 kv heads: tp=8 holds one each, tp=16 still one (replicated)
    full = planner.kv_cache_bytes(big, batch_size=1, seq_len=1, precision="bf16")
    assert planner.kv_cache_bytes(big, batch_size=1, seq_len=1, precision="bf16", tp=8) == full // 8
    assert planner.kv_cache_bytes(big, batch_size=1, seq_len=1, precision="bf16", tp=16) == full // 8


# --- The recommendation ----------------------------------------------------------------------------

def test_recommended_plan_fits_where_plain_fp32_does_not():
    m, mem = MODELS["llama-2-7b"], 24 * GIB
    rec = planner.recommend(m, effective_batch=32, seq_len=2048, gpus=4, gpu_mem_bytes=mem)
    assert rec.fits and rec.total_bytes <= mem
    assert rec.micro_batch * rec.accumulation_steps * 4 == 32
    again = planner.training_memory(m, batch_size=rec.micro_batch, seq_len=2048, gpus=4,
                                    precision=rec.precision, checkpointing=rec.checkpointing,
                                    zero_stage=rec.zero_stage, accumulation_steps=rec.accumulation_steps,
                                    device="cuda")
    assert again.total_bytes == rec.total_bytes
    plain = planner.training_memory(m, batch_size=8, seq_len=2048, gpus=4, precision="fp32", device="cuda")
    assert plain.total_bytes > mem


def test_nothing_fits_is_an_answer():
    rec = planner.recommend(MODELS["llama-3-70b"], effective_batch=1, seq_len=2048, gpus=1,
                            gpu_mem_bytes=24 * GIB)
    assert not rec.fits and "nothing" in rec.reason


# --- `labkit plan` ----------------------------------------------------------------------------------

def call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_plan_json_has_every_field_and_not_fitting_exits_0():
    rc, out, err = call(["plan", "--model", "llama-2-7b", "--gpus", "4", "--gpu-mem-gib", "24",
                         "--precision", "fp32", "--batch-size", "8", "--json"])
    assert rc == 0 and err == ""
    report = json.loads(out)
    assert len(out.strip().splitlines()) == 1
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes", "model_states_bytes",
                "activation_bytes", "kv_cache_bytes", "total_bytes"):
        assert isinstance(report["per_gpu"][key], int), key
    assert report["fits"] is False and report["recommendation"]["fits"] is True
    assert report["num_params"] == planner.num_params(MODELS["llama-2-7b"])
    assert report["kv_cache_bytes_per_token"] == planner.kv_bytes_per_token(MODELS["llama-2-7b"], "float32")
    assert report["per_gpu"]["kv_cache_bytes"] == 8 * 2048 * report["kv_cache_bytes_per_token"]


def test_plan_from_a_bare_parameter_count():
    rc, out, _ = call(["plan", "--params", "7.5e9", "--gpus", "64", "--zero-stage", "3", "--json"])
    report = json.loads(out)
    assert rc == 0 and report["num_params"] == 7_500_000_000
    assert report["per_gpu"]["model_states_bytes"] == pytest.approx(paper_zero_bytes(7.5e9, 3, 64))
    assert report["per_gpu"]["activation_bytes"] == 0


def test_plan_prints_a_table_with_formulas():
    rc, out, _ = call(["plan", "--model", "gpt2-124m", "--seq-len", "1024", "--zero-stage", "1",
                       "--gpus", "2", "--checkpointing", "selective"])
    assert rc == 0
    for text in ("parameters", "gradients", "optimizer states", "activations", "overhead",
                 "total (peak)", "K = 12", "fits", "recommended", "KV cache"):
        assert text in out, text


@pytest.mark.parametrize("argv,says", [
    (["--batch-size", "-1"], "batch_size"),
    (["--seq-len", "0"], "seq_len"),
    (["--params", "-7e9"], "params"),
    (["--model", "gpt-5"], "valid: tiny"),
    (["--zero-stage", "5"], "valid: 0, 1, 2, 3"),
    (["--model", "tiny", "--pp", "8"], "4 layers"),
    (["--model", "llama-2-7b", "--tp", "3"], "heads"),
    (["--precision", "fp8"], "valid: fp32"),
    (["--optimizer", "lion"], "valid: adam"),
    (["--checkpointing", "some"], "valid: none"),
    (["--gpu-mem-gib", "-24"], "gpu_mem_gib"),
])
def test_bad_input_is_one_line_and_exit_2(argv, says):
    rc, out, err = call(["plan", *argv])
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("labkit: error: ") and says in err


def test_training_memory_refuses_bad_input():
    for kw in ({"batch_size": 0}, {"zero_stage": 4}, {"tp": 3}, {"pp": 5}, {"gpus": 3, "tp": 2},
               {"checkpointing": "every_n"}, {"checkpointed_layers": 9, "checkpointing": "full"}):
        with pytest.raises(ConfigError):
            planner.training_memory(TINY, **kw)
    with pytest.raises(ConfigError):
        planner.training_memory()


def test_sequence_parallel_is_planned_for_whole_pieces_of_the_sequence_without_checkpointing():
    m = MODELS["tiny"]
    with pytest.raises(ConfigError, match="multiple of tp"):
        planner.training_memory(m, batch_size=1, seq_len=33, tp=2, gpus=2, sequence_parallel=True)
    with pytest.raises(ConfigError, match="without checkpointing"):
        planner.training_memory(m, batch_size=1, seq_len=32, tp=2, gpus=2, sequence_parallel=True,
                                checkpointing="full")
