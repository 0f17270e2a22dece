"""The `recipe` experiment on two gloo ranks, and the planner's autocast and FSDP2 terms.

One launch serves every test that reads rows (a launch costs 6-12 s), its points:
- the issue's recipe (bf16, full checkpointing, 2 micro-batches, ZeRO-2: FSDP2 with its bf16
  mixed-precision policy) with no budget, and with a budget of half its predicted peak, so that
  composed is an `oom` row there while plain, the reference, still runs;
- the model converters: a quantized base + LoRA + full checkpointing + ZeRO (QLORA_POINTS);
- FSDP2's ZeRO-3 with accumulation (FSDP2_POINTS).
The planner's new terms are held to single-process measurements below (autocast's activations
and cached weight copies, and the peaks they make)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import FAST, needs
from labkit import planner
from labkit.blocks.layout import Layout
from labkit.blocks.recipe import Recipe, compose
from labkit.config import MODELS, ConfigError, RunConfig, resolve
from labkit.harness.experiment import plan_points, run_experiment
from labkit.measure.memory import ActivationMeter, MemoryMeter
from labkit.planner.sharding import _fsdp2_units
from labkit.techniques import recipe

pytestmark = pytest.mark.multiprocess  # this module starts ranks (6-12 s a launch)

RANKS = (0, 1)
RECIPE = {"precision": "bf16", "checkpointing": "full", "micro_batches": 2, "zero_stage": 2}
SIZES = {**FAST, "device": "cpu", "nproc": 2, "timed_steps": 1, "batch_size": 4, "seq_len": 32,
         "num_layers": 2, "timeout_s": 60}


def config(variant="composed", **overrides) -> recipe.Config:
    return resolve(recipe.Config, "tiny", {**SIZES, **RECIPE, "variant": variant, **overrides},
                   experiment="recipe")


BUDGET_GIB = 0.5 * recipe.planned(config()).total_bytes / 2**30  # composed cannot fit it
BUDGET = {**RECIPE, "budget_gib": BUDGET_GIB}

QLORA = {"checkpointing": "full", "precision": "fp32"}
# ZeRO-2 with 2 micro-batches: each micro-batch's forward gathers FSDP2's units anew; ZeRO-3:
# the blocks gathered again for the backward, the root unit kept from its forward. QLoRA's NF4
# base, and the weight-only int8 and int4 bases (labkit.blocks.lora.apply_weight_only); one
# micro-batch under ZeRO-2 is lora_int8's point
QLORA_POINTS = tuple({**QLORA, **p} for p in (
    {"finetune": "qlora", "zero_stage": 2, "micro_batches": 2},
    {"finetune": "qlora", "zero_stage": 3, "micro_batches": 1},
    {"finetune": "lora_int8", "zero_stage": 2, "micro_batches": 1},
    {"finetune": "lora_int4", "zero_stage": 3, "micro_batches": 2}))
QLORA_IDS = [f"{p['finetune']}-zero{p['zero_stage']}-x{p['micro_batches']}" for p in QLORA_POINTS]
qlora = needs("peft", "torchao")  # the finetune extra; its skip condition leaves the points out too
# without recomputation in fp32, with it in bf16 (FSDP2's policy under ZeRO-3)
FSDP2_POINTS = tuple({"zero_stage": 3, "micro_batches": 2, "num_layers": 3, **p} for p in (
    {"checkpointing": "none", "precision": "fp32"}, {"checkpointing": "full", "precision": "bf16"}))


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    skipped = qlora.args[0]  # needs' condition: a package is missing
    points = [RECIPE, BUDGET, *(() if skipped else QLORA_POINTS), *FSDP2_POINTS]
    return run_experiment("recipe", preset="tiny", overrides=SIZES, sweep=points,
                          runs_dir=str(tmp_path_factory.mktemp("runs")), progress=False).rows


def of(rows, point):
    """The rows measured at the sweep point `point`."""
    return [r for r in rows if r["params"]["sweep"] == point]


def at(rows, variant, metric, rank, point=RECIPE):
    hits = [r for r in of(rows, point) if (r["variant"], r["metric"], r["rank"]) == (variant, metric, rank)]
    assert len(hits) == 1, (variant, metric, rank, point, hits)
    return hits[0]


def test_composed_matches_plain_within_bf16_tolerance(rows):
    for rank in RANKS:
        for metric in ("loss_rel_diff", "weight_rel_diff"):
            row = at(rows, "composed", metric, rank)
            assert row["status"] == "ok" and row["value"] <= recipe.PRECISION_TOLERANCE["bf16"], row
        # bf16 did run: not bitwise the fp32 reference
        assert at(rows, "composed", "weight_rel_diff", rank)["value"] > 0


def test_every_rank_has_its_peak_beside_the_planners_within_10_percent(rows):
    for variant in recipe.VARIANTS:
        for rank in RANKS:
            row = at(rows, variant, "peak_mem_bytes", rank)
            assert row["predicted"] and row["value"] == pytest.approx(row["predicted"], rel=0.10), row


def test_model_states_and_activations_are_measured_beside_their_predictions(rows):
    for rank in RANKS:
        for metric in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                       "saved_weight_copy_bytes", "all_gather_bytes", "build_peak_bytes"):
            row = at(rows, "composed", metric, rank)
            assert row["value"] == pytest.approx(row["predicted"], rel=0.01), row
        # built on the meta device and sharded: no rank ever held the whole model, as plain did
        whole = 4 * planner.num_params(config().model)
        assert at(rows, "plain", "build_peak_bytes", rank)["value"] == pytest.approx(whole, rel=0.01)
        assert at(rows, "composed", "build_peak_bytes", rank)["value"] < whole
        # ZeRO-2 gathers the whole model once a micro-batch, in bf16 (FSDP2's mixed-precision
        # policy: no autocast, so no cast copies kept)
        assert at(rows, "composed", "all_gather_bytes", rank)["value"] == pytest.approx(
            RECIPE["micro_batches"] * 2 * planner.num_params(config().model), rel=0.01)
        assert at(rows, "composed", "saved_weight_copy_bytes", rank)["value"] == 0
        # ZeRO-2 over 2 ranks: each keeps half of plain's parameters at rest, and of its gradients
        for metric in ("param_bytes", "grad_bytes"):
            half = at(rows, "plain", metric, rank)["value"] / 2
            assert at(rows, "composed", metric, rank)["value"] == pytest.approx(half, rel=0.01)
        assert at(rows, "composed", "loss_delta", rank)["predicted"] == 0.0
        # the predicted step is this rank's FLOPs at the peak, and its throughput the sequences
        # that step computes: composed's share of the global batch, plain the whole of it
        for variant, sequences in (("composed", SIZES["batch_size"]),
                                   ("plain", SIZES["nproc"] * SIZES["batch_size"])):
            step_s = at(rows, variant, "step_ms", rank)["predicted"] / 1e3
            assert at(rows, variant, "tokens_per_s", rank)["predicted"] == pytest.approx(
                sequences * SIZES["seq_len"] / step_s, rel=1e-9), variant


def test_a_budget_makes_composed_an_oom_row_while_plain_still_runs(rows):
    for rank in RANKS:
        oom = [r for r in of(rows, BUDGET) if r["variant"] == "composed" and r["rank"] == rank]
        assert [r["status"] for r in oom] == ["oom"], oom
        assert "budget" in oom[0]["message"] and "predicted" in oom[0]["message"]
        plain = at(rows, "plain", "peak_mem_bytes", rank, BUDGET)
        assert plain["status"] == "ok" and plain["value"] > BUDGET_GIB * 2**30  # not bound by it


# --- the model converters: a quantized base + LoRA + full checkpointing + ZeRO --------------------

@qlora
@pytest.mark.parametrize("point", QLORA_POINTS, ids=QLORA_IDS)
def test_qlora_with_checkpointing_and_zero_matches_its_one_process_reference(rows, point):
    """plain holds the same converters on one process: the same adapters train, the NF4 base stays;
    composed must end with its weights and losses at fp32 precision."""
    for rank in RANKS:
        for metric in ("loss_rel_diff", "weight_rel_diff"):
            row = at(rows, "composed", metric, rank, point)
            assert row["status"] == "ok" and row["value"] <= recipe.FP32_TOLERANCE, row


@qlora
@pytest.mark.parametrize("point", QLORA_POINTS, ids=QLORA_IDS)
def test_qlora_zero_terms_are_the_planners_and_the_peak_within_3_percent(rows, point):
    for rank in RANKS:
        for metric in ("param_bytes", "grad_bytes", "optimizer_bytes", "activation_bytes",
                       "all_gather_bytes"):
            row = at(rows, "composed", metric, rank, point)
            assert row["value"] == pytest.approx(row["predicted"], rel=0.01), row
        for variant in recipe.VARIANTS:
            row = at(rows, variant, "peak_mem_bytes", rank, point)
            assert row["value"] == pytest.approx(row["predicted"], rel=0.03), row
        # the adapters' gradients and moments halved; the NF4 base whole on each rank
        plain, composed = (at(rows, v, "grad_bytes", rank, point)["value"]
                           for v in recipe.VARIANTS)
        assert composed == pytest.approx(plain / 2, rel=0.01)
        # the quantized base's cost, measured on the reference: not 0 (the base was converted)
        delta = at(rows, "plain", "base_loss_delta", rank, point)["value"]
        assert math.isfinite(delta) and delta != 0.0


REFUSED = [({"zero_stage": 1, "precision": "bf16_weights"}, "master copies"),
           ({"zero_stage": 2, "offload": "optimizer"}, "needs a GPU"),
           ({"zero_stage": 3, "offload": "activations"}, "DTensor"),
           ({"zero_stage": 2, "nproc": 1}, "use zero_stage=0"),
           ({"micro_batches": 3}, "must divide batch_size"),
           ({"memory_budget_gib": 1.0}, "budget_gib"),
           ({"zero_stage": 0, "tensor_parallel": 2, "nproc": 4}, "DDP cannot wrap"),
           ({"zero_stage": 0, "tensor_parallel": 3, "nproc": 4}, "tensor parallel degree 3"),
           ({"finetune": "qlora", "zero_stage": 1}, "NF4 weights are buffers"),
           ({"finetune": "lora_int9"}, "valid: none, lora, qlora, lora_int8, lora_int4"),
           ({"finetune": "lora", "tensor_parallel": 2, "zero_stage": 0}, "use tensor_parallel=1 with finetune"),
           ({"finetune": "lora", "lora_targets": "q,x"}, "unknown LoRA target 'x'"),
           ({"context_parallel": 2, "zero_stage": 0}, "use cp_mode=ulysses"),  # RECIPE's bf16
           ({"context_parallel": 2, "cp_mode": "ring_zigzag", "precision": "fp32", "seq_len": 30},
            "use a multiple of 4"),
           ({"expert_parallel": 2, "zero_stage": 0}, "this model is dense"),
           ({"expert_parallel": 2, "num_experts": 4}, "average different experts"),  # RECIPE's ZeRO-2
           ({"packing": True, "zero_stage": 0, "num_experts": 4, "capacity_factor": 1.25},
            "packing's plain reference pads"),
           ({"pipeline_parallel": 2}, "zero_stage=2 would not apply"),  # RECIPE's ZeRO-2
           ({"pipeline_parallel": 2, "zero_stage": 0, "pp_schedule": "zbv"}, "micro_batches >= 3")]


@pytest.mark.parametrize("overrides, reason", REFUSED)
def test_a_recipe_that_cannot_run_is_refused_in_one_line_before_anything_runs(overrides, reason):
    with pytest.raises(ConfigError) as e:
        plan_points("recipe", "tiny", {**SIZES, **RECIPE, **overrides}, None)
    assert reason in str(e.value) and "\n" not in str(e.value)


def test_tensor_parallel_is_a_knob_whose_replicas_share_the_global_batch():
    """tensor_parallel=2 on 4 ranks: 2 replicas of 2-rank TP groups; ZeRO over the replicas; plain
    computes the replicas' global batch (2 x batch_size), as composed's replicas do together."""
    cfg = config(zero_stage=2, tensor_parallel=2, nproc=4)
    assert recipe.recipe_of(cfg) == Recipe(precision="bf16", checkpointing="full", micro_batches=2,
                                           zero_stage=2, tensor_parallel=2)
    assert recipe.replicas(cfg) == 2
    pure = config(zero_stage=0, tensor_parallel=2, nproc=2)  # one replica: no data parallelism
    assert Layout.of(recipe.recipe_of(pure), 2).data_parallel == "none"
    assert recipe.refused(pure) is None
    plain = recipe.planned(config(variant="plain", zero_stage=2, tensor_parallel=2, nproc=4))
    assert plain == recipe.planned(config(variant="plain", zero_stage=2, nproc=2))


def test_context_parallel_is_a_knob_whose_ranks_share_each_row():
    """context_parallel=2 on 4 ranks: 2 replicas, each row's tokens split over 2 ranks; the
    gradients reduced over all 4; plain computes the replicas' rows whole, as without it."""
    cfg = config(zero_stage=2, precision="fp32", context_parallel=2, cp_mode="ulysses", nproc=4)
    assert recipe.recipe_of(cfg).context_parallel == 2 and recipe.recipe_of(cfg).cp_mode == "ulysses"
    assert (recipe.replicas(cfg), recipe.data_ranks(cfg)) == (2, 4)
    assert recipe.computed_shape(cfg)[:2] == (SIZES["batch_size"], SIZES["seq_len"] // 2)
    fp32 = {"variant": "plain", "zero_stage": 2, "precision": "fp32"}
    assert recipe.planned(config(**fp32, context_parallel=2, nproc=4)) == recipe.planned(config(**fp32, nproc=2))


def test_expert_parallel_is_a_knob_of_a_model_given_experts_by_name():
    """`--set expert_parallel=2 --set num_experts=4`: the model's experts, the recipe's degree;
    plain routes its global batch per rank's micro-batch (2 replicas x 2: 4 groups); each rank
    plans half the experts and the rest whole, and builds them before DDP's buckets for the rest."""
    from labkit.blocks import moe

    moe_sizes = {"zero_stage": 0, "precision": "fp32", "num_experts": 4, "moe_ffn_size": 64}
    cfg = config(**moe_sizes, expert_parallel=2)
    assert cfg.model.num_experts == 4 and recipe.recipe_of(cfg).expert_parallel == 2
    recipe.validate(cfg)
    trainer = recipe.plain_step(config(variant="plain", **moe_sizes), recipe.Observed())
    assert [layer.groups for layer in moe.moe_layers(trainer.model)] == [4, 4]
    mine = planner.ep_rank_params(cfg.model, 2)
    replicated = planner.num_params(cfg.model) - planner.expert_params(cfg.model)
    assert recipe.planned(cfg).param_bytes == 4 * mine
    assert recipe.expected(cfg)["build_peak_bytes"] == 4 * (mine + replicated)


def test_offload_is_skipped_on_cpu_ranks_with_the_reason():
    assert "same memory" in recipe.skip_reason(config(zero_stage=0, offload="activations"))
    assert recipe.skip_reason(config(variant="plain", zero_stage=0, offload="activations")) is None


def test_the_host_optimizer_is_predicted_as_the_recipe_without_its_optimizer_bytes():
    # a GPU's recipe (one rank, no ZeRO); on an H200 the small preset measured 1.6% above it
    def on_gpu(**kw) -> recipe.Config:
        return dataclasses.replace(config(zero_stage=0, nproc=1), device="cuda", **kw)

    host, device = recipe.planned(on_gpu(offload="optimizer")), recipe.planned(on_gpu())
    assert host.optimizer_bytes == 0 < device.optimizer_bytes
    assert host.total_bytes == device.total_bytes - device.optimizer_bytes
    assert "host memory" in host.formulas["optimizer"]
    assert recipe.planned(on_gpu(offload="activations")) is None  # no case: no prediction


# --- the planner's autocast terms, one process ----------------------------------------------------

TINY2 = dataclasses.replace(MODELS["tiny"], num_layers=2)
TINY_GPT2 = dataclasses.replace(MODELS["gpt2-124m"], num_layers=2, hidden_size=64, num_heads=2,
                                num_kv_heads=2, ffn_size=256, vocab_size=512, max_seq_len=256)


def run_config(model, batch_size, seq_len) -> RunConfig:
    cfg = resolve(RunConfig, "tiny", {"device": "cpu", "batch_size": batch_size, "seq_len": seq_len})
    return dataclasses.replace(cfg, model=model)


@pytest.mark.parametrize("model", [TINY2, TINY_GPT2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_autocast_activations_and_weight_copies_are_what_the_forward_keeps(model, mode):
    torch.manual_seed(0)
    trainer = compose(run_config(model, 1, 32), Recipe(precision="bf16", checkpointing=mode))
    kept = ActivationMeter(trainer.model.parameters()).measure(trainer.forward)
    plan = planner.training_memory(model, batch_size=1, seq_len=32, precision="bf16",
                                   checkpointing=mode, device="cpu")
    assert plan.activation_bytes == pytest.approx(kept.total_bytes, rel=0.01)
    # the casts the backward keeps: every matmul weight's, but in checkpointed blocks the head's
    assert plan.kept_weight_copy_bytes == kept.weight_copy_bytes
    assert plan.kept_weight_copy_bytes < plan.phase_bytes["forward"]


def test_autocast_is_a_case_of_its_own_not_pure_bf16():
    autocast = planner.training_memory(TINY2, batch_size=2, seq_len=32, precision="bf16")
    pure = planner.training_memory(TINY2, batch_size=2, seq_len=32, precision="bf16_pure")
    psi = planner.num_params(TINY2)
    assert (autocast.param_bytes, autocast.grad_bytes, autocast.optimizer_bytes) == (4 * psi, 4 * psi, 8 * psi)
    assert (pure.param_bytes, pure.optimizer_bytes) == (2 * psi, 4 * psi)
    assert "forward" in autocast.phase_bytes and "forward" not in pure.phase_bytes


def measured_peak(cfg: RunConfig, r: Recipe) -> int:
    """Peak bytes of the second step of the composed recipe (the first makes AdamW's state)."""
    with MemoryMeter("cpu") as meter:
        trainer = compose(cfg, r)
        trainer.step()
        meter.reset_peak()
        trainer.step()
        return meter.peak_bytes


PEAKS = [  # (batch, seq, checkpointing, micro-batches): each phase of an autocast step peaks once
    (4, 64, "none", 1),  # the backward's start: activations, kept casts and the loss's gradients
    (4, 64, "full", 2),  # the forward's end: every cast cached, accumulated gradients held
    (1, 32, "none", 1),  # the optimizer step
]


@pytest.mark.parametrize("batch, seq, mode, micro", PEAKS)
def test_autocast_peak_is_within_10_percent_of_the_measured_one(batch, seq, mode, micro):
    measured = measured_peak(run_config(TINY2, batch * micro, seq),  # micro-batches of `batch`
                             Recipe(precision="bf16", checkpointing=mode, micro_batches=micro))
    plan = planner.training_memory(TINY2, batch_size=batch, seq_len=seq, precision="bf16",
                                   checkpointing=mode, accumulation_steps=micro, device="cpu")
    print(f"bf16 autocast b={batch} s={seq} {mode} x{micro}: measured {measured} predicted "
          f"{plan.total_bytes} ({plan.peak_phase})")
    assert plan.total_bytes == pytest.approx(measured, rel=0.10)


def test_fsdp2_zero2_holds_the_whole_parameters_beside_the_shards():
    kw = dict(batch_size=2, seq_len=32, zero_stage=2, gpus=2, device="cpu")
    paper, fsdp2 = planner.training_memory(TINY2, **kw), planner.training_memory(TINY2, fsdp2=True, **kw)
    psi = planner.num_params(TINY2)
    assert paper.param_bytes == 4 * psi and paper.gathered_bytes == 0
    assert (fsdp2.param_bytes, fsdp2.gathered_bytes) == (4 * psi // 2, 4 * psi)
    # the shards beside the whole parameters; and no separate gradient buffer of the largest
    # unit (the head here): FSDP2's root unit's unsharded gradient is the head's, counted with it
    head_unit = TINY2.vocab_size * TINY2.hidden_size + TINY2.hidden_size
    stage = planner.stage_params(TINY2, tp=1, pp=1, first=True, last=True)
    for fsdp, buffer in ((False, 4 * head_unit), (True, 0)):
        run = planner._resolve(TINY2, fsdp2=fsdp, **kw)
        for block in (None, 0, 1):
            assert planner._zero_buffers(run, stage, True, False, block) == buffer


def test_fsdp2_bf16_gathers_in_bf16_over_fp32_shards():
    # FSDP2's mixed-precision policy (compose's bf16 under ZeRO-2/3): the shards, their gradients
    # and AdamW's moments as fp32's; what it gathers half of fp32's; no autocast copies
    kw = dict(batch_size=2, seq_len=32, zero_stage=2, gpus=2, device="cpu", fsdp2=True)
    psi, half = planner.num_params(TINY2), -(-planner.num_params(TINY2) // 2)
    fp32 = planner.training_memory(TINY2, precision="fp32", **kw)
    bf16 = planner.training_memory(TINY2, precision="bf16", **kw)
    assert (bf16.param_bytes, bf16.grad_bytes, bf16.optimizer_bytes) == (4 * half, 4 * half, 8 * half)
    assert (bf16.gathered_bytes, fp32.gathered_bytes) == (2 * psi, 4 * psi)
    assert bf16.kept_weight_copy_bytes == 0 and bf16.activation_bytes < fp32.activation_bytes
    # ZeRO-3's working buffers: the gathered units in bf16, the reduce-scatter input in fp32
    run, stage = planner._resolve(TINY2, precision="bf16", **{**kw, "zero_stage": 3}), \
        planner.stage_params(TINY2, tp=1, pp=1, first=True, last=True)
    root, layer = _fsdp2_units(run)
    assert planner._zero_buffers(run, stage, True, False, 1) == 2 * (root + layer) + 4 * layer


def test_fsdp2_zero3_with_accumulation_peaks_at_its_predicted_bytes(rows):
    """FSDP2 accumulates into the gradient shards: each micro-batch's backward makes whole
    gradients anew, the root unit stays gathered, a block's backward holds the next block's
    all-gather and the previous block's reduce-scatter input, and with recomputation the peak
    moves to the forward's first all-gathers (planner `_fsdp2_buffers`, `_fsdp2_forward_gathers`).
    FSDP2_POINTS: without recomputation in fp32, with it in bf16 (FSDP2's policy under ZeRO-3),
    every rank within 3% (each term of either peak is in one of the two)."""
    composed = [r for point in FSDP2_POINTS for r in of(rows, point) if r["variant"] == "composed"]
    peaks = [r for r in composed if r["metric"] == "peak_mem_bytes"]
    assert len(peaks) == len(FSDP2_POINTS) * len(RANKS)
    for row in peaks:
        assert row["status"] == "ok" and row["value"] == pytest.approx(row["predicted"], rel=0.03), row
    # what the forward leaves for the backward, FSDP2's gathered weights left out (resharded
    # after the forward under ZeRO-3: their storages hold nothing then), as the planner says;
    # and no weight copies kept: fp32 casts nothing, FSDP2's bf16 policy gathers in bf16
    for row in (r for r in composed if r["metric"] in ("activation_bytes", "saved_weight_copy_bytes")):
        assert row["value"] == pytest.approx(row["predicted"], rel=0.01), row
    # bf16 under ZeRO-3 is FSDP2's mixed-precision policy: every all-gather delivers bf16, half
    # of fp32's
    gathers = {(r["params"]["sweep"]["precision"], r["params"]["sweep"]["checkpointing"], r["rank"]):
               r["value"] for r in composed if r["metric"] == "all_gather_bytes"}
    # ZeRO-3: every block twice a micro-batch, the root unit (not resharded after forward) once
    m = config(**FSDP2_POINTS[0]).model
    whole = FSDP2_POINTS[0]["micro_batches"] * (2 * planner.num_params(m) - planner.root_unit_params(m))
    for (precision, _, _), value in gathers.items():
        assert value == pytest.approx(whole * (2 if precision == "bf16" else 4), rel=0.01)


def test_pipeline_parallel_is_a_knob_whose_ranks_plan_their_own_stages():
    """`--set pipeline_parallel=2`: 2 stages on the 2 ranks, one replica; each rank plans its
    stages' model states (rank 0 the embedding and block 0, rank 1 block 1 and the head), built
    whole before the cut; plain still the whole global batch."""
    pp = {"zero_stage": 0, "precision": "fp32", "checkpointing": "none", "pipeline_parallel": 2}
    cfg = config(**pp, pp_schedule="gpipe")
    assert recipe.recipe_of(cfg).pipeline_parallel == 2 and recipe.recipe_of(cfg).pp_schedule == "gpipe"
    recipe.validate(cfg)
    assert recipe.replicas(cfg) == 1 and recipe.computed_shape(cfg)[0] == SIZES["batch_size"]
    plans = [recipe.recipes.planned_memory(cfg, recipe.recipe_of(cfg), 2, rank=r) for r in RANKS]
    assert sum(p.num_params for p in plans) == planner.num_params(cfg.model)
    assert recipe.expected(cfg)["build_peak_bytes"] == 4 * planner.num_params(cfg.model)
