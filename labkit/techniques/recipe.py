"""Recipes: several techniques on one training step at once, on every rank, against the plain step.

Each knob of `Config` turns one technique on (every default is off; its help says what it does);
`composed` is `labkit.blocks.recipe.compose` of them, in its fixed order. What each does and what
to look for: notebooks/text/26_recipe.md.

Variants:
- `plain` (the reference): fp32, nothing applied but the model converters (they say what
  trains), every rank computing the whole global batch (replicas x batch_size sequences) as one
  process would; `packing=True` trains the same documents one per padded row; a mixture of
  experts (num_experts > 0) routes per group of the rows one rank's micro-batch holds, as the
  composed ranks do (`labkit.blocks.expert_parallel`: what is equal, and why);
- `composed`: the recipe, checked against `plain` on the losses of `steps` steps and the whole
  weights after them, within the tolerance of its precision (8- and 4-bit optimizers:
  `optimizers.TOLERANCE`). A quantized base is lossy: `base_loss_delta` is the first batch's loss
  on it against the base before quantizing. Under `fault=corrupt_reduction` fault_rank scales its
  DDP buckets before the all-reduce, or its FSDP2 reduce-scatter shard after it, and the check
  must fail.

Every rank measures its own peak, model states, activations and speed, each beside the planner's
prediction for that exact recipe (`planned`). `budget_gib` is a virtual memory budget of
`composed` alone: a measured peak past it on any rank becomes an `oom` row on every rank, judged
after the check's steps on every rank together, so no rank stops inside a collective.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit import hardware, planner
from labkit.blocks import compression, expert_parallel, hf, lora, moe, optimizers, packing
from labkit.blocks import recipe as recipes
from labkit.blocks.distributed import (DistConfig, corrupt_reduction, corrupt_scale, is_distributed,
                                       world_size)
from labkit.blocks.context_parallel import CP_MODES
from labkit.blocks.pipeline_recipe import PP_SCHEDULES
from labkit.blocks.layout import Layout
from labkit.blocks.losses import LOSSES
from labkit.blocks.recipe import Recipe, compose
from labkit.blocks.training import Trainer, global_relative_difference, gradient_difference
from labkit.blocks.sharded import check_tp_shape, full_tensor
from labkit.blocks.transforms import FINETUNE, PRECISION_TOLERANCE, checkpointed_blocks, compute_dtype
from labkit.config import ConfigError, knob
from labkit.measure.comm import CommCounter
from labkit.measure.memory import ActivationMeter, LiveTensorTracker, storage_bytes
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("plain", "composed")
REFERENCE = "plain"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"timed_steps": 3, "seq_len": 32}, {"timed_steps": 2, "seq_len": 32, "num_layers": 2},
             {"timed_steps": 2, "seq_len": 32, "num_layers": 1})

PRECISIONS = ("fp32", "bf16", "fp16", "bf16_weights")
CHECKPOINTING = ("none", "full", "selective", "every_n")
OFFLOADS = ("none", "activations", "optimizer")
LR = 1e-3
# fp32 recipes reorder sums (ranks, micro-batches): ~1e-7 per element; relative 1e-5 of the
# weights' and losses' norms. The lossy precisions get mixed_precision's tolerance of the loss,
# also for the weights (AdamW's first updates are ±lr whatever the precision: the weights differ
# where a small gradient's sign does).
FP32_TOLERANCE = 1e-5


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="plain (the reference) or the composed recipe")
    precision: str = knob("fp32", choices=PRECISIONS, help="fp32; bf16/fp16 autocast over fp32 "
                          "weights (fp16 with a GradScaler); bf16 weights with fp32 master copies")
    checkpointing: str = knob("none", choices=CHECKPOINTING, help="activation checkpointing of the blocks")
    checkpoint_every: int = knob(2, min=1, help="every_n: every n-th block is checkpointed")
    micro_batches: int = knob(1, min=1, help="micro-batches per rank and step (must divide batch_size)")
    zero_stage: int = knob(0, min=0, max=3, help="0: DDP (several ranks); 1: sharded optimizer; "
                           "2: + sharded gradients (FSDP2); 3: + sharded parameters")
    offload: str = knob("none", choices=OFFLOADS, help="activations or optimizer states in host "
                        "memory (GPUs only)")
    tensor_parallel: int = knob(1, min=1, help="tensor-parallel degree: the ranks of one model "
                                "replica (must divide nproc)")
    compile: bool = knob(False, help="torch.compile each block")
    finetune: str = knob("none", choices=FINETUNE, help="lora: the base frozen, rank-lora_rank "
                         "adapters trained; qlora, lora_int8, lora_int4: the base's block "
                         "linears also in NF4, int8 or int4")
    lora_rank: int = knob(8, min=1, help="finetune: the adapters' rank r")
    lora_alpha: float = knob(16.0, min=0.0, help="finetune: outputs add (alpha / r) B A x")
    lora_targets: str = knob("q,v", help="finetune: comma list of q, k, v, o, gate, up, down "
                             "(or attn, all)")
    loss: str = knob("plain", choices=LOSSES, help="chunked: the head's matmul and the loss "
                     "fused, loss_chunk tokens of logits at a time (the logits never whole)")
    loss_chunk: int = knob(1024, min=1, help="loss=chunked: tokens of logits at a time")
    optimizer: str = knob("adamw", choices=optimizers.OPTIMIZERS, help="adamw8bit, adamw4bit: "
                          "AdamW's two moments block-quantized to 8 or 4 bits (torchao)")
    packing: bool = knob(False, help="documents of varied lengths packed into the rows with a "
                         "per-document mask (plain: the same documents, one per padded row)")
    grad_compression: str = knob("none", choices=compression.RECIPE_FORMATS,
                                 help="the gradients on the wire: bf16, fp16, int8 or powersgd DDP "
                                      "hooks; under FSDP2 bf16 alone, its reduce dtype")
    context_parallel: int = knob(1, min=1, help="context-parallel degree: the ranks that split each "
                                 "sequence's tokens, their attention over the group (cp_mode)")
    cp_mode: str = knob("ring", choices=CP_MODES,
                        help="context_parallel > 1: ring (contiguous blocks), ring_zigzag (pieces r "
                             "and 2n-1-r, balanced) or ulysses (all-to-all to head shards)")
    expert_parallel: int = knob(1, min=1, help="expert-parallel degree: the data-parallel replicas "
                                "that split each MoE layer's experts (num_experts > 0), rows sent "
                                "to them and back by all-to-all")
    pipeline_parallel: int = knob(1, min=1, help="pipeline-parallel degree: stages the model's blocks "
                                  "split over (the outermost ranks), micro_batches run by pp_schedule")
    pp_schedule: str = knob("1f1b", choices=PP_SCHEDULES,
                            help="pipeline_parallel > 1: the micro-batches' order (torch.distributed."
                                 "pipelining: GPipe, 1F1B, interleaved 1F1B, ZB1P, ZBV)")
    virtual_stages: int = knob(2, min=1, help="stage modules per rank of interleaved_1f1b and "
                               "zero_bubble (zbv: always 2)")
    steps: int = knob(2, min=1, help="training steps of the check (losses and weights after them)")
    budget_gib: float | None = knob(None, min=0.001, help="virtual memory budget of composed "
                                    "(plain runs without it): past it, an oom row")
    reduction_fault = True  # see composed_step


# What composed alone reads: plain is fp32 AdamW on the whole global batch, with no technique
# but the model converters (finetune and its lora knobs), the data (packing) and the ranks'
# layout that sets the global batch (tensor, context and pipeline degrees). A fault is composed's
# (corrupt_reduction) or the harness's (a crash or hang, at the first point's first variant).
COMPOSED_ONLY = ("precision", "checkpointing", "checkpoint_every", "zero_stage", "offload", "compile",
                 "loss", "loss_chunk", "optimizer", "grad_compression", "cp_mode", "expert_parallel",
                 "pp_schedule", "virtual_stages", "budget_gib", "fault", "fault_rank")


def reference_ignores(cfg: Config) -> tuple[str, ...]:
    """The knobs plain does not read (a sweep over them measures it once): COMPOSED_ONLY, and
    micro_batches but for a mixture of experts, whose plain routes per micro-batch's rows."""
    return COMPOSED_ONLY + (() if cfg.model.num_experts else ("micro_batches",))


def replicas(cfg: Config) -> int:
    """The data-parallel replicas (each computes its rows of the global batch): the ranks over
    the tensor- and context-parallel degrees."""
    return max(1, (cfg.nproc or world_size()) // (cfg.tensor_parallel * cfg.context_parallel
                                                   * cfg.pipeline_parallel))


def data_ranks(cfg: Config) -> int:
    """The ranks the data-parallel wrapper reduces the gradients over: replicas x context_parallel."""
    return replicas(cfg) * cfg.context_parallel


def recipe_of(cfg: Config) -> Recipe:
    """The knobs as a Recipe: the same names (its loss_scaling is the default's, on)."""
    return Recipe(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(Recipe)
                     if hasattr(cfg, f.name)})


def refused(cfg: Config) -> str | None:
    """Why compose would refuse this recipe on its ranks (one line), judged before they start
    (on nproc ranks, as if launched) and again on them."""
    ranks = world_size() if is_distributed() else cfg.nproc or 1
    return recipes.refusal(recipe_of(cfg), cfg.device, ranks, launched=True)


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"recipe chooses its precision with precision= (got dtype {cfg.dtype}); "
                          "valid dtype: float32")
    if cfg.memory_budget_gib is not None:
        raise ConfigError("recipe's budget is budget_gib, which bounds composed only; "
                          "memory_budget_gib would also bound plain, the reference")
    if cfg.budget_gib is not None and cfg.steps < 2:
        raise ConfigError(f"budget_gib needs steps >= 2 (got {cfg.steps}): the first step makes "
                          "AdamW's state, so the budget is judged at the peak only from the second")
    recipes.micro_batch_size(cfg.batch_size, cfg.micro_batches)
    if cfg.fault == "corrupt_reduction" and cfg.grad_compression != "none" and cfg.zero_stage < 2:
        raise ConfigError("fault=corrupt_reduction puts its own hook on DDP, which takes one beside "
                          "grad_compression's: use fault=none (the grad_compression experiment "
                          "injects both)")
    if cfg.fault == "corrupt_reduction" and cfg.pipeline_parallel > 1:
        raise ConfigError("fault=corrupt_reduction hooks DDP or FSDP2, which a pipeline recipe does "
                          "not build (its dp reduction is by hand): the fault would not be injected; "
                          "use fault=none")
    if cfg.tensor_parallel > 1:
        check_tp_shape(cfg, cfg.tensor_parallel)
    why = refused(cfg) or recipes.shape_refusal(cfg, recipe_of(cfg))
    if why:
        raise ConfigError(why)
    if cfg.packing and expert_parallel.groups_matter(cfg.model):
        raise ConfigError("packing's plain reference pads each document into a row of its own, so "
                          "its MoE capacity and load-balancing groups are not the recipe's: use "
                          "packing=False, or capacity_factor=0 and router_aux_loss_coef=0")


def skip_reason(cfg: Config) -> str | None:
    name = lora.missing_library(cfg.finetune)
    if name:  # plain applies the converters too
        return f"finetune={cfg.finetune} needs {name}, which is not installed: pip install labkit[finetune]"
    if cfg.variant == REFERENCE:
        return None
    name = optimizers.missing_library(cfg.optimizer)
    if name:
        return f"optimizer={cfg.optimizer} needs {name}, which is not installed: pip install labkit[finetune]"
    if cfg.offload != "none" and not cfg.device.startswith("cuda"):
        return (f"offload={cfg.offload} moves bytes from device to host memory; on CPU ranks they "
                "are the same memory, so there is nothing to save (runs on a GPU)")
    if cfg.precision.startswith("bf16") and cfg.device.startswith("cuda") \
            and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support (compute capability 8.0 or newer needed)"
    return None


class Observed:
    """What the check sees of a step that the harness's meters cannot: the gradients' bytes at
    the update (they are dropped after it), the activations one micro-batch's forward keeps, the
    bytes all-gathered per step, this variant's own live-tensor peak over build and check (the
    budget's measure), and plain's loss on a quantized base less its loss before (`plain_step`)."""

    def __init__(self):
        self.grad_bytes, self.activation_bytes, self.weight_copy_bytes = 0, None, 0
        self.all_gather_bytes, self.build_peak_bytes, self.base_loss_delta = 0.0, 0, None
        self.tracker = LiveTensorTracker()

    def record_grads(self, trainer: Trainer) -> None:
        self.grad_bytes = storage_bytes(p.grad for p in trainer.model.parameters() if p.grad is not None)


# --- the two steps --------------------------------------------------------------------------------

def plain_step(cfg: Config, seen: Observed) -> Trainer:
    """The plain fp32 step on the whole global batch (replicas x batch_size), on every rank,
    with the recipe's model converters (they say what trains: the reference trains the same).
    A quantized base's cost: the batch's loss on it less the loss before the converters (the
    adapters start at zero: only the base differs), in `seen.base_loss_delta`."""
    trainer = Trainer(cfg, lr=LR, batch_size=cfg.batch_size * replicas(cfg), optimizer=False)
    # an MoE's capacity and load-balancing loss per group of the rows one rank's micro-batch
    # holds, as the recipe's ranks route them (labkit.blocks.expert_parallel)
    moe.set_groups(trainer.model, expert_parallel.capacity_groups(replicas(cfg), cfg.micro_batches))
    if cfg.packing:  # the packed recipe's documents, each alone in its row
        packing.apply_packing(trainer, packing.pad_batch(recipes.packed_documents(cfg, replicas(cfg))),
                              document_mask=False)
    quantized = cfg.finetune in planner.BASE_FORMAT
    before = first_loss(trainer) if quantized else None
    recipes.apply_converters(trainer, recipe_of(cfg))
    if quantized:
        seen.base_loss_delta = first_loss(trainer) - before
    trainer.build_optimizer()
    return trainer


def first_loss(trainer: Trainer) -> float:
    with torch.no_grad():
        return trainer.forward().item()


def composed_step(cfg: Config) -> Trainer:
    """compose() of the recipe: the same global batch as plain's, each rank's slice of it split
    into micro_batches; with the fault's hook on its data parallelism (fault=corrupt_reduction,
    on fault_rank)."""
    trainer = compose(cfg, recipe_of(cfg), lr=LR)
    scale = corrupt_scale(cfg)
    if scale is not None:  # before the first backward, which DDP's comm hook must precede
        corrupt_reduction(trainer.net, scale)
    return trainer


def global_loss(loss: float, trainer: Trainer) -> float:
    """The global batch's mean loss: the mean of the ranks' (equal shares of its tokens: rows,
    or with context parallelism each row's shards; the ranks of a tensor-parallel group share
    theirs), or this one."""
    if trainer.cfg.variant == REFERENCE or world_size() == 1:
        return loss
    t = torch.tensor([loss], dtype=torch.float64)
    dist.all_reduce(t)  # gloo and NCCL: a CPU tensor goes through gloo's default group too
    return t.item() / world_size()


def observed_forward(trainer: Trainer, seen: Observed):
    """`Trainer.forward` measuring, once, what the first micro-batch's forward leaves allocated
    (`ActivationMeter`: every storage made in it and alive at its end, less the loss and the
    parameters); the copies of parameters that autocast cached and the backward keeps, and
    FSDP2's gathered ones, counted apart."""
    forward = trainer.forward

    def measured(inputs=None, targets=None, document_ids=None):
        if seen.activation_bytes is not None:
            return forward(inputs, targets, document_ids)
        out = []
        meter = ActivationMeter(trainer.model.parameters(), gathered=trainer.model.parameters).measure(
            lambda: out.append(forward(inputs, targets, document_ids)) or out[0])
        seen.activation_bytes, seen.weight_copy_bytes = meter.total_bytes, meter.weight_copy_bytes
        return out[0]

    return measured


def check(trainer: Trainer, seen: Observed, budget: int | None, cfg: Config) -> dict:
    """`steps` steps: the global losses, then the whole weights (host copies, gathered from
    shards: collectives in the same order on every rank); the budget judged on every rank.
    `cfg`: the experiment's (the trainer's holds one micro-batch). The budget's tracker runs
    only where there is a budget: a second dispatch mode over every op costs the steps time."""
    with seen.tracker if budget is not None else contextlib.nullcontext(), CommCounter() as comm:
        losses = [global_loss(trainer.step(), trainer) for _ in range(cfg.steps)]
    seen.all_gather_bytes = comm.bytes["all_gather"] / cfg.steps
    if budget is not None:
        over_budget(seen, budget, cfg)
    weights = expert_parallel.gather_experts(trainer, {n: full_tensor(p, cfg.device).float()
                                                       for n, p in trainer.model.named_parameters()})
    weights = {n: w.cpu().numpy().copy() for n, w in weights.items()}
    if getattr(trainer, "pipeline", None) is not None:  # each rank holds its stages': all of them
        every: list = [None] * world_size()
        dist.all_gather_object(every, weights)
        weights = {n: w for rank in every for n, w in rank.items()}
    return {"losses": losses, "weights": weights}


def over_budget(seen: Observed, budget: int, cfg: Config) -> None:
    """Raise torch.OutOfMemoryError on every rank when any rank's peak passed `budget`."""
    peak = torch.tensor([float(seen.tracker.peak_bytes)], dtype=torch.float64)
    if is_distributed():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if peak.item() > budget:
        plan = planned(cfg)
        predicted = "" if plan is None else f", predicted {plan.total_bytes / 2**20:.1f} MiB per rank"
        raise torch.OutOfMemoryError(
            f"over the {budget / 2**20:.1f} MiB budget: peak {peak.item() / 2**20:.1f} MiB on the "
            f"busiest rank{predicted}")


def build(cfg: Config) -> Workload:
    seen = Observed()
    budget = int(cfg.budget_gib * 2**30) if cfg.budget_gib and cfg.variant != REFERENCE else None
    with seen.tracker:  # the budget's measure starts with the build
        trainer = plain_step(cfg, seen) if cfg.variant == REFERENCE else composed_step(cfg)
    seen.build_peak_bytes = seen.tracker.peak_bytes
    trainer.grad_hooks.append(seen.record_grads)
    trainer.forward = observed_forward(trainer, seen)
    # this rank's: the global batch for plain, its slice otherwise; packed or padded, the
    # documents' tokens alone
    tokens = int((trainer.inputs != packing.PAD_ID).sum()) if cfg.packing else trainer.inputs.numel()
    return Workload(step=trainer.step, check=lambda: check(trainer, seen, budget, cfg),
                    tokens_per_step=tokens,
                    tensors={"param_bytes": lambda: [*trainer.model.parameters(), *trainer.model.buffers()],
                             "optimizer_bytes": trainer.optimizer_tensors},
                    report=lambda: report(seen), notes=notes(cfg), count_flops=False,
                    compute_dtype=compute_dtype(cfg.precision if cfg.variant != REFERENCE else "fp32"))


def report(seen: Observed) -> dict[str, float]:
    out = {"grad_bytes": float(seen.grad_bytes), "all_gather_bytes": seen.all_gather_bytes,
           "build_peak_bytes": float(seen.build_peak_bytes)}
    if seen.activation_bytes is not None:
        out["activation_bytes"] = float(seen.activation_bytes)
        out["saved_weight_copy_bytes"] = float(seen.weight_copy_bytes)
    if seen.base_loss_delta is not None:
        out["base_loss_delta"] = seen.base_loss_delta
    return out


def tolerance(cfg: Config) -> float:
    return max(PRECISION_TOLERANCE[cfg.precision], optimizers.TOLERANCE[cfg.optimizer],
               compression.RECIPE_TOLERANCE[cfg.grad_compression], FP32_TOLERANCE)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The losses of every step and the whole weights after them against plain's."""
    _, per_tensor = gradient_difference(reference["weights"], outputs["weights"])
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(outputs["losses"], reference["losses"]))
    tol = tolerance(cfg) if cfg.variant != REFERENCE else 0.0
    # The weights' difference over the whole model is what is checked; the largest per-tensor one
    # is shown (zero-initialised biases make it large without anything being wrong).
    checked = {"loss_rel_diff": loss_rel,
               "weight_rel_diff": global_relative_difference(reference["weights"], outputs["weights"])}
    ok = all(math.isfinite(v) and v <= tol for v in checked.values())
    message = "" if ok else ", ".join(f"{k} {v:.2e} (<= {tol:g})" for k, v in checked.items())
    return Comparison({"loss": outputs["losses"][-1],
                       "loss_delta": outputs["losses"][-1] - reference["losses"][-1], **checked,
                       "weight_max_rel_diff": per_tensor}, ok, message)


# --- predictions ----------------------------------------------------------------------------------

def planned(cfg: Config) -> planner.MemoryPlan | None:
    """The planner's step for this variant on one rank: plain's whole global batch in fp32 (with
    the recipe's model converters), or the recipe as compose builds it (`recipes.planned_memory`:
    its precision's case, converters, checkpointing, micro-batches and ZeRO stage over nproc).
    None where the planner has no case for the recipe (offload, compile)."""
    n = cfg.nproc or 2
    if cfg.variant == REFERENCE:
        rows, seq_len, _ = computed_shape(cfg)  # with packing: one padded row per document
        whole = dataclasses.replace(cfg, batch_size=rows, seq_len=seq_len)
        return recipes.planned_memory(whole, recipes.converters(recipe_of(cfg)))  # on one process
    try:  # the ranks differ where a pipeline's stages do
        return recipes.planned_memory(cfg, recipe_of(cfg), n, rank=dist.get_rank() if is_distributed() else 0)
    except ConfigError:
        return None


def computed_shape(cfg: Config) -> tuple[int, int, float]:
    """(rows, tokens per row, document tokens) this rank computes per step: plain the global
    batch (with packing: one padded row per document), composed its slice (with packing: its
    rows of documents, the document tokens its share of all of them)."""
    dp = replicas(dataclasses.replace(cfg, nproc=cfg.nproc or 2))
    plain = cfg.variant == REFERENCE
    rows = cfg.batch_size * (dp if plain else 1)
    if not cfg.packing:  # context parallel: each rank holds seq_len / cp tokens of every row
        seq_len = cfg.seq_len // (1 if plain else cfg.context_parallel)
        return rows, seq_len, rows * seq_len
    documents = recipes.packed_documents(cfg, dp)
    tokens = sum(len(d) for d in documents)
    return ((len(documents), max(len(d) for d in documents), tokens) if plain
            else (rows, cfg.seq_len, tokens / dp))


def step_flops(cfg: Config) -> int:
    """This rank's FLOPs per step: forward and backward of its rows, plus one more forward
    of each checkpointed block (less its MLP's down-projection, which recomputation stops
    before; selective recomputes only elementwise ops: 0)."""
    m = cfg.model
    plain = cfg.variant == REFERENCE
    batch, seq_len, _ = computed_shape(cfg)
    # context parallel: 1/cp of the whole rows' FLOPs, attention's pairs included (on average)
    cp = 1 if plain else cfg.context_parallel
    flops = planner.train_step_flops(m, batch=batch, seq_len=seq_len * cp, attention=cfg.attention) // cp
    if not plain:  # a tensor-parallel rank computes its share of the heads, MLP and vocabulary
        flops //= cfg.tensor_parallel
    if plain or cfg.checkpointing in ("none", "selective"):
        return flops
    k = len(checkpointed_blocks(m.num_layers, cfg.checkpointing, every=cfg.checkpoint_every))
    block = planner.forward_flops(m, batch=batch, new=seq_len * cp, keys=seq_len * cp,
                                  logits=0) // (m.num_layers * cp)
    return flops + k * (block - 2 * batch * seq_len * m.ffn_size * m.hidden_size) // cfg.tensor_parallel


def gathered_params(cfg: Config) -> int:
    """The parameters FSDP2 gathers: every Parameter, adapters included (a quantized base's
    block linears are buffers: each rank keeps them whole, never gathered)."""
    m, n = cfg.model, planner.num_params(cfg.model)
    if cfg.finetune == "none":
        return n
    n += planner.trainable_params(m, cfg.finetune, lora_rank=cfg.lora_rank,
                                  lora_targets=planner.parse_lora_targets(cfg.lora_targets))
    return n - (m.num_layers * planner.block_linear_params(m, biases=False) if cfg.finetune in planner.BASE_FORMAT else 0)


def build_peak(cfg: Config, plan: planner.MemoryPlan) -> int | None:
    """The fp32 model built whole (the batch's token ids beside it not counted); DDP's gradient
    buckets beside it (as large), made when it wraps (expert parallel: beside this rank's
    experts and the rest, buckets for the rest alone); under FSDP2 (ZeRO-2/3) on the meta device:
    the shards, and the largest parameter drawn whole beside its shard's copy. None for weights
    loaded from a folder under FSDP2 (built whole, then sharded: not predicted)."""
    whole, dp = 4 * planner.num_params(cfg.model), data_ranks(cfg)
    if cfg.variant == REFERENCE or dp == 1 or cfg.pipeline_parallel > 1:  # a pipeline: no wrapper
        return whole
    if cfg.zero_stage <= 1 and cfg.expert_parallel > 1:  # the experts sliced, then DDP's buckets
        replicated = planner.num_params(cfg.model) - planner.expert_params(cfg.model)  # (not theirs)
        return max(whole, 4 * (planner.ep_rank_params(cfg.model, cfg.expert_parallel) + replicated))
    if cfg.zero_stage <= 1:
        return 2 * whole
    if hf.loads_weights(cfg.model):
        return None
    largest = 4 * max(planner.stage_tensors(cfg.model))
    return plan.param_bytes + largest + largest // dp


def expected(cfg: Config) -> dict[str, float]:
    plan, out = planned(cfg), {"loss_delta": 0.0}
    if cfg.tensor_parallel == 1:  # (tensor parallelism all-gathers its logits too: not predicted)
        stage = cfg.zero_stage if cfg.variant != REFERENCE and data_ranks(cfg) > 1 else 0
        # bf16 gathers in bf16 where FSDP2's mixed-precision policy applies, as bf16_weights does
        recipe = recipe_of(cfg)
        policy = recipes.mixed_precision_policy(recipe, Layout.of(recipe, data_ranks(cfg) * cfg.pipeline_parallel,
                                                                  cfg.device))
        bf16 = cfg.precision == "bf16_weights" or policy is not None
        out["all_gather_bytes"] = planner.fsdp2_all_gather_bytes(
            gathered_params(cfg), zero_stage=stage, micro_batches=cfg.micro_batches,
            element_bytes=2 if bf16 else 4, root_params=planner.root_unit_params(cfg.model))
    if plan is not None:
        out.update(peak_mem_bytes=plan.total_bytes, param_bytes=plan.param_bytes,
                   grad_bytes=plan.grad_bytes, optimizer_bytes=plan.optimizer_bytes,
                   activation_bytes=plan.activation_bytes)
    built = build_peak(cfg, plan) if plan is not None and cfg.finetune == "none" \
        and (cfg.variant == REFERENCE or cfg.precision != "bf16_weights") else None  # plain: fp32
    if built is not None:
        out["build_peak_bytes"] = built
    if plan is not None:  # autocast's casts that its backward keeps (none without autocast)
        out["saved_weight_copy_bytes"] = plan.kept_weight_copy_bytes
    dtype = "float32" if cfg.variant == REFERENCE else compute_dtype(cfg.precision)
    peak = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads).get(dtype)
    if peak and (cfg.variant == REFERENCE or cfg.pipeline_parallel == 1):  # a stage's: not predicted
        step_s = step_flops(cfg) / (peak * 1e12)
        out.update(step_ms=step_s * 1e3, tokens_per_s=computed_shape(cfg)[2] / step_s)
    return {k: float(v) for k, v in out.items()}


def notes(cfg: Config) -> dict[str, str]:
    out = {"step_ms": "predicted: this rank's FLOPs (recomputation included) at the device's "
                      "peak for the precision: a bound, communication not counted.",
           "peak_mem_bytes": "this rank's, measured over one timed step; predicted: the "
                             "planner's training_memory for this exact recipe"
                             + (f" but for grad_compression={cfg.grad_compression}'s own buffers "
                                "(the hook's compressed copies, PowerSGD's P, Q and error "
                                "feedback), which it does not count" if cfg.variant != REFERENCE
                                and cfg.grad_compression not in ("none", "bf16", "fp16") else "") + ".",
           "grad_bytes": "at the optimizer step (dropped after it): DDP's buckets, FSDP2's "
                         "gradient shards or whole gradients.",
           "activation_bytes": "what the first micro-batch's forward leaves allocated for its "
                               "backward, parameters (and FSDP2's gathered blocks) left out.",
           "build_peak_bytes": "the live tensors' peak while the step was built: under ZeRO-2/3 "
                               "the model is built on the meta device, sharded, then each "
                               "parameter drawn whole in turn and its shard kept (not with "
                               "finetune: a quantized base and the adapters start from real weights).",
           "all_gather_bytes": "per step, what this rank's all-gathers delivered (each whole "
                               "output): FSDP2's parameters, in bf16 under its mixed-precision "
                               "policy (precision=bf16 with zero_stage 2 or 3), else in their "
                               "own dtype (fp32 under autocast, which casts after the gather)."}
    if cfg.context_parallel > 1 and cfg.variant != REFERENCE:
        out["activation_bytes"] += (f" Context parallel: seq_len / {cfg.context_parallel} tokens of "
                                    "each row; predicted as the plain step of those, which keeps each "
                                    "block's attention output once where the ring or Ulysses keeps "
                                    "it twice (context_parallel.output_copy_bytes, not added).")
    if cfg.pipeline_parallel > 1 and cfg.variant != REFERENCE:
        out["peak_mem_bytes"] = (f"this rank's, measured over one timed step; predicted: its stage "
                                 f"modules' model states and {cfg.pp_schedule}'s micro-batches in "
                                 "flight (labkit.blocks.pipeline_recipe.planned; none with "
                                 "checkpointing or 16-bit precision). The schedule runs the "
                                 "forwards: activation_bytes and step_ms not measured or predicted.")
    if cfg.variant == REFERENCE:
        out["tokens_per_s"] = "every rank computes the whole global batch (as one process would)."
    if cfg.packing:
        out["tokens_per_s"] = " ".join(filter(None, [out.get("tokens_per_s"), (
            "The documents' tokens (pads not counted): plain's in one padded row each, composed's "
            "packed into its rows (predicted: its share of all the documents' tokens).")]))
    if cfg.variant == REFERENCE and cfg.finetune in planner.BASE_FORMAT:
        out["base_loss_delta"] = (f"the first batch's loss on the {planner.BASE_FORMAT[cfg.finetune]} "
                                  "base less its loss before quantizing (lossy: what the "
                                  "quantized base costs; both variants train on it)")
    if cfg.optimizer != "adamw" and cfg.variant != REFERENCE:
        where = ("compiled" if cfg.device.startswith("cuda")
                 else "eager (on a CPU, rather than pay torchao's compile before the first step)")
        out["optimizer_bytes"] = (f"{cfg.optimizer}: each moment of a tensor of >= {planner.QUANTIZED_MIN} "
                                  f"elements in {planner.LOW_BIT[cfg.optimizer].bits}-bit codes with block scales, "
                                  f"smaller ones fp32; the update {where}, its temporaries in the "
                                  "step phase (planner.low_bit_update_bytes).")
    if cfg.precision in ("bf16", "fp16") and cfg.variant != REFERENCE:
        out["saved_weight_copy_bytes"] = ("autocast's cached 16-bit casts of the weights that "
                                          "the backward keeps (none in checkpointed blocks); "
                                          "none under FSDP2's bf16 policy (zero_stage 2 or 3), "
                                          "whose bf16 weights are its gathered parameters.")
    return out
