"""The planner's fine-tuning terms (labkit.planner.finetune_memory and `labkit plan --finetune`):
trainable parameters against the formula and PEFT, NF4 bytes against torchao's storage, the
activations a frozen model keeps against saved-tensor hooks on PEFT's model, and the frontier."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import pytest
import torch

from labkit import planner
from labkit.cli import main
from labkit.config import MODELS, ConfigError
from labkit.measure.memory import storage_bytes

TINY, REF = MODELS["tiny"], MODELS["reference"]


def peft_or_skip():
    return pytest.importorskip("peft", reason="peft missing: pip install labkit[finetune]")


def nf4_or_skip():
    pytest.importorskip("torchao", reason="torchao missing: pip install labkit[finetune]")
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    return to_nf4


# --- Targets and trainable parameters -------------------------------------------------------------

def test_targets_parse_aliases_and_refuse_unknown_names():
    assert planner.parse_lora_targets("v,q") == ("q", "v")
    assert planner.parse_lora_targets("attn") == ("q", "k", "v", "o")
    assert planner.parse_lora_targets(("all",)) == planner.LORA_TARGET_NAMES
    with pytest.raises(ConfigError, match="valid: q, k, v, o, gate, up, down, attn, all"):
        planner.parse_lora_targets("q,mlp")
    with pytest.raises(ConfigError, match="valid: wq, wk|valid: q, k, v, o, up, down"):
        planner.lora_module_names(MODELS["gpt2-124m"], "gate")


@pytest.mark.parametrize("targets,rank", [("q,v", 8), ("attn", 4), ("all", 16), ("down", 1)])
def test_trainable_params_is_rank_times_in_plus_out(targets, rank):
    d, q, kv, f = 256, 256, 128, 688  # tiny: 4 heads x 64, 2 kv heads
    widths = {"q": q + d, "k": kv + d, "v": kv + d, "o": d + q, "gate": f + d, "up": f + d, "down": d + f}
    want = TINY.num_layers * rank * sum(widths[t] for t in planner.parse_lora_targets(targets))
    assert planner.trainable_params(TINY, "lora", lora_rank=rank, lora_targets=targets) == want
    assert planner.trainable_params(TINY, "full") == planner.num_params(TINY)


def test_llama_2_7b_lora_r8_on_q_v_trains_4_194_304_params():
    # 32 layers x 2 targets x 8 x (4096 + 4096)
    assert planner.trainable_params(MODELS["llama-2-7b"], "lora", lora_rank=8, lora_targets="q,v") == 4_194_304


@pytest.mark.slow  # peft's import (with transformers', 4 s here): `-m "not slow"` never pays it
@pytest.mark.parametrize("targets,rank", [("q,v", 8), ("all", 4), ("k,up", 2)])
def test_trainable_params_equal_peft_on_labkits_decoder(targets, rank):
    peft = peft_or_skip()
    from labkit.blocks.model import build_model

    model = peft.get_peft_model(build_model(REF), peft.LoraConfig(
        r=rank, target_modules=planner.lora_module_names(REF, targets)))
    counted = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert counted == planner.trainable_params(REF, "lora", lora_rank=rank, lora_targets=targets)


# --- NF4 storage ----------------------------------------------------------------------------------

def test_nf4_scaler_block_is_the_largest_power_that_divides_the_blocks():
    assert planner.nf4_scaler_block(256 * 256) == 256  # 1024 blocks
    assert planner.nf4_scaler_block(688 * 256) == 64  # 2752 = 64 x 43 blocks
    assert planner.nf4_scaler_block(344 * 128) == 16  # 688 = 16 x 43 blocks
    with pytest.raises(ConfigError, match="NF4 blocks of 64"):
        planner.nf4_scaler_block(100)


def preset_shapes():
    return sorted({shape for m in (TINY, REF) for shape in planner.linear_shapes(m).values()})


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("shape", preset_shapes() + [(4, 64), (2, 32)])
def test_nf4_bytes_equal_torchaos_inner_storage(shape, dtype):
    to_nf4 = nf4_or_skip()
    out_f, in_f = shape
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    t = to_nf4(torch.randn(out_f, in_f, dtype=torch_dtype), 64, planner.nf4_scaler_block(out_f * in_f))
    names, _ = t.__tensor_flatten__()
    stored = sum(getattr(t, n).untyped_storage().nbytes() for n in names)
    assert planner.nf4_bytes(out_f, in_f, dtype=dtype) == stored


def test_nf4_bits_per_weight_follow_the_qlora_paper():
    # 4 bits + 32/64 without double quantization; + 8/64 + 32/(64·256) with it (fp32 factors)
    n = 4096 * 4096
    assert planner.nf4_bytes(4096, 4096, double_quant=False) * 8 / n == 4.5
    with_dq = planner.nf4_bytes(4096, 4096) * 8 / n
    assert abs(with_dq - (4 + 8 / 64 + 32 / (64 * 256))) < 1e-4


def test_nf4_dequantization_peak_equals_the_measured_one():
    to_nf4 = nf4_or_skip()
    from labkit.measure.memory import LiveTensorTracker

    w = to_nf4(torch.randn(688, 256), 64, planner.nf4_scaler_block(688 * 256))
    tracker = LiveTensorTracker()
    with tracker:
        w.to(torch.float32)
    assert tracker.peak_bytes == planner.nf4_dequant_bytes(688, 256, dtype="fp32")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(688, 256), (256, 688), (128, 100)])  # 100: a short last group
def test_weight_only_dequantization_peak_equals_the_measured_one(scheme, shape):
    """What one matmul's dequantization holds, forward and backward (`FrozenMatmul`), byte for
    byte against the planner's term."""
    from labkit.blocks import quant
    from labkit.blocks.lora import FrozenMatmul
    from labkit.measure.memory import LiveTensorTracker

    w = torch.randn(*shape)
    holder = quant.Int8Linear(w, None, False) if scheme == "int8" else quant.Int4Linear(w, None, 64, False)
    x = torch.randn(8, shape[1], requires_grad=True)
    with LiveTensorTracker() as tracker:
        y = FrozenMatmul.apply(x, holder)
        forward = tracker.peak_bytes
        grad = torch.ones_like(y)
        tracker.reset_peak()
        start = tracker.current_bytes
        y.backward(grad)
        backward = tracker.peak_bytes - start
    assert forward == backward == planner.weight_only_dequant_bytes(*shape, scheme, dtype="fp32")


@pytest.mark.parametrize("method", ["lora_int8", "lora_int4"])
def test_a_weight_only_base_stores_the_planners_bytes(method):
    from labkit.blocks import lora
    from labkit.blocks.model import build_model

    model = build_model(TINY)
    lora.apply_weight_only(model, planner.BASE_FORMAT[method])
    stored = lora.linear_weights(model)
    assert {t.dtype for t in stored} == ({torch.int8, torch.bfloat16} if method == "lora_int8"
                                         else {torch.uint8, torch.bfloat16})
    assert storage_bytes(stored) == planner.linear_weight_bytes(TINY, method)
    assert not any(p.requires_grad and p.ndim == 2 for n, p in model.named_parameters() if ".layers." in f".{n}")


def test_the_int8_base_question_states_the_planners_bytes():
    """finetune-09's figures, from the planner at llama-2-7b (bf16 compute)."""
    from labkit.study.quiz import load_bank

    q = next(q for q in load_bank() if q.id == "finetune-09")
    m, gib = MODELS["llama-2-7b"], lambda b: f"{b / 2**30:.2f} GiB"
    shapes = planner.linear_shapes(m).values()
    stored = {method: planner.linear_weight_bytes(m, method, compute_dtype="bf16")
              for method in ("lora", "lora_int8", "lora_int4", "qlora")}
    text = q.question + q.explanation + "".join(q.choices)
    for figure in (f"{m.num_layers * sum(o * i for o, i in shapes):,} weights", gib(stored["lora"]),
                   f"= {2 * m.num_layers * sum(o for o, _ in shapes):,} bytes more",
                   f"{stored['lora_int8']:,} bytes = {gib(stored['lora_int8'])}",
                   f"takes {gib(stored['lora_int4'])}, NF4 {gib(stored['qlora'])}"):
        assert figure in text, figure
    assert q.choices[q.answer] == gib(stored["lora_int8"])


# --- The memory terms -----------------------------------------------------------------------------

def lora_plan(method="lora", m=TINY, **kw):
    return planner.finetune_memory(m, method=method, batch_size=2, seq_len=64, device="cpu", **kw)


def test_frozen_weights_hold_no_gradients_or_optimizer_state():
    plan = lora_plan(lora_targets="all", lora_rank=4)
    n = planner.trainable_params(TINY, "lora", lora_rank=4, lora_targets="all")
    assert plan.trainable_params == n
    assert plan.grad_bytes == 4 * n  # fp32 adapters' gradients only
    # AdamW's m and v in fp32, and a step counter for each of the 7 targets' A and B per layer
    assert plan.optimizer_bytes == 8 * n + 4 * 2 * 7 * TINY.num_layers
    full = lora_plan("full")
    assert full.optimizer_bytes == 8 * planner.num_params(TINY)


def test_param_bytes_are_the_base_plus_the_adapters():
    n = planner.trainable_params(TINY, "lora")
    linears = TINY.num_layers * planner.block_linear_params(TINY, biases=False)
    lora, qlora = lora_plan(), lora_plan("qlora")
    assert lora.param_bytes == 4 * planner.num_params(TINY) + 4 * n
    nf4 = TINY.num_layers * sum(planner.nf4_bytes(o, i) for o, i in planner.linear_shapes(TINY).values())
    assert qlora.linear_weight_bytes == nf4
    assert qlora.param_bytes == 4 * (planner.num_params(TINY) - linears) + nf4 + 4 * n
    assert qlora.linear_weight_bytes <= 0.145 * lora.linear_weight_bytes


@pytest.mark.slow  # peft's import, as above
@pytest.mark.parametrize("targets", ["q,v", "all", "gate", "o", "down"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_activations_equal_what_autograd_saves_in_peft(targets, dtype):
    from labkit.blocks import lora
    from labkit.blocks.model import build_model
    from labkit.measure.memory import SavedTensorMeter

    peft_or_skip()
    model = lora.apply_lora(build_model(TINY, dtype=dtype), planner.parse_lora_targets(targets),
                            rank=8, alpha=16)
    meter = SavedTensorMeter(exclude=list(model.parameters()))
    with meter:
        model(torch.randint(0, TINY.vocab_size, (2, 64)))
    r = planner._resolve(TINY, batch_size=2, seq_len=64, device="cpu",
                         precision="fp32" if dtype == torch.float32 else "bf16")
    t = planner.parse_lora_targets(targets)
    first = planner._lora_layer_bytes(r, t, 8, grad_in=False)[0]
    rest = planner._lora_layer_bytes(r, t, 8, grad_in=True)[0]
    # the forward alone: no loss, so the final norm but not the log-probabilities
    want = 128 * (first + 3 * rest + planner._kept_norm_bytes(r)) + planner._embedding_side_bytes(r)
    assert meter.total_bytes == want


def test_checkpointing_keeps_only_block_inputs_and_lora_keeps_less_than_full():
    none, ckpt = lora_plan(), lora_plan(checkpointing="full")
    assert ckpt.activation_bytes_per_layer == 2 * 64 * 4 * TINY.hidden_size
    assert ckpt.activation_bytes < none.activation_bytes < lora_plan("full").activation_bytes
    with pytest.raises(ConfigError, match="valid: none, full"):
        lora_plan(checkpointing="selective")


def test_frontier_orders_full_lora_qlora():
    m = MODELS["llama-2-7b"]
    rows = planner.finetune_frontier(m, gpu_mem_bytes=12 * 2**30, seq_len=1024)
    by = {(r["method"], r["checkpointing"]): r for r in rows}
    for ckpt in planner.FINETUNE_CHECKPOINTING:  # fewer bytes a base weight, more fits
        for chain in (("full", "lora", "lora_int8", "qlora"), ("lora_int8", "lora_int4")):
            seqs = [by[(method, ckpt)]["max_seq_len"] for method in chain]
            batches = [by[(method, ckpt)]["max_micro_batch"] for method in chain]
            assert seqs == sorted(seqs) and batches == sorted(batches)
    row = by[("qlora", "none")]
    fits = lambda s: planner.finetune_memory(m, method="qlora", batch_size=1, seq_len=s,  # noqa: E731
                                             compute_dtype="bf16", device="cuda").total_bytes <= 12 * 2**30
    assert 0 < row["max_seq_len"] < m.max_seq_len
    assert fits(row["max_seq_len"]) and not fits(row["max_seq_len"] + 1)


# --- The command line -----------------------------------------------------------------------------

def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


def test_cli_plan_finetune_json_has_trainable_params_at_the_top():
    rc, out, _ = run_cli(["plan", "--finetune", "lora", "--lora-targets", "attn", "--json"])
    report = json.loads(out)
    assert rc == 0
    assert report["trainable_params"] == planner.trainable_params(TINY, "lora", lora_targets="attn")
    assert {"param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
            "linear_weight_bytes", "total_bytes"} <= set(report["per_gpu"])
    assert len(report["finetune_frontier"]) == 2 * len(planner.FINETUNE_METHODS)  # with and without checkpointing
    rc, text, _ = run_cli(["plan", "--finetune", "qlora"])
    assert rc == 0 and "trainable parameters" in text and "max seq" in text


@pytest.mark.parametrize("argv,valid", [
    (["--finetune", "dora"], "valid: full, lora, qlora"),
    (["--finetune", "lora", "--lora-targets", "q,mlp"], "valid: q, k, v, o, gate, up, down"),
    (["--finetune", "lora", "--lora-rank", "0"], "positive integer"),
])
def test_cli_bad_finetune_values_exit_2_with_one_line(argv, valid):
    rc, out, err = run_cli(["plan", *argv])
    assert rc == 2 and out == "" and valid in err and err.count("\n") == 1


def test_plain_plan_is_unchanged_by_the_finetune_flags():
    plain = planner.plan_report(model="tiny")
    assert "trainable_params" not in plain and "finetune_frontier" not in plain
    assert dataclasses.fields(planner.MemoryPlan)[-1].default == 0
