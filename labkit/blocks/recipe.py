"""A recipe: the step-side techniques one training run combines, and the one place that composes
them (`compose`), in a fixed order, refusing up front the combinations that cannot work.

    trainer = compose(cfg, Recipe(precision="bf16", checkpointing="full", micro_batches=4,
                                  zero_stage=2))
    trainer.step()  # cfg.batch_size sequences on each rank, in 4 micro-batches

The single-technique experiments apply the same transforms (`labkit.blocks.transforms`); a
recipe of one technique is that experiment's variant.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from labkit import planner
from labkit.blocks import (compression, context_parallel, expert_parallel, hf, losses, optimizers,
                           packing, pipeline_recipe, transforms)
from labkit.blocks.layout import HOST_OPTIMIZER, SHARDED, ZERO_MODES, Layout, data_mode
from labkit.blocks.model import build_model, materialize
from labkit.blocks.training import Trainer
from labkit.config import ConfigError, RunConfig, check_choice

OFFLOADS = ("none", "activations", "optimizer", "both")
# The recipe's knobs in the order compose applies them (its steps 0 to 9): the ladder's order too
ORDER = ("packing", "precision", "finetune", "loss", "tensor_parallel", "context_parallel",
         "expert_parallel", "checkpointing", "compile", "zero_stage", "grad_compression",
         "micro_batches", "offload", "optimizer")


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What one training run combines; every field's default is the plain step."""
    precision: str = "fp32"              # transforms.PRECISIONS
    loss_scaling: bool = True            # fp16 only: GradScaler
    checkpointing: str = "none"          # transforms.CHECKPOINT_MODES
    checkpoint_every: int = 2            # every_n: every n-th block
    compile: bool = False                # torch.compile of each block
    zero_stage: int = 0                  # of the data-parallel replicas (layout.ZERO_MODES)
    tensor_parallel: int = 1             # TP degree (the ranks of one model replica)
    micro_batches: int = 1               # micro-batches of batch_size per optimizer step
    offload: str = "none"                # OFFLOADS
    finetune: str = "none"               # transforms.FINETUNE: lora or qlora adapters, base frozen
    lora_rank: int = 8                   # the adapters' rank r
    lora_alpha: float = 16.0             # their scale: outputs add (alpha / r) B A x
    lora_targets: str = "q,v"            # the linears adapted (planner.parse_lora_targets)
    loss: str = "plain"                  # losses.LOSSES: chunked fuses the head and the loss
    loss_chunk: int = 1024               # chunked: tokens of logits at a time
    optimizer: str = "adamw"             # optimizers.OPTIMIZERS: AdamW's moments in 32, 8 or 4 bits
    packing: bool = False                # documents of varied lengths packed into the rows, masked apart
    grad_compression: str = "none"       # compression.RECIPE_FORMATS: the gradients on the wire
    context_parallel: int = 1            # CP degree: the ranks that split each sequence's tokens
    cp_mode: str = "ring"                # context_parallel.CP_MODES: how their attention meets
    expert_parallel: int = 1             # EP degree: the data-parallel replicas that split each MoE
                                         # layer's experts (labkit.blocks.expert_parallel)
    pipeline_parallel: int = 1           # PP degree: stages the model's blocks split over, the
                                         # outermost mesh dimension (labkit.blocks.pipeline_recipe)
    pp_schedule: str = "1f1b"            # pipeline_recipe.PP_SCHEDULES: the micro-batches' order
    virtual_stages: int = 2              # stage modules per rank of interleaved_1f1b, zero_bubble

    def techniques(self) -> list[str]:
        """The fields that differ from the plain step, as `name=value`."""
        plain = Recipe()
        return [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                if getattr(self, f.name) != getattr(plain, f.name)]


def refusal(recipe: Recipe, device: str, world: int = 1, *, launched: bool | None = None) -> str | None:
    """Why this recipe cannot run (one line), or None. Unknown values name the valid ones. Each
    refused combination was tried: it crashes, or it would silently run something else.
    `launched`: judge as if on `world` ranks torch.distributed started (True, before a launch)
    or not (False); None: as this process is."""
    launched = dist.is_initialized() if launched is None else launched
    why = (_unknown(recipe) or _pipeline_layout(recipe, world, launched)
           or pipeline_recipe.clash(recipe) or _layout(recipe, world // recipe.pipeline_parallel, launched))
    if why:
        return why
    mode = data_mode(recipe.zero_stage, world // recipe.tensor_parallel)
    return (_optimizer_clash(recipe, mode) or _offload_clash(recipe, mode, device)
            or _device_clash(recipe, device) or _converter_clash(recipe, mode)
            or compression.recipe_clash(recipe.grad_compression, mode) or _context_clash(recipe)
            or _expert_clash(recipe, mode))


def _unknown(recipe: Recipe) -> str | None:
    for name, value, valid in (("precision", recipe.precision, transforms.PRECISIONS),
                               ("checkpointing", recipe.checkpointing, transforms.CHECKPOINT_MODES),
                               ("zero_stage", recipe.zero_stage, range(len(ZERO_MODES))),
                               ("offload", recipe.offload, OFFLOADS),
                               ("finetune", recipe.finetune, transforms.FINETUNE),
                               ("loss", recipe.loss, losses.LOSSES),
                               ("optimizer", recipe.optimizer, optimizers.OPTIMIZERS),
                               ("grad_compression", recipe.grad_compression, compression.RECIPE_FORMATS),
                               ("cp_mode", recipe.cp_mode, context_parallel.CP_MODES),
                               ("pp_schedule", recipe.pp_schedule, pipeline_recipe.PP_SCHEDULES)):
        try:
            check_choice(name, value, valid)
        except ConfigError as e:
            return str(e)
    if recipe.checkpointing == "blocks":
        return "checkpointing=blocks needs the block list the checkpointing experiment's budget chooses"
    if min(recipe.micro_batches, recipe.tensor_parallel, recipe.context_parallel,
           recipe.expert_parallel, recipe.checkpoint_every, recipe.loss_chunk,
           recipe.pipeline_parallel, recipe.virtual_stages) < 1:
        return ("micro_batches, tensor_parallel, context_parallel, expert_parallel, pipeline_parallel, "
                "virtual_stages, checkpoint_every and loss_chunk are counts: 1 or more")
    if recipe.finetune != "none":
        try:
            planner.parse_lora_targets(recipe.lora_targets)
        except ConfigError as e:
            return str(e)
    return None


def _pipeline_layout(recipe: Recipe, world: int, launched: bool) -> str | None:
    """pp stages, the outermost dimension: each of world / pp ranks' groups holds one stage."""
    pp = recipe.pipeline_parallel
    if pp == 1:
        return None
    if not launched:
        return ("pipeline parallelism runs on ranks that torch.distributed started (torchrun, or "
                "the harness's launcher); this process is not one")
    if world % pp:
        return f"pipeline_parallel={pp} does not divide the {world} ranks"
    return None


def _layout(recipe: Recipe, world: int, launched: bool) -> str | None:
    """How the ranks split into tensor-parallel groups, context-parallel groups of them and
    data-parallel replicas: the ranks over `tensor_parallel` (dp x cp of them) reduce the
    gradients, data parallel at `zero_stage`, when there are two or more."""
    tp, cp, stage = recipe.tensor_parallel, recipe.context_parallel, recipe.zero_stage
    ep = recipe.expert_parallel
    if (world > 1 or stage or tp > 1 or cp > 1 or ep > 1) and not launched:
        return ("data, tensor, context and expert parallelism run on ranks that torch.distributed "
                "started (torchrun, or the harness's launcher); this process is not one")
    if world % (tp * cp):
        return (f"tensor_parallel={tp} x context_parallel={cp} does not divide the {world} ranks"
                if cp > 1 else f"tensor_parallel={tp} does not divide the {world} ranks")
    if (world // (tp * cp)) % ep:  # the experts' groups are cut from the replicas
        return (f"expert_parallel={ep} groups the data-parallel replicas ({world} rank(s) / "
                f"(tensor_parallel x context_parallel) = {world // (tp * cp)}): use a divisor of it")
    replicas = world // tp
    if stage and replicas == 1:  # compose would skip it: the recipe would not run
        return (f"zero_stage={stage} shards over the data-parallel replicas; {world} rank(s) / "
                f"tensor_parallel={tp} leave 1: use zero_stage=0")
    if tp > 1 and replicas > 1 and stage <= 1:
        return ("DDP cannot wrap tensor-parallel (DTensor) parameters; with tensor_parallel > 1 "
                "and several replicas use zero_stage=2 or 3 (FSDP2 over the replicas)")
    return None


def _optimizer_clash(recipe: Recipe, mode: str) -> str | None:
    """Two transforms that each choose the optimizer, or a GradScaler the optimizer cannot serve."""
    host_optimizer = recipe.offload in HOST_OPTIMIZER
    if recipe.optimizer != "adamw":
        other = ("zero_stage=1's ZeroRedundancyOptimizer (torch's AdamW on each rank's shard)" if mode == "zero1"
                 else "bf16_weights's AdamW on fp32 master copies" if recipe.precision == "bf16_weights"
                 else "offload=optimizer's host AdamW" if host_optimizer else None)
        if other:
            return f"optimizer={recipe.optimizer} and {other} each build the optimizer: choose one"
    if host_optimizer and mode == "zero1":
        return ("offload=optimizer keeps whole host copies; ZeroRedundancyOptimizer (zero_stage=1) "
                "shards those states itself: choose one")
    if recipe.precision == "bf16_weights" and mode == "zero1":
        return ("bf16_weights keeps fp32 master copies in its own optimizer; zero_stage=1's "
                "ZeroRedundancyOptimizer would replace it (no master copies): choose one")
    if host_optimizer and recipe.precision == "bf16_weights":
        return "bf16_weights and offload=optimizer both replace the optimizer with copies: choose one"
    scaled = recipe.precision == "fp16" and recipe.loss_scaling
    if scaled and host_optimizer and mode not in SHARDED:
        return ("fp16's GradScaler unscales through optimizer.param_groups, which the host "
                "optimizer (CopyAdamW) has not: use bf16, or loss_scaling=False")
    if scaled and recipe.tensor_parallel > 1 and mode == "none":
        return ("fp16's GradScaler unscales DTensor (sharded) and plain (replicated norm) "
                "gradients in one foreach call, which DTensor refuses: use bf16")
    return None


def _offload_clash(recipe: Recipe, mode: str, device: str) -> str | None:
    activations = recipe.offload in ("activations", "both")
    if activations and recipe.compile:
        return ("activation offload's host copies come back contiguous, and compile's backward "
                "asserts the saved tensors' original strides: choose one")
    if activations and (recipe.tensor_parallel > 1 or mode in SHARDED):
        return ("offload=activations tells parameters from activations by storage, which "
                "sharded (DTensor) parameters do not expose: use zero_stage 0 or 1, or no offload")
    host_optimizer = recipe.offload in HOST_OPTIMIZER
    if host_optimizer and recipe.tensor_parallel > 1 and mode == "none":
        return ("offload=optimizer copies whole tensors; tensor-parallel shards need FSDP2's "
                "offload (zero_stage 2 or 3)")
    if host_optimizer and mode in SHARDED and not device.startswith("cuda"):
        return "offload=optimizer with zero_stage 2 or 3 is FSDP2's CPUOffloadPolicy, which needs a GPU"
    return None


def _converter_clash(recipe: Recipe, mode: str) -> str | None:
    if recipe.loss == "chunked" and recipe.tensor_parallel > 1:
        return ("loss=chunked takes a whole row of logits per token from the head's weight, which "
                "tensor parallelism shards over the vocabulary: use tensor_parallel=1 with it")
    if recipe.finetune != "none" and recipe.tensor_parallel > 1:
        return ("LoRA's adapters wrap the linears that tensor parallelism's plan shards by name: "
                "use tensor_parallel=1 with finetune")
    if recipe.finetune == "qlora" and mode in ("ddp", "zero1"):
        return ("DDP broadcasts the module's buffers, and QLoRA's NF4 weights are buffers of a "
                "tensor subclass it cannot send: use zero_stage 2 or 3 with qlora")
    return None


def _context_clash(recipe: Recipe) -> str | None:
    """What context parallelism's sequence shards cannot carry (each tried on gloo ranks)."""
    if recipe.context_parallel == 1:
        return None
    if recipe.packing:  # the ring and Ulysses attend causally over whole rows: no document mask
        return ("packing's per-document mask is not passed to the ring or Ulysses, which attend "
                "causally over whole rows: use context_parallel=1 with packing")
    sixteen = recipe.precision in ("bf16", "fp16", "bf16_weights")
    if sixteen and recipe.cp_mode != "ulysses":
        return (f"the ring's backward (labkit.blocks.ring) multiplies its fp32 softmax with "
                f"precision={recipe.precision}'s 16-bit q, k, v outside autocast, which fails: "
                "use cp_mode=ulysses (SDPA) or precision=fp32")
    return None


def _expert_clash(recipe: Recipe, mode: str) -> str | None:
    """What expert parallelism's per-rank experts cannot pass through (each tried on gloo ranks)."""
    if recipe.expert_parallel == 1:
        return None
    if recipe.tensor_parallel > 1 or recipe.context_parallel > 1:
        return ("expert_parallel groups whole data-parallel replicas here (torchtitan also borrows "
                "the cp ranks): use tensor_parallel=1 and context_parallel=1 with it")
    if mode == "zero1":
        return ("zero_stage=1's ZeroRedundancyOptimizer broadcasts each parameter from the rank that "
                "updates it, over the experts other ranks hold: use zero_stage=0 with expert_parallel")
    if mode in SHARDED:
        return ("FSDP2 (zero_stage 2 or 3) would shard the expert weights over every data-parallel "
                "rank and average different experts' gradients: use zero_stage=0 with expert_parallel")
    return None


def _device_clash(recipe: Recipe, device: str) -> str | None:
    if recipe.precision == "tf32" and not device.startswith("cuda"):
        return "TF32 is a mode of NVIDIA tensor cores; this device is a CPU"
    return None


def cp_shape_refusal(cfg: RunConfig, recipe: Recipe) -> str | None:
    """Why the run's sequence or heads do not split over the recipe's context-parallel ranks
    (one line), or None (`context_parallel.shape_refusal`)."""
    if recipe.context_parallel == 1:
        return None
    return context_parallel.shape_refusal(cfg.model, cfg.seq_len, recipe.cp_mode,
                                          recipe.context_parallel, recipe.tensor_parallel)


def moe_refusal(cfg: RunConfig, recipe: Recipe) -> str | None:
    """Why the run's model cannot take the recipe's parallelism as a mixture of experts (one
    line), or None: experts that do not split over expert_parallel, tensor parallelism's plan
    (which names a dense MLP's linears), or context parallelism's shards where the routing
    groups matter (`expert_parallel.groups_matter`: capacity and the load-balancing loss would
    be counted per shard of every row, not per rank's rows as in the plain step)."""
    m = cfg.model
    why = expert_parallel.shape_refusal(m, recipe.expert_parallel)
    if why or not m.num_experts:
        return why
    if recipe.tensor_parallel > 1:
        return ("tensor parallelism's plan shards a dense MLP's w1, w2, w3 linears; an MoE block's "
                "experts are stacked weights it does not split: use expert_parallel, tensor_parallel=1")
    if recipe.context_parallel > 1 and expert_parallel.groups_matter(m):
        return ("context parallelism cuts every row over its ranks, so the MoE's capacity and "
                "load-balancing loss would count per shard, not per rank's rows: use "
                "context_parallel=1, or capacity_factor=0 and router_aux_loss_coef=0")
    return None


def shape_refusal(cfg: RunConfig, recipe: Recipe) -> str | None:
    """Why the run's model, sequence or batch does not fit the recipe's context, expert or
    pipeline parallelism (one line), or None: the checks past `refusal` that need the run's
    config."""
    return (cp_shape_refusal(cfg, recipe) or moe_refusal(cfg, recipe)
            or pipeline_recipe.shape_refusal(cfg, recipe))


def micro_batch_size(batch_size: int, micro_batches: int) -> int:
    """Sequences per micro-batch: a rank's `batch_size` per optimizer step, split evenly."""
    if batch_size % micro_batches:
        raise ConfigError(f"micro_batches={micro_batches} must divide batch_size={batch_size} "
                          "(each rank's batch is split)")
    return batch_size // micro_batches


def compose(cfg: RunConfig, recipe: Recipe, *, lr: float = 1e-3) -> Trainer:
    """The plain training step with the recipe's transforms applied in the one fixed order:
    `cfg.batch_size` sequences per rank and optimizer step (`recipe.micro_batches` of them at a
    time). Raises ConfigError (one line) for a recipe that cannot run."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    why = refusal(recipe, cfg.device, world) or shape_refusal(cfg, recipe)
    if why:
        raise ConfigError(why)
    micro = micro_batch_size(cfg.batch_size, recipe.micro_batches)
    layout = Layout.of(recipe, world, cfg.device)
    if layout.pp_enabled:  # the stages and their schedule in place of the one model's step
        return pipeline_recipe.compose_pipeline(cfg, recipe, layout, lr=lr)
    # 0. Under FSDP2 the model is built on the meta device, sharded, then made real (step 6): no
    #    rank holds the whole of it. Not for converters (NF4 and the adapters' initialisation
    #    need real weights), FSDP2's offload, or weights loaded from a folder.
    meta = (layout.fsdp_enabled and recipe.finetune == "none" and not layout.host_optimizer
            and not hf.loads_weights(cfg.model))
    model = build_model(cfg.model, device="meta", attention=cfg.attention) if meta else None
    # The global batch, built the same on every rank; data parallelism takes each rank's slice.
    trainer = Trainer(cfg, weights=transforms.weights_dtype(recipe.precision), lr=lr, optimizer=False,
                      batch_size=cfg.batch_size * layout.dp, model=model)
    # 0. the batch: with packing, documents of varied lengths fill the global batch's rows, each
    #    token attending within its document (`labkit.blocks.packing`); the same rows on every
    #    rank, before data parallelism (step 6) takes each rank's.
    if recipe.packing:
        packing.apply_packing(trainer, packing.rows_in_order(packed_documents(cfg, layout.dp),
                                                             cfg.batch_size * layout.dp, cfg.seq_len))
    # The order, and why (torchtitan's `parallelize`: TP, then activation checkpointing, then
    # compile, then FSDP):
    # 1. precision first: bf16 weights change the parameters' dtype, and every later transform
    #    (the shards, the optimizer's states) takes its dtype from them. Under FSDP2 (ZeRO-2 and
    #    3), bf16 is FSDP2's mixed-precision policy (step 6) in place of autocast: the gathers in
    #    bf16.
    mp_policy = mixed_precision_policy(recipe, layout)
    transforms.apply_precision(trainer, "fp32" if mp_policy else recipe.precision,
                               loss_scaling=recipe.loss_scaling)
    # 2. the model converters, before any parallelism (torchtitan applies its converters before
    #    `parallelize`): NF4 from the weights in their training dtype, which is what they
    #    dequantize to; the adapters in the base's dtype; everything else frozen.
    apply_converters(trainer, recipe)
    #    The loss, fused with the head in the model's own forward (so under any wrapper), when
    #    chunked: the head's weight is read where the model's forward has it whole.
    transforms.apply_loss(trainer, recipe.loss, recipe.loss_chunk)
    # 3. tensor parallel on the plain modules: its plan names the linear layers, which a
    #    checkpoint or compile wrapper would hide.
    if layout.tp_enabled:
        transforms.apply_tensor_parallel(trainer, layout.tp_mesh)
    #    context parallel next, on the heads TP left this rank (its plan's projections run
    #    unchanged inside the sharded attention): each row's tokens cut into shards, laid out as
    #    rows that step 6's wrapper over dp x cp hands out, one shard a rank.
    if layout.cp_enabled:
        context_parallel.apply_context_parallel(trainer, recipe.cp_mode, layout.cp_mesh,
                                                replicas=layout.dp)
    #    expert parallel: each MoE layer keeps its ep group's share of the experts (sliced from the
    #    weights every rank built alike), before the wrapper (step 6), which is told to leave
    #    them out: their gradients are reduced by hand over the ranks holding the same experts.
    if layout.ep_enabled:
        expert_parallel.apply_expert_parallel(trainer, layout.ep_mesh, layout.ep_replicas_mesh,
                                              data_ranks=layout.dp_cp)
    # 4. checkpointing wraps whole (possibly sharded) blocks, before compile, so the compiled
    #    block is the one that recomputes.
    transforms.apply_checkpointing(trainer, recipe.checkpointing, every=recipe.checkpoint_every)
    # 5. compile each block, before data parallelism: FSDP2's gathers and DDP's bucket hooks
    #    run between the blocks, outside the compiled graphs.
    if recipe.compile:
        transforms.apply_compile(trainer)
    # 6. data parallelism wraps (or shards) the finished model and keeps this rank's slice; a
    #    model built on the meta device gets its weights now, each rank its shards. Over the
    #    dp x cp ranks (torchtitan's dp_cp): each holds a different share of the batch's tokens.
    if layout.dp_enabled:
        transforms.apply_data_parallel(trainer, layout.data_parallel, layout.dp_cp_mesh,
                                       offload=layout.host_optimizer and layout.fsdp_enabled,
                                       mp_policy=mp_policy,
                                       bucket_cap_mb=compression.bucket_cap_mb(recipe.grad_compression,
                                                                               cfg.device))
        #    the gradients' wire format: a DDP communication hook on its buckets (under FSDP2,
        #    the policy's reduce dtype, step 1)
        if not layout.fsdp_enabled:
            compression.apply_grad_compression(trainer, recipe.grad_compression)
    if meta:
        materialize(trainer.model, cfg.device, seed=cfg.seed)
    # 7. accumulation splits this rank's slice into micro-batches, around whatever the forward
    #    has become (under DDP only the last micro-batch all-reduces).
    transforms.apply_accumulation(trainer, [micro] * recipe.micro_batches)
    # 8. offload: activation hooks around the forward; the host optimizer unless FSDP2 offloads.
    transforms.apply_offload(trainer, activations=recipe.offload in ("activations", "both"),
                             optimizer=layout.host_optimizer and not layout.fsdp_enabled)
    # 9. the optimizer last, over the final parameters: their dtype, device and shard.
    transforms.apply_optimizer(trainer, recipe.optimizer)
    trainer.build_optimizer()
    return trainer


def packed_documents(cfg: RunConfig, replicas: int) -> list[torch.Tensor]:
    """The documents a packed recipe trains on: seeded, filling `replicas` x batch_size rows of
    seq_len (`packing.fill_rows`: lengths around a quarter of a row). `plain` trains the same
    ones, one per row (`packing.pad_batch`)."""
    return packing.fill_rows(cfg.batch_size * replicas, cfg.seq_len, vocab_size=cfg.model.vocab_size,
                             seed=cfg.seed)


def mixed_precision_policy(recipe: Recipe, layout: Layout) -> transforms.MixedPrecisionPolicy | None:
    """FSDP2's mixed-precision policy for the recipe on this layout (compose's step 1), or None:
    `transforms.fsdp_mixed_precision`, where FSDP2 shards at all."""
    if not layout.fsdp_enabled:
        return None
    policy = transforms.fsdp_mixed_precision(recipe.precision, layout.data_parallel)
    return compression.with_reduce_dtype(policy, recipe.grad_compression)


def converters(recipe: Recipe) -> Recipe:
    """The recipe's model converters alone: what trains, without how."""
    return Recipe(finetune=recipe.finetune, lora_rank=recipe.lora_rank, lora_alpha=recipe.lora_alpha,
                  lora_targets=recipe.lora_targets)


def apply_converters(trainer: Trainer, recipe: Recipe) -> Trainer:
    """The recipe's model converters on the step's model (`transforms.apply_finetune`)."""
    return transforms.apply_finetune(trainer, recipe.finetune, rank=recipe.lora_rank,
                                     alpha=recipe.lora_alpha,
                                     targets=planner.parse_lora_targets(recipe.lora_targets))


def planner_kwargs(cfg: RunConfig, recipe: Recipe, world: int = 1) -> tuple[dict | None, str]:
    """`planner.training_memory`'s keywords for `compose(cfg, recipe)` on one of `world` ranks
    (cfg.batch_size per rank and step, as compose takes it; the planner's batch_size is one
    micro-batch), or (None, why not) where the planner has no case for the recipe."""
    if recipe.pipeline_parallel > 1:  # planned per stage (pipeline_recipe.planned), not by these
        return None, (pipeline_recipe.no_case(recipe)
                      or "pipeline_parallel: each rank's stages, pipeline_recipe.planned")
    if recipe.offload != "none" or recipe.compile:
        return None, "the planner does not model offload or compile"
    if recipe.optimizer != "adamw" and recipe.zero_stage and Layout.of(recipe, world, cfg.device).dp_enabled:
        return None, (f"the planner's {recipe.optimizer} states are whole tensors'; under ZeRO each "
                      "rank quantizes its shard (not modelled)")
    if recipe.finetune != "none" and recipe.precision != "fp32":
        return None, (f"the planner's fine-tuning steps compute in one dtype; precision="
                      f"{recipe.precision} with finetune is not one of its cases (use fp32)")
    if recipe.expert_parallel > 1 and (recipe.optimizer != "adamw" or recipe.precision == "bf16_weights"
                                       or recipe.finetune != "none"):
        return None, ("the planner has no case for expert_parallel with bf16_weights' master copies, "
                      "a low-bit optimizer or finetune (planner.ep_memory: AdamW on trained weights)")
    mode, layers = recipe.checkpointing, None
    if mode == "every_n":  # the planner's full recomputation on the blocks every_n wraps
        mode = "full"
        layers = len(transforms.checkpointed_blocks(cfg.model.num_layers, "every_n",
                                                    every=recipe.checkpoint_every))
    if mode not in planner.CHECKPOINTING:
        return None, f"the planner has no case for checkpointing={recipe.checkpointing}"
    layout = Layout.of(recipe, world, cfg.device)
    stage = recipe.zero_stage if layout.dp_enabled else 0
    # the planner's precisions are the recipe's (bf16 on FSDP2's sharded stages is its policy)
    micro = micro_batch_size(cfg.batch_size, recipe.micro_batches)
    # context parallel: each rank computes seq_len / cp tokens of every row
    return dict(batch_size=micro, seq_len=cfg.seq_len // layout.cp, precision=recipe.precision,
                optimizer=recipe.optimizer, zero_stage=stage, gpus=layout.world, tp=layout.tp,
                checkpointing=mode, checkpointed_layers=layers,
                accumulation_steps=recipe.micro_batches, device=cfg.device, fsdp2=True,
                loss_chunk=recipe.loss_chunk if recipe.loss == "chunked" else 0,
                packed=recipe.packing), ""


def planned_memory(cfg: RunConfig, recipe: Recipe, world: int = 1, *, rank: int = 0) -> planner.MemoryPlan:
    """The planner's prediction of one step of `compose(cfg, recipe)` on one of `world` ranks
    (`rank`: which, where the ranks differ: a pipeline's stages): the same recipe the transforms
    apply. ConfigError where the planner has no case for it.

    The host AdamW (offload=optimizer without FSDP2) is the recipe without it, less the
    optimizer's bytes, which live in host memory (`techniques.offload`'s rule; on an H200 the
    small preset's bf16 + full checkpointing + 2 micro-batches measured 1.6% above it)."""
    if recipe.pipeline_parallel > 1:
        return pipeline_recipe.planned(cfg, recipe, world, rank)
    if recipe.offload == "optimizer" and not Layout.of(recipe, world, cfg.device).fsdp_enabled:
        plan = planned_memory(cfg, dataclasses.replace(recipe, offload="none"), world)
        return dataclasses.replace(plan, optimizer_bytes=0, formulas={
            **plan.formulas, "optimizer": "0 on the device: AdamW's moments and fp32 weights in "
                                          "host memory (offload=optimizer)"})
    kwargs, why = planner_kwargs(cfg, recipe, world)
    if kwargs is None:
        raise ConfigError(why)
    if recipe.finetune == "none":
        plan = planner.training_memory(cfg.model, **kwargs)
    else:
        plan = planner.finetune_memory(
            cfg.model, method=recipe.finetune, lora_rank=recipe.lora_rank,
            lora_targets=recipe.lora_targets, batch_size=kwargs["batch_size"], seq_len=kwargs["seq_len"],
            checkpointing=kwargs["checkpointing"], device=cfg.device, zero_stage=kwargs["zero_stage"],
            gpus=kwargs["gpus"], optimizer=recipe.optimizer, packed=recipe.packing,
            loss_chunk=kwargs["loss_chunk"])
    return _expert_note(_context_note(plan, cfg, recipe, kwargs["batch_size"]), cfg, recipe)


def _expert_note(plan: planner.MemoryPlan, cfg: RunConfig, recipe: Recipe) -> planner.MemoryPlan:
    """Under expert parallelism a rank holds num_experts / ep experts of each layer and the rest
    whole: its weights, gradients and AdamW's states from `planner.ep_memory`; the activations
    stay the plain step's, which the formula says."""
    ep = recipe.expert_parallel
    if ep == 1:
        return plan
    states = planner.ep_memory(cfg.model, ep, recipe.precision, recipe.optimizer)
    note = (f"expert_parallel={ep}: {states['expert_params']:,} expert parameters (all "
            f"{planner.expert_params(cfg.model):,} / {ep}) + {states['replicated_params']:,} "
            "replicated (planner.ep_memory)")
    activation = ("; ".join(filter(None, (plan.formulas.get("activation"), (
        f"expert_parallel={ep}: as without it, the rows this rank's experts receive taken as its "
        "own routed rows (equal on average under uniform routing; the routing decides)")))))
    return _with_states(plan, states, {**plan.formulas, "param": note, "activation": activation})


def _with_states(plan: planner.MemoryPlan, states: dict, formulas: dict) -> planner.MemoryPlan:
    """`plan` (DDP's) with `planner.ep_memory`'s model states: each phase moved by their change
    (DDP's buckets hold the replicated gradients throughout, the experts' are made in the
    backward), its peak chosen again, the peak's other terms as before and the rest of its bytes
    the overhead (in the backward: less the experts' gradients, not yet made)."""
    moved = states["param_bytes"] + states["optimizer_bytes"] - plan.param_bytes - plan.optimizer_bytes
    buckets = states["grad_bytes"] * states["replicated_params"] // states["params"]
    phases = {phase: value + moved - plan.grad_bytes
              + (buckets if phase in ("backward", "forward") else states["grad_bytes"])
              for phase, value in plan.phase_bytes.items()}
    peak = max(phases, key=phases.get)
    held = plan.held_at_peak if peak == plan.peak_phase else ("param", "grad", "optimizer", "overhead")
    plan = dataclasses.replace(plan, num_params=states["params"], param_bytes=states["param_bytes"],
                               grad_bytes=states["grad_bytes"], optimizer_bytes=states["optimizer_bytes"],
                               phase_bytes=phases, peak_phase=peak, held_at_peak=held, formulas=formulas)
    rest = sum(getattr(plan, f"{term}_bytes") for term in held if term != "overhead")
    return dataclasses.replace(plan, overhead_bytes=phases[peak] - rest)


def _context_note(plan: planner.MemoryPlan, cfg: RunConfig, recipe: Recipe,
                  micro: int) -> planner.MemoryPlan:
    """Under context parallelism the plan is the plain step of each rank's seq_len / cp tokens;
    its activation formula says so, and names what that case leaves out."""
    cp = recipe.context_parallel
    if cp == 1:
        return plan
    block = context_parallel.output_copy_bytes(cfg.model, micro, cfg.seq_len, cp,
                                               tp=recipe.tensor_parallel, layers=1)
    note = (f"context_parallel={cp}: the plain step of this rank's {cfg.seq_len // cp} tokens a row; "
            "not counted: each block that keeps its activations keeps its attention output twice "
            f"(the ring's or Ulysses' layout and wo's input), {block:,} B a block in fp32 "
            "(context_parallel.output_copy_bytes)")
    activation = "; ".join(filter(None, (plan.formulas.get("activation"), note)))
    return dataclasses.replace(plan, formulas={**plan.formulas, "activation": activation})
