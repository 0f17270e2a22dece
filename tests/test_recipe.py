"""The composition root (`labkit.blocks.recipe`): every recipe held to the plain step's gradients.

Single process: accumulation, checkpointing, activation offload and the empty recipe against the
plain `Trainer` (bitwise where the arithmetic is the same, fp32 rounding where the sums split),
the precisions against their tolerances, the refusals, and the order's consequences. Then ONE
launch of two gloo ranks (6-12 s) composes every parallel recipe and compares each rank's whole
gradients with the single-process plain step of the global batch; the ranks write JSON files and
the tests here read them. One compiled test (the slow one) closes the file.
"""
import itertools
import json
import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from conftest import TINY_SHAPE, TINY_TRAIN
from labkit.blocks import context_parallel, expert_parallel, moe, pipeline_recipe, ring
from labkit.blocks import recipe as recipe_module
from labkit.blocks.layout import Layout
from labkit.blocks.recipe import Recipe, compose, refusal
from labkit.blocks.training import (CopyAdamW, Trainer, global_relative_difference, gradient_difference,
                                   step_with_gradients)
from labkit.config import ConfigError, RunConfig, resolve
from labkit.techniques.mixed_precision import TOLERANCE
from labkit.techniques.zero import full_tensor

# the tiny shape, 2 layers, batch 1 x 8 tokens (RunConfig has no `steps`: a test takes its own);
# the preset's width, whose peaks the plans meet within 1-2%
CPU = {**{k: v for k, v in TINY_TRAIN.items() if k != "steps"}, **TINY_SHAPE, "device": "cpu"}
FP32_ROUNDING = 1e-6  # normwise relative: one process, a sum split differently, about 8 float32 ulps
# Across 2 ranks the sums split further: data parallelism adds two half-batch gradients, the
# row-wise split of TP sums each matmul's partial products on two ranks. Measured: DP 1.0e-6 on
# an AMD Zen 4 and 1.4e-6 on an Intel Xeon with AMX (oneDNN blocks the matmuls differently),
# TP about 1e-6. A lost, doubled or mis-scaled micro-batch, or a spoiled reduction, is 1e-2 or more.
SPLIT_ROUNDING = 5e-6
# bf16 under FSDP2 is its mixed-precision policy: the whole block in bf16 (autocast, the
# one-process reference, keeps the norms and the residual adds in fp32), the gradients reduced
# in fp32: they match autocast's within bf16's rounding (1.6e-2 measured), not fp32's
BF16_ROUNDING = 3e-2


def config(**overrides) -> RunConfig:
    return resolve(RunConfig, "tiny", {**CPU, **overrides})


def whole_grads(trainer: Trainer) -> dict:
    """fp32 host copies of the whole gradients now in `.grad` (DTensors gathered, and an expert-
    parallel rank's experts from its group: collectives)."""
    grads = {n: full_tensor(p.grad, "cpu").float() for n, p in trainer.model.named_parameters()}
    return {n: g.numpy().copy() for n, g in expert_parallel.gather_experts(trainer, grads).items()}


def one_step(trainer: Trainer) -> dict:
    """One step: its loss and the gradients it applied (bf16 ones upcast, which is exact)."""
    loss = trainer.accumulate()
    grads = whole_grads(trainer)
    trainer.update()
    return {"loss": loss, "grads": grads}


def plain(batch_size: int) -> dict:
    return one_step(Trainer(config(), batch_size=batch_size))


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes autograd saves for the backward, parameters excluded."""

    def __init__(self, params):
        resident = {p.untyped_storage().data_ptr() for p in params}
        self.num_bytes = 0

        def pack(t):
            if t.untyped_storage().data_ptr() not in resident:
                self.num_bytes += t.numel() * t.element_size()
            return t

        super().__init__(pack, lambda t: t)


def saved_bytes(trainer: Trainer) -> tuple[dict, int]:
    hooks = SavedActivations(trainer.model.parameters())
    trainer.contexts.append(lambda: hooks)
    return one_step(trainer), hooks.num_bytes


# --- single process: each transform against the plain step ---------------------------------------

@pytest.mark.slow
def test_the_empty_recipe_is_bitwise_the_plain_trainer():
    ref_trainer, trainer = Trainer(config()), compose(config(), Recipe())
    ref, got = step_with_gradients(ref_trainer), step_with_gradients(trainer)
    assert got["loss"] == ref["loss"] and gradient_difference(ref["grads"], got["grads"]) == (0.0, 0.0)
    assert type(trainer.optimizer) is torch.optim.AdamW and trainer.scaler is None and not trainer.contexts
    for a, b in zip(ref_trainer.model.parameters(), trainer.model.parameters()):
        assert torch.equal(a, b)  # the same update too


@pytest.mark.parametrize("k", [2, 3])
def test_accumulating_k_micro_batches_is_one_batch_of_k_times_b(k):
    cfg = config(batch_size=2 * k)  # the step's batch, split into k micro-batches of 2
    trainer = compose(cfg, Recipe(micro_batches=k))
    assert trainer.sizes == [2] * k and len(trainer.inputs) == 2 * k
    got, ref = one_step(trainer), one_step(Trainer(cfg))
    max_abs, max_rel = gradient_difference(ref["grads"], got["grads"])
    assert max_rel <= FP32_ROUNDING and got["loss"] == pytest.approx(ref["loss"], rel=FP32_ROUNDING)


def test_accumulation_of_one_is_bitwise_the_plain_step():
    got, ref = one_step(compose(config(), Recipe(micro_batches=1))), plain(1)
    assert gradient_difference(ref["grads"], got["grads"]) == (0.0, 0.0)


@pytest.mark.parametrize("mode, wrapped", [("full", [0, 1]), ("selective", [0, 1]), ("every_n", [0])])
def test_checkpointing_recomputes_and_is_bitwise_the_plain_step(mode, wrapped):
    trainer = compose(config(), Recipe(checkpointing=mode, checkpoint_every=2))
    assert [i for i, b in enumerate(trainer.model.layers) if hasattr(b.forward, "__wrapped__")] == wrapped
    (got, kept), (ref, kept_plain) = saved_bytes(trainer), saved_bytes(Trainer(config()))
    assert gradient_difference(ref["grads"], got["grads"]) == (0.0, 0.0)
    assert kept < kept_plain  # the wrapped blocks' activations are recomputed, not kept


def test_activation_offload_is_bitwise_and_sends_the_activations_to_the_host():
    trainer = compose(config(), Recipe(offload="activations"))
    got, ref = one_step(trainer), plain(1)
    assert gradient_difference(ref["grads"], got["grads"]) == (0.0, 0.0)
    assert trainer.host_hooks.bytes_to_host > 0  # the hooks ran (on a CPU the copy is the tensor)


# --- precision ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_bf16_checkpointing_and_accumulation_stay_within_bf16_tolerance_of_fp32():
    ref = plain(2)
    got = one_step(compose(config(batch_size=2), Recipe(precision="bf16", checkpointing="full",
                                                        micro_batches=2)))
    assert abs(got["loss"] - ref["loss"]) / abs(ref["loss"]) <= TOLERANCE["bf16"]
    assert gradient_difference(ref["grads"], got["grads"])[1] > 0  # autocast did run in bf16
    # checkpointing recomputes the same bf16 forward: bitwise the same result without it
    same = one_step(compose(config(batch_size=2), Recipe(precision="bf16", micro_batches=2)))
    assert same["loss"] == got["loss"] and gradient_difference(same["grads"], got["grads"]) == (0.0, 0.0)


@pytest.mark.slow
def test_bf16_weights_build_fp32_master_copies_of_the_bf16_weights():
    # precision before the optimizer: the copies are fp32 images of the already-rounded weights
    trainer = compose(config(), Recipe(precision="bf16_weights"))
    params = list(trainer.model.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}
    assert isinstance(trainer.optimizer, CopyAdamW)
    assert all(c.dtype == torch.float32 and torch.equal(c, p.float())
               for c, p in zip(trainer.optimizer.copies, params))
    got = one_step(trainer)
    assert abs(got["loss"] - plain(1)["loss"]) / plain(1)["loss"] <= TOLERANCE["bf16_weights"]
    assert all(torch.equal(p, c.to(torch.bfloat16)) for c, p in zip(trainer.optimizer.copies, params))


@pytest.mark.slow
def test_fp16_builds_a_grad_scaler_that_unscales_exactly_before_the_update():
    trainer = compose(config(), Recipe(precision="fp16"))
    assert isinstance(trainer.scaler, torch.amp.GradScaler)
    scale = trainer.scaler.get_scale()
    unscaled = []
    trainer.grad_hooks.append(lambda s: unscaled.append(whole_grads(s)))
    trainer.accumulate()
    scaled = whole_grads(trainer)
    trainer.update()
    # a power-of-two scale: unscaling is exact, so the gradients are the scaled ones / scale
    assert gradient_difference(unscaled[0], {n: g / scale for n, g in scaled.items()}) == (0.0, 0.0)
    assert gradient_difference(plain(1)["grads"], unscaled[0])[1] <= TOLERANCE["fp16"]
    assert compose(config(), Recipe(precision="fp16", loss_scaling=False)).scaler is None


# --- refusals -------------------------------------------------------------------------------------

UNKNOWN = [(Recipe(precision="fp8"), "valid: fp32, tf32, bf16, fp16, bf16_weights"),
           (Recipe(cp_mode="stripes"), "valid: ring, ring_zigzag, ulysses"),
           (Recipe(checkpointing="some"), "valid: none, full, every_n, selective, blocks"),
           (Recipe(zero_stage=4), "valid: 0, 1, 2, 3"),
           (Recipe(offload="disk"), "valid: none, activations, optimizer, both"),
           (Recipe(pp_schedule="dualpipe"), "valid: gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv")]
# (recipe, world, a phrase of the reason); parallel ones with torch.distributed started
REFUSED = [(Recipe(micro_batches=0), 1, "1 or more"),
           (Recipe(checkpointing="blocks"), 1, "block list"),
           (Recipe(precision="tf32"), 1, "CPU"),
           (Recipe(compile=True, offload="activations"), 1, "strides"),
           (Recipe(precision="bf16_weights", offload="optimizer"), 1, "choose one"),
           (Recipe(precision="fp16", offload="both"), 1, "param_groups")]
REFUSED_IN_DIST = [(Recipe(tensor_parallel=2), 4, "DDP cannot wrap"),
                   (Recipe(tensor_parallel=3), 4, "does not divide"),
                   (Recipe(tensor_parallel=2, zero_stage=2), 2, "leave 1: use zero_stage=0"),
                   (Recipe(zero_stage=1, offload="optimizer"), 2, "choose one"),
                   (Recipe(zero_stage=1, precision="bf16_weights"), 2, "master copies"),
                   (Recipe(zero_stage=3, offload="activations"), 2, "DTensor"),
                   (Recipe(tensor_parallel=2, offload="activations"), 2, "DTensor"),
                   (Recipe(tensor_parallel=2, precision="fp16"), 2, "DTensor refuses"),
                   (Recipe(tensor_parallel=2, offload="optimizer"), 2, "FSDP2's offload"),
                   (Recipe(zero_stage=2, offload="optimizer"), 2, "needs a GPU"),
                   # context parallel: a recipe's sequence shards (labkit.blocks.context_parallel)
                   (Recipe(context_parallel=3), 4, "does not divide the 4 ranks"),
                   (Recipe(context_parallel=2, tensor_parallel=2), 4, "DDP cannot wrap"),
                   (Recipe(context_parallel=2, packing=True), 2, "per-document mask"),
                   (Recipe(context_parallel=2, precision="bf16"), 2, "use cp_mode=ulysses"),
                   (Recipe(context_parallel=2, cp_mode="ring_zigzag", precision="bf16_weights"), 2,
                    "use cp_mode=ulysses"),
                   # expert parallel (labkit.blocks.expert_parallel); each seen on 2 gloo ranks
                   # without its refusal: ZeRO-1 overwrote rank 1's experts with rank 0's in the
                   # first update; FSDP2 gathered the ranks' different experts as one tensor
                   # (gradients 2.4 relative off); with cp=2 on 4 ranks (dropless, no aux loss)
                   # the cp pair holding the same experts went unsummed (0.82 relative off)
                   (Recipe(expert_parallel=4), 2, "use a divisor of it"),
                   (Recipe(expert_parallel=2, zero_stage=1), 2, "ZeroRedundancyOptimizer broadcasts"),
                   (Recipe(expert_parallel=2, zero_stage=3), 2, "average different experts"),
                   (Recipe(expert_parallel=2, context_parallel=2), 4, "context_parallel=1 with it"),
                   (Recipe(expert_parallel=2, tensor_parallel=2, zero_stage=2), 4,
                    "tensor_parallel=1 and context_parallel=1"),
                   # pipeline parallel (labkit.blocks.pipeline_recipe): its path composes the
                   # stages plain, so each transform below would silently not apply; fp16 was
                   # run: GradScaler's unscale_ failed, the schedule's loss never scaled
                   (Recipe(pipeline_parallel=3), 4, "does not divide the 4 ranks"),
                   *[(Recipe(pipeline_parallel=2, **{name: value}), 4, f"{name}={value} would not apply")
                     for name, value in (("tensor_parallel", 2), ("context_parallel", 2),
                                         ("expert_parallel", 2), ("zero_stage", 1), ("zero_stage", 3),
                                         ("offload", "activations"), ("compile", True),
                                         ("packing", True), ("loss", "chunked"), ("finetune", "lora"),
                                         ("grad_compression", "bf16"), ("optimizer", "adamw8bit"))],
                   (Recipe(pipeline_parallel=2, precision="fp16"), 2, "never scales the loss")]


def one_line(why):
    return isinstance(why, str) and why and "\n" not in why


@pytest.mark.parametrize("recipe, valid", UNKNOWN)
def test_an_unknown_value_is_refused_naming_the_valid_ones(recipe, valid):
    why = refusal(recipe, "cpu")
    assert one_line(why) and valid in why
    with pytest.raises(ConfigError) as e:
        compose(config(), recipe)
    assert str(e.value) == why


@pytest.mark.parametrize("recipe, world, reason", REFUSED)
def test_a_combination_that_cannot_run_is_refused_in_one_line(recipe, world, reason):
    why = refusal(recipe, "cpu", world)
    assert one_line(why) and reason in why, why
    if world == 1:
        with pytest.raises(ConfigError) as e:
            compose(config(), recipe)
        assert str(e.value) == why


@pytest.mark.parametrize("recipe, world, reason", REFUSED_IN_DIST)
def test_a_parallel_layout_that_cannot_run_is_refused_in_one_line(recipe, world, reason, monkeypatch):
    assert "torch.distributed started" in refusal(recipe, "cpu", world)  # not a rank: first reason
    monkeypatch.setattr(recipe_module.dist, "is_initialized", lambda: True)  # as on a rank
    why = refusal(recipe, "cpu", world)
    assert one_line(why) and reason in why, why


@pytest.mark.parametrize("recipe", [Recipe(zero_stage=1), Recipe(tensor_parallel=2),
                                    Recipe(expert_parallel=2), Recipe(pipeline_parallel=2)])
def test_a_parallel_recipe_outside_torch_distributed_is_refused(recipe):
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="torch.distributed started"):
        compose(config(), recipe)


@pytest.mark.parametrize("seq_len, recipe, reason", [
    (6, Recipe(context_parallel=2, cp_mode="ring_zigzag"), "use a multiple of 4"),
    (64, Recipe(context_parallel=4, cp_mode="ulysses"), "must both be multiples of 4")])  # 2 kv heads
def test_a_sequence_or_heads_that_do_not_split_over_the_cp_ranks_are_refused(seq_len, recipe, reason):
    assert refusal(recipe, "cpu", 4, launched=True) is None  # the layout is fine; the shape is not
    why = recipe_module.cp_shape_refusal(config(seq_len=seq_len), recipe)
    assert one_line(why) and reason in why, why


@pytest.mark.parametrize("overrides, recipe, reason", [
    ({"batch_size": 1}, Recipe(pipeline_parallel=2, pp_schedule="1f1b"), "micro_batches >= 2"),
    ({"batch_size": 3}, Recipe(pipeline_parallel=2, pp_schedule="zbv", micro_batches=2), "micro_batches >= 3"),
    ({"num_layers": 1, "batch_size": 2}, Recipe(pipeline_parallel=2, pp_schedule="zero_bubble",
                                                micro_batches=2), "num_layers >= 2"),
    ({"tie_embeddings": True}, Recipe(pipeline_parallel=2, pp_schedule="gpipe"), "tie_embeddings=False")])
def test_a_model_or_batch_the_pipeline_schedule_cannot_take_is_refused(overrides, recipe, reason):
    assert refusal(recipe, "cpu", 2, launched=True) is None  # the layout is fine; the shape is not
    why = pipeline_recipe.shape_refusal(config(**overrides), recipe)
    assert one_line(why) and reason in why, why


def test_the_layout_puts_pp_outermost_and_splits_the_blocks_evenly():
    layout = Layout.of(Recipe(pipeline_parallel=2), 8)
    assert (layout.pp, layout.dp, layout.world) == (2, 4, 8) and list(layout.dims) == ["pp", "dp"]
    with pytest.raises(ConfigError, match="pipeline_parallel=3"):
        Layout.of(Recipe(pipeline_parallel=3), 4)
    # the embedding and the head each a module's ends; a middle module at least one block
    assert pipeline_recipe.even_bounds(4, 2) == [0, 2, 4]
    assert pipeline_recipe.even_bounds(2, 4) == [0, 0, 1, 2, 2]


def test_a_pipeline_plans_each_ranks_stage_and_its_schedules_micro_batches_in_flight():
    from labkit import planner

    cfg, plans = config(batch_size=4), {}
    for schedule in ("gpipe", "1f1b"):
        recipe = Recipe(pipeline_parallel=2, pp_schedule=schedule, micro_batches=4)
        plans[schedule] = [recipe_module.planned_memory(cfg, recipe, 2, rank=r) for r in (0, 1)]
    # the two stages' parameters are the model's: the embedding and a block, a block and the head
    assert sum(p.num_params for p in plans["gpipe"]) == planner.num_params(cfg.model)
    assert all(p.optimizer_bytes == 2 * p.param_bytes for p in plans["gpipe"])
    # GPipe holds all 4 micro-batches on rank 0, 1F1B p - rank = 2 of them, beside the batch's ids
    ids = planner.pipeline.pipeline_token_bytes(4, cfg.seq_len)
    assert plans["gpipe"][0].activation_bytes - ids == 2 * (plans["1f1b"][0].activation_bytes - ids)
    with pytest.raises(ConfigError, match="no case"):
        recipe_module.planned_memory(cfg, Recipe(pipeline_parallel=2, checkpointing="full"), 2)


# A mixture of experts in the recipe's launch: 4 experts, top-2, capacity 1.25 (the seeded model
# drops 1 and 7 of its 16 assignments per rank in its two layers), load-balancing loss 0.01
MOE = {"num_experts": 4, "experts_per_token": 2, "moe_ffn_size": 64, "capacity_factor": 1.25,
       "router_aux_loss_coef": 0.01}


@pytest.mark.parametrize("overrides, recipe, reason", [
    ({}, Recipe(expert_parallel=2), "this model is dense"),
    (MOE, Recipe(expert_parallel=3), "use a divisor of 4"),
    # each seen on 2 gloo ranks without its refusal: TP's plan left the experts plain tensors
    # beside DTensors (aten.mm refused the mix); CP's shards routed per shard (0.44 relative off)
    (MOE, Recipe(tensor_parallel=2, zero_stage=2), "stacked weights"),
    (MOE, Recipe(context_parallel=2), "count per shard")])
def test_what_a_mixture_of_experts_cannot_take_is_refused_in_one_line(overrides, recipe, reason):
    why = recipe_module.moe_refusal(config(**overrides), recipe)
    assert one_line(why) and reason in why, why


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_an_moe_under_autocast_combines_its_16_bit_expert_outputs_into_the_fp32_stream(precision):
    """The experts' outputs are 16-bit under autocast, the residual stream fp32: combined in the
    stream's dtype (moe.combine; index_add refused the mix before), within the precision's
    tolerance of the fp32 step (bf16 3.6e-4, fp16 9.2e-6 measured)."""
    ref = one_step(Trainer(config(**MOE)))
    got = one_step(compose(config(**MOE), Recipe(precision=precision)))
    assert abs(got["loss"] - ref["loss"]) / ref["loss"] <= TOLERANCE[precision]


def test_context_parallel_of_an_moe_whose_groups_do_not_matter_is_allowed():
    dropless = config(**{**MOE, "capacity_factor": 0.0, "router_aux_loss_coef": 0.0})  # 8.2e-7 off, seen
    assert recipe_module.moe_refusal(dropless, Recipe(context_parallel=2)) is None


def test_expert_parallel_plans_each_ranks_experts_over_ep_and_the_rest_whole():
    from labkit import planner

    cfg = config(**MOE)
    plan, whole = (recipe_module.planned_memory(cfg, Recipe(expert_parallel=ep), 2) for ep in (2, 1))
    mine = planner.ep_rank_params(cfg.model, 2)
    assert mine == planner.num_params(cfg.model) - planner.expert_params(cfg.model) // 2
    assert (plan.num_params, plan.param_bytes, plan.optimizer_bytes) == (mine, 4 * mine, 8 * mine)
    assert plan.activation_bytes == whole.activation_bytes and plan.total_bytes < whole.total_bytes
    assert "ep_memory" in plan.formulas["param"]


def test_the_layout_splits_dp_into_ep_groups_of_neighbouring_replicas():
    layout = Layout.of(Recipe(expert_parallel=2), 8)
    assert (layout.dp, layout.ep, layout.ep_enabled) == (8, 2, True)
    assert layout.dims == {"dp_mod_ep": 4, "ep": 2} and layout.data_parallel == "ddp"
    with pytest.raises(ConfigError, match="does not divide the 3 data-parallel replicas"):
        Layout.of(Recipe(expert_parallel=2), 3)


def test_the_layout_is_dp_cp_tp_and_reduces_the_gradients_over_dp_x_cp():
    layout = Layout.of(Recipe(context_parallel=2, tensor_parallel=2, zero_stage=2), 8)
    assert (layout.dp, layout.cp, layout.tp, layout.dp_cp, layout.world) == (2, 2, 2, 4, 8)
    assert list(layout.dims) == ["dp", "cp", "tp"] and layout.data_parallel == "zero2"
    # one replica's two shards: no replicas, but the gradients are still reduced over the shards
    assert Layout.of(Recipe(context_parallel=2), 2).data_parallel == "ddp"


def test_sequence_rows_hand_rank_d_cp_plus_c_replica_ds_shard_c():
    """The data-parallel wrapper over dp x cp hands rank d·cp + c its slice of the rows: replica
    d's rows, each cut to shard c (zig-zag: pieces c and 2cp-1-c)."""
    tokens = torch.arange(2 * 3 * 8).view(6, 8)  # 2 replicas of 3 rows of 8 tokens
    rows = context_parallel.sequence_rows(tokens, 2, 2, "zigzag")
    for d, c in itertools.product(range(2), range(2)):
        mine = tokens[3 * d:3 * d + 3]
        runs = ring.pieces(8, 2, c, "zigzag")
        expected = torch.cat([mine[:, start:start + n] for start, n in runs], 1)
        assert torch.equal(rows.chunk(4)[d * 2 + c], expected)


GRID = {"precision": ["fp32", "bf16", "fp16", "bf16_weights"], "checkpointing": ["none", "selective"],
        "offload": ["none", "activations", "optimizer", "both"]}


@pytest.mark.slow
def test_every_single_process_combination_refusal_allows_runs_and_the_rest_are_refused():
    refused = set()
    for values in itertools.product(*GRID.values()):
        r = Recipe(micro_batches=2, **dict(zip(GRID, values)))
        if refusal(r, "cpu"):
            refused.add((r.precision, r.offload))
            continue
        trainer = compose(config(batch_size=2), r)
        assert all(math.isfinite(trainer.step()) for _ in range(2)), r
    assert refused == {(p, o) for p in ("fp16", "bf16_weights") for o in ("optimizer", "both")}
    for precision, offload in refused:  # each refused one does crash or change the recipe
        with pytest.raises(ConfigError):
            compose(config(), Recipe(precision=precision, offload=offload))


# --- two gloo ranks, one launch -------------------------------------------------------------------

# name: (the recipe on 2 ranks, its single-process reference: the plain step of that global batch,
# or a recipe). Batch 1 per micro-batch per replica: global = accumulation x data-parallel ranks.
PARALLEL = {
    "ddp": (Recipe(zero_stage=0), 2),
    "ddp_accumulation2": (Recipe(zero_stage=0, micro_batches=2), 4),
    "zero1": (Recipe(zero_stage=1), 2),
    "zero1_accumulation2": (Recipe(zero_stage=1, micro_batches=2), 4),
    "zero2": (Recipe(zero_stage=2), 2),
    "zero2_accumulation2": (Recipe(zero_stage=2, micro_batches=2), 4),
    "zero3": (Recipe(zero_stage=3), 2),
    "tensor_parallel2": (Recipe(tensor_parallel=2), 1),
    "tensor_parallel2_full_accumulation2": (Recipe(tensor_parallel=2, checkpointing="full",
                                                   micro_batches=2), 2),
    # the worked example: mixed precision + checkpointing + accumulation + ZeRO, against the same
    # bf16 micro-batches of one sequence on one process
    "zero3_bf16_full_accumulation2": (
        Recipe(zero_stage=3, precision="bf16", checkpointing="full", micro_batches=2),
        Recipe(precision="bf16", checkpointing="full", micro_batches=4)),
    # the gradients sent in bf16, or int8 with one agreed scale a bucket (DDP hooks), against
    # the fp32 step of the whole batch
    "ddp_bf16_wire": (Recipe(grad_compression="bf16"), 2),
    "ddp_int8_wire": (Recipe(grad_compression="int8"), 2),
}
COMPRESSED = ("ddp_bf16_wire", "ddp_int8_wire")
DATA_PARALLEL_CASES = [n for n in PARALLEL if not n.startswith("tensor") and n not in COMPRESSED]
# Context parallel on the 2 ranks: each holds one shard of every row's CP_SEQ tokens (zig-zag:
# pieces c and 3-c of 4), its attention over both, against the plain step of the one global row;
# and a bug put in on purpose, which the check must catch: every shard's tokens at positions
# 0..S/cp-1 (RoPE not offset to the shard's own positions).
CP_SEQ = 64
CONTEXT = {"cp2_ring": Recipe(context_parallel=2),
           "cp2_ring_zigzag": Recipe(context_parallel=2, cp_mode="ring_zigzag"),
           "cp2_ulysses": Recipe(context_parallel=2, cp_mode="ulysses")}
CONTEXT_BUG = "cp2_ring_positions_from_0"
# A mixture of experts (MOE) on the 2 ranks: DDP, and expert parallelism (each rank 2 of the 4
# experts) alone and with checkpointing and 2 micro-batches, against the plain step of the global
# batch routed per rank's micro-batch (`expert_parallel.capacity_groups`); and a bug put in on
# purpose, which the check must catch: the experts' gradients averaged over the ep group as if
# they were replicated (what DDP would do to them).
EXPERTS = {"moe_ddp": Recipe(), "moe_ep2": Recipe(expert_parallel=2),
           "moe_ep2_full_accumulation2": Recipe(expert_parallel=2, checkpointing="full", micro_batches=2)}
EXPERTS_BUG = "moe_ep2_averaged_as_if_replicated"
REFUSED_ON_RANKS = {"tp2_zero2_no_replicas": Recipe(tensor_parallel=2, zero_stage=2),
                    "zero3_activation_offload": Recipe(zero_stage=3, offload="activations")}


def reference_grads(reference) -> dict:
    if isinstance(reference, int):
        return plain(reference)["grads"]
    return one_step(compose(config(batch_size=reference.micro_batches), reference))["grads"]


def count_all_reduces(trainer: Trainer) -> list[int]:
    """Under DDP, the micro-batch (0-based) of every bucket all-reduce: a comm hook that counts
    and then does DDP's own all-reduce (the sum over ranks divided by their count)."""
    calls: list[int] = []
    if not isinstance(trainer.net, torch.nn.parallel.DistributedDataParallel):
        return calls
    forwards = [0]
    trainer.model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))

    def hook(state, bucket):
        calls.append(forwards[0] - 1)
        return allreduce_hook(None, bucket)

    trainer.net.register_comm_hook(None, hook)
    return calls


def check_on_rank(recipe: Recipe, reference: dict) -> dict:
    trainer = compose(config(batch_size=recipe.micro_batches), recipe)  # micro-batches of one
    # DDP takes one comm hook: a compressed recipe's is its format's
    calls = count_all_reduces(trainer) if recipe.grad_compression == "none" else []
    got = one_step(trainer)
    return {"max_rel": gradient_difference(reference, got["grads"])[1], "loss": got["loss"],
            "global_rel": global_relative_difference(reference, got["grads"]),
            "all_reduce_micro_batches": calls, "num_micro_batches": len(trainer.sizes),
            "num_sharded": sum(isinstance(p, torch.distributed.tensor.DTensor)
                               for p in trainer.model.parameters())}


def check_cp_on_rank(recipe: Recipe, reference: dict, *, positions_from_0: bool = False) -> dict:
    """One context-parallel step against the plain one: the gradients, this rank's loss, what
    its forward keeps for the backward, and the live tensors' peak over a second step (the
    first makes AdamW's state), the build included (the model states are in the peak)."""
    from labkit.measure.memory import ActivationMeter, MemoryMeter

    with MemoryMeter("cpu") as meter:
        trainer = compose(config(seq_len=CP_SEQ), recipe)
        if positions_from_0:  # the bug: each shard's tokens numbered as if it began the row
            shard = trainer.sequence_shard
            shard.positions = torch.arange(len(shard.positions))
        kept = ActivationMeter(trainer.model.parameters()).measure(trainer.forward).total_bytes
        got = one_step(trainer)
        meter.reset_peak()
        trainer.step()
        peak = meter.peak_bytes
    return {"max_rel": gradient_difference(reference, got["grads"])[1], "loss": got["loss"],
            "activation_bytes": kept, "peak_bytes": peak}


def moe_plain(micro_batches: int) -> dict:
    """The plain step of the MoE's global batch (2 replicas x micro_batches rows), routed in the
    groups the recipe's ranks route: one per rank's micro-batch."""
    trainer = Trainer(config(**MOE, batch_size=2 * micro_batches))
    moe.set_groups(trainer.model, expert_parallel.capacity_groups(2, micro_batches))
    return one_step(trainer)


def check_moe_on_rank(recipe: Recipe, reference: dict, *, as_if_replicated: bool = False) -> dict:
    """One MoE step against the plain one: the gradients (experts gathered from the ep group),
    the all-to-all and all-reduce bytes CommCounter saw and the formula's from every rank's split
    sizes, and the live tensors' peak over a second step, the build included."""
    from labkit import planner
    from labkit.measure.comm import CommCounter
    from labkit.measure.memory import MemoryMeter

    cfg = config(**MOE, batch_size=recipe.micro_batches)
    with MemoryMeter("cpu") as meter:
        trainer = compose(cfg, recipe)
        if as_if_replicated:  # the bug: summed over the ep group (different experts) and / ep
            trainer.expert_reduction.group = trainer.expert_group
            trainer.expert_reduction.divisor = recipe.expert_parallel
        with CommCounter() as comm:
            loss = trainer.accumulate()
        sent = expert_parallel.traffic(trainer.model)  # rows to each rank, per layer (last forward)
        got = {"loss": loss, "grads": whole_grads(trainer)}
        trainer.update()
        meter.reset_peak()
        trainer.step()
        peak = meter.peak_bytes
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, sent)
    sends = [[rank_sends[layer] for rank_sends in everyone] for layer in range(len(sent))]
    return {"max_rel": gradient_difference(reference, got["grads"])[1], "loss": loss,
            "all_to_all_bytes": comm.bytes["all_to_all"], "all_to_all_count": comm.counts["all_to_all"],
            "all_reduce_bytes": comm.bytes["all_reduce"], "peak_bytes": peak,
            "all_to_all_predicted": planner.all_to_all_bytes(
                sends, dist.get_rank(), hidden=cfg.model.hidden_size, num_experts=cfg.model.num_experts)
            if sent else 0}


def fp16_overflow_on_rank() -> int:
    """fp16 with expert parallelism, an inf planted in rank 1's expert gradient: the steps its
    GradScaler skipped (each rank's experts are its own: DDP's sum does not spread their inf)."""
    trainer = compose(config(**MOE), Recipe(expert_parallel=2, precision="fp16"))
    reduce = trainer.reduce_grads

    def planted(t):
        if dist.get_rank() == 1:
            trainer.model.layers[0].mlp.experts.w1.grad.view(-1)[0] = math.inf
        reduce(t)

    trainer.reduce_grads = planted
    trainer.step()
    return trainer.skipped_steps


# Pipelines on the 2 ranks (pp=2, a stage each; zero_bubble: 2 modules each), 2 micro-batches of
# one row, against the plain step of the 2 rows; and a bug the check must catch: the schedule
# not dividing the gradients by the micro-batches (scale_grads=False: each stage's m times over).
PP_MICRO = 2
PIPELINES = {f"pp2_{s}": Recipe(pipeline_parallel=2, pp_schedule=s, micro_batches=PP_MICRO)
             for s in ("gpipe", "1f1b", "zero_bubble")}
PIPELINES["pp2_1f1b_full"] = Recipe(pipeline_parallel=2, micro_batches=PP_MICRO, checkpointing="full")
PIPELINE_BUG = "pp2_1f1b_not_divided_by_micro_batches"


def check_pp_on_rank(recipe: Recipe, reference: dict, *, undivided: bool = False) -> dict:
    """One pipeline step against the plain one: this rank's stages' gradients (named as the
    decoder's), the loss every rank returns, and the live tensors' peak over a second step
    against the plan of this rank's stages."""
    from labkit.measure.memory import MemoryMeter

    cfg = config(batch_size=PP_MICRO)
    with MemoryMeter("cpu") as meter:
        trainer = compose(cfg, recipe)
        if undivided:  # the bug: the m micro-batches' gradients summed, not averaged
            trainer.pipeline.schedule.scale_grads = False
        got = one_step(trainer)
        meter.reset_peak()
        trainer.step()
        peak = meter.peak_bytes
    plan = recipe_module.planned_memory(cfg, recipe, 2, rank=dist.get_rank()) \
        if recipe.checkpointing == "none" else None
    return {"max_rel": gradient_difference({n: reference[n] for n in got["grads"]}, got["grads"])[1],
            "loss": got["loss"], "names": sorted(got["grads"]), "peak_bytes": peak,
            "planned_bytes": plan and plan.total_bytes, "planned_states": plan and plan.model_states_bytes,
            "states": 4 * sum(p.numel() * p.element_size() for p in trainer.model.parameters())}


def refused_on_rank(recipe: Recipe) -> str:
    try:
        compose(config(), recipe)
    except ConfigError as e:
        return str(e)
    return ""


def run_recipes(rank: int, folder: str) -> None:
    """One rank: every PARALLEL recipe against its reference (computed by the parent)."""
    import numpy as np

    from labkit.harness.ranks import init_rank

    torch.set_num_threads(1)
    init_rank("cpu", 60.0)
    try:
        results = {}
        for name, (recipe, _) in PARALLEL.items():
            with np.load(f"{folder}/{name}.npz") as ref:
                results[name] = check_on_rank(recipe, dict(ref))
        with np.load(f"{folder}/context.npz") as ref:
            row = dict(ref)
        for name, recipe in CONTEXT.items():
            results[name] = check_cp_on_rank(recipe, row)
        results[CONTEXT_BUG] = check_cp_on_rank(CONTEXT["cp2_ring"], row, positions_from_0=True)
        for name, recipe in EXPERTS.items():
            with np.load(f"{folder}/moe{recipe.micro_batches}.npz") as ref:
                results[name] = check_moe_on_rank(recipe, dict(ref))
        with np.load(f"{folder}/moe1.npz") as ref:
            results[EXPERTS_BUG] = check_moe_on_rank(EXPERTS["moe_ep2"], dict(ref), as_if_replicated=True)
        results["moe_ep2_fp16_overflow_skipped"] = fp16_overflow_on_rank()
        with np.load(f"{folder}/pp.npz") as ref:
            pp = dict(ref)
        for name, recipe in PIPELINES.items():
            results[name] = check_pp_on_rank(recipe, pp)
        results[PIPELINE_BUG] = check_pp_on_rank(PIPELINES["pp2_1f1b"], pp, undivided=True)
        results["refused"] = {name: refused_on_rank(r) for name, r in REFUSED_ON_RANKS.items()}
    finally:
        dist.destroy_process_group()
    with open(f"{folder}/rank{rank}.json", "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def context_row() -> dict:
    """The plain step of the context-parallel recipes' one global row of CP_SEQ tokens."""
    return one_step(Trainer(config(seq_len=CP_SEQ)))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, context_row):
    """Each rank's results: one launch of 2 gloo ranks for every parallel recipe."""
    import numpy as np

    from labkit.harness.ranks import spawn

    folder = tmp_path_factory.mktemp("recipes")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for name, (_, reference) in PARALLEL.items():
        np.savez(folder / f"{name}.npz", **reference_grads(reference))
    np.savez(folder / "context.npz", **context_row["grads"])
    for micro in (1, 2):
        np.savez(folder / f"moe{micro}.npz", **moe_plain(micro)["grads"])
    pp = plain(PP_MICRO)
    np.savez(folder / "pp.npz", **pp["grads"])
    (folder / "pp_loss.json").write_text(json.dumps(pp["loss"]))
    torch.set_num_threads(threads)
    exits = spawn(run_recipes, (str(folder),), 2)
    assert all(e.ok for e in exits), exits
    return [{**json.loads((folder / f"rank{r}.json").read_text()),
             "pp_reference_loss": json.loads((folder / "pp_loss.json").read_text())} for r in (0, 1)]


@pytest.mark.parametrize("name", DATA_PARALLEL_CASES)
@pytest.mark.multiprocess  # the module's one launch of 2 gloo ranks (`ranks`)
def test_a_data_parallel_recipe_matches_the_plain_step_of_the_global_batch(ranks, name):
    sharded = PARALLEL[name][0].zero_stage >= 2
    policy = sharded and PARALLEL[name][0].precision == "bf16"
    for rank in ranks:
        assert rank[name]["max_rel"] <= (BF16_ROUNDING if policy else SPLIT_ROUNDING), (name, rank[name]["max_rel"])
    assert ranks[0][name]["loss"] != ranks[1][name]["loss"]  # each rank trained its own slice
    assert ranks[0][name]["num_micro_batches"] == PARALLEL[name][0].micro_batches
    assert all((rank[name]["num_sharded"] > 0) == sharded for rank in ranks)


@pytest.mark.multiprocess  # the module's one launch of 2 gloo ranks (`ranks`)
def test_a_compressed_gradient_recipe_differs_from_fp32_by_its_formats_rounding(ranks):
    """The whole gradient's relative difference from fp32's. bf16 on the wire: each rank's
    gradient and the sum rounded to 8 bits of mantissa, more than fp32's reordering and within
    bf16's rounding. int8 (63 levels a rank on 2 ranks, one absmax scale a bucket) by more, within
    the recipe's tolerance of it; a small tensor sharing a bucket with a large one can round to
    zero whole (its own relative difference 1), which only the whole gradient's measure allows."""
    from labkit.blocks import compression

    for rank in ranks:
        bf16, int8 = (rank[name]["global_rel"] for name in COMPRESSED)
        assert SPLIT_ROUNDING < bf16 <= BF16_ROUNDING, bf16
        assert bf16 < int8 <= compression.RECIPE_TOLERANCE["int8"], int8
        assert all(rank[name]["num_sharded"] == 0 for name in COMPRESSED)


@pytest.mark.parametrize("name", [n for n in PARALLEL if n.startswith("tensor")])
@pytest.mark.multiprocess  # the module's one launch of 2 gloo ranks (`ranks`)
def test_a_tensor_parallel_recipe_matches_the_plain_step(ranks, name):
    for rank in ranks:
        assert rank[name]["max_rel"] <= SPLIT_ROUNDING, (name, rank[name]["max_rel"])
        assert rank[name]["num_sharded"] > 0
    assert ranks[0][name]["loss"] == ranks[1][name]["loss"]  # one replica: the same batch


@pytest.mark.parametrize("name", CONTEXT)
@pytest.mark.multiprocess  # the module's one launch of 2 gloo ranks (`ranks`)
def test_a_context_parallel_recipe_is_the_plain_step_of_the_global_row(ranks, context_row, name):
    """Each rank's gradients are the whole row's within fp32's reordering; each rank's loss is
    the mean over its own shard's tokens (they differ), and their mean is the row's loss."""
    for rank in ranks:
        assert rank[name]["max_rel"] <= SPLIT_ROUNDING, (name, rank[name]["max_rel"])
    losses = [rank[name]["loss"] for rank in ranks]
    assert losses[0] != losses[1]
    assert sum(losses) / len(losses) == pytest.approx(context_row["loss"], rel=FP32_ROUNDING)


@pytest.mark.parametrize("name", CONTEXT)
@pytest.mark.multiprocess
def test_a_context_parallel_rank_keeps_half_the_rows_activations_and_peaks_as_planned(ranks, name):
    """A rank's forward keeps what one process keeps for a row of S/cp tokens, plus the attention
    output each block keeps twice (`output_copy_bytes`), to the byte; the planner's step of S/cp
    tokens (half the whole row's activations) says so within 0.1%, and the peak within 2% (the
    ring's blocks in flight are not planned)."""
    from labkit.measure.memory import ActivationMeter

    shard = Trainer(config(seq_len=CP_SEQ // 2))
    kept = ActivationMeter(shard.model.parameters()).measure(shard.forward).total_bytes
    copies = context_parallel.output_copy_bytes(config().model, 1, CP_SEQ, 2)
    plan = recipe_module.planned_memory(config(seq_len=CP_SEQ), CONTEXT[name], 2)
    row = recipe_module.planned_memory(config(seq_len=CP_SEQ), Recipe(), 1)
    assert 2 * plan.activation_bytes == pytest.approx(row.activation_bytes, abs=16)  # a scalar's bytes
    for rank in ranks:
        assert rank[name]["activation_bytes"] == kept + copies, name
        assert rank[name]["activation_bytes"] == pytest.approx(plan.activation_bytes + copies, rel=1e-3)
        assert rank[name]["peak_bytes"] == pytest.approx(plan.total_bytes, rel=0.02), name


@pytest.mark.multiprocess
def test_positions_not_offset_per_shard_fail_the_check(ranks):
    for rank in ranks:  # the second shard's RoPE angles wrong: far past fp32's reordering
        assert rank[CONTEXT_BUG]["max_rel"] > 100 * SPLIT_ROUNDING, rank[CONTEXT_BUG]["max_rel"]


@pytest.mark.parametrize("name", EXPERTS)
@pytest.mark.multiprocess  # the module's one launch of 2 gloo ranks (`ranks`)
def test_an_moe_recipe_is_the_plain_step_of_the_global_batch_routed_per_micro_batch(ranks, name):
    """With and without expert parallelism, capacity drops included: each rank's gradients (its
    experts' gathered) are the plain step's within fp32's reordering; each rank's loss is its own
    tokens' (cross-entropy and its groups' load-balancing loss), their mean the global one."""
    for rank in ranks:
        assert rank[name]["max_rel"] <= SPLIT_ROUNDING, (name, rank[name]["max_rel"])
    assert ranks[0][name]["loss"] != ranks[1][name]["loss"]


@pytest.mark.multiprocess
def test_expert_parallel_sends_the_formulas_all_to_all_bytes_and_keeps_experts_out_of_ddp(ranks):
    """Per layer the counts' exchange and four row exchanges (dispatch and combine, forward and
    backward): CommCounter's bytes are planner.all_to_all_bytes of every rank's split sizes, to
    the byte; DDP all-reduces the replicated weights alone (4 bytes each; each rank's experts are
    its group's only holder here, so nothing else); the peak within 1% of the plan's."""
    from labkit import planner

    m = config(**MOE).model
    replicated = planner.num_params(m) - planner.expert_params(m)
    plan = recipe_module.planned_memory(config(**MOE), EXPERTS["moe_ep2"], 2)
    for rank in ranks:
        got = rank["moe_ep2"]
        assert got["all_to_all_bytes"] == got["all_to_all_predicted"] > 0
        assert got["all_to_all_count"] == 5 * m.num_layers
        assert got["all_reduce_bytes"] == 4 * replicated
        assert rank["moe_ddp"]["all_reduce_bytes"] == 4 * planner.num_params(m)  # DDP: every weight
        assert got["peak_bytes"] == pytest.approx(plan.total_bytes, rel=0.01)


@pytest.mark.multiprocess
def test_expert_gradients_averaged_as_if_replicated_fail_the_check(ranks):
    for rank in ranks:  # another expert's gradient mixed into each: far past fp32's reordering
        assert rank[EXPERTS_BUG]["max_rel"] > 100 * SPLIT_ROUNDING, rank[EXPERTS_BUG]["max_rel"]


@pytest.mark.multiprocess
def test_an_overflow_in_one_ranks_experts_skips_the_step_on_every_rank(ranks):
    """Without `expert_parallel.share_overflow` rank 0 stepped while rank 1 skipped (seen): the
    replicated weights parted."""
    assert [rank["moe_ep2_fp16_overflow_skipped"] for rank in ranks] == [1, 1]


@pytest.mark.parametrize("ddp, accumulated", [("ddp", "ddp_accumulation2"),
                                              ("zero1", "zero1_accumulation2")])
@pytest.mark.multiprocess
def test_ddp_all_reduces_once_per_step_not_once_per_micro_batch(ranks, ddp, accumulated):
    for rank in ranks:
        once, calls = rank[ddp]["all_reduce_micro_batches"], rank[accumulated]["all_reduce_micro_batches"]
        assert once and set(once) == {0}
        # the same buckets, all in the last micro-batch's backward (the others under no_sync)
        assert len(calls) == len(once) and set(calls) == {1}


@pytest.mark.multiprocess
def test_a_layout_that_cannot_run_is_refused_on_the_ranks(ranks):
    for rank in ranks:
        for name, recipe in REFUSED_ON_RANKS.items():
            why = rank["refused"][name]
            assert one_line(why) and "torch.distributed started" not in why, (name, why)
    assert ranks[0]["refused"] == ranks[1]["refused"]


@pytest.mark.parametrize("name", list(PIPELINES))
@pytest.mark.multiprocess  # the module's one launch of 2 gloo ranks (`ranks`)
def test_a_pipeline_recipe_is_the_plain_step_of_the_global_batch(ranks, name):
    """Each rank's stages' gradients within fp32's reordering of the plain step's (the two ranks'
    together every parameter, once), and the mean of the micro-batches' losses on both."""
    for rank in ranks:
        assert rank[name]["max_rel"] <= SPLIT_ROUNDING, (name, rank[name]["max_rel"])
        assert rank[name]["loss"] == pytest.approx(rank["pp_reference_loss"], rel=FP32_ROUNDING)
    names = ranks[0][name]["names"] + ranks[1][name]["names"]
    assert len(names) == len(set(names)) == len(plain(1)["grads"])


@pytest.mark.multiprocess
def test_a_pipeline_that_sums_the_micro_batches_fails_the_check(ranks):
    for rank in ranks:  # each stage's gradients PP_MICRO times the plain step's
        assert rank[PIPELINE_BUG]["max_rel"] == pytest.approx(PP_MICRO - 1, rel=1e-4)


@pytest.mark.parametrize("name", ["pp2_gpipe", "pp2_1f1b", "pp2_zero_bubble"])
@pytest.mark.multiprocess
def test_a_pipeline_ranks_peak_is_its_stages_plan(ranks, name):
    """The model states of this rank's stages to the byte; the peak (the optimizer step's, at
    this size) within 1% of the plan (measured: 0.1-0.7% above it, allocator-free CPU tensors)."""
    for rank in ranks:
        got = rank[name]
        assert got["states"] == got["planned_states"]
        assert 0 <= got["peak_bytes"] - got["planned_bytes"] <= 0.01 * got["planned_bytes"], got


# --- the one slow test: torch.compile on the CPU (inductor's C++ codegen, ~15-30 s cold) ------------

@pytest.mark.timeout(120)
@pytest.mark.slow
def test_slow_compile_matches_and_compiled_blocks_are_also_checkpointed():
    ref = plain(1)
    compiled = compose(config(), Recipe(compile=True))
    both = compose(config(), Recipe(compile=True, checkpointing="full"))
    (got, kept), (got_both, kept_both) = saved_bytes(compiled), saved_bytes(both)
    for result in (got, got_both):  # fused kernels round differently: not bitwise
        assert gradient_difference(ref["grads"], result["grads"])[1] <= 10 * FP32_ROUNDING
    # checkpointing before compile: each block is compiled (in place) around its checkpointed
    # forward, so the compiled backward recomputes and the graph saves fewer activations
    assert all(b._compiled_call_impl is not None and hasattr(b.forward, "__wrapped__")
               for b in both.model.layers)
    assert kept_both < kept
