"""Pipeline parallelism in the recipe: the decoder cut into stage modules over the layout's pp
ranks, the step's micro-batches run by a torch.distributed.pipelining schedule.

    trainer = compose(cfg, Recipe(pipeline_parallel=2, pp_schedule="1f1b", micro_batches=4))
    trainer.step()  # the schedule's forwards and backwards, then this rank's stages' update

The model is built whole and alike on every rank; each rank keeps its stage modules (the
embedding with the first, the final norm, head and loss with the last; the blocks split evenly,
`even_bounds`) and the rest is dropped from `trainer.model`, which keeps the decoder's parameter
names. The loss is the mean of the micro-batches' losses (the schedule divides the gradients by
their count, `scale_grads`), as the plain step's; the last stage's rank broadcasts it over the pp
group. Data parallelism over the dp ranks of each stage: the gradients all-reduced and divided by
dp after the schedule (DDP's arithmetic, by hand: it holds for every schedule, the split
backwards' too).
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from labkit import planner
from labkit.blocks import transforms
from labkit.blocks.pipeline_schedule import (LOOPED, SCHEDULES, in_flight, local_stages, rank_of,
                                             stages_per_rank, torch_orders)
from labkit.blocks.pipeline_stages import StageModule, balance, min_layers
from labkit.blocks.training import Trainer, lm_loss
from labkit.config import ConfigError, RunConfig
from labkit.planner import pipeline as pipe_plan

PP_SCHEDULES = tuple(SCHEDULES)  # planner.pipeline.SCHEDULES, in its order
# autocast around the stages' forwards, or bf16 weights (bf16 sent between stages): each seen
# equal to the plain step within its rounding; fp16's GradScaler never sees the schedule's loss
PP_PRECISIONS = ("fp32", "bf16", "bf16_weights", "tf32")


def modules_of(recipe) -> int:
    """Stage modules in all: p, or p·v where a looped schedule gives each rank v (zbv: 2)."""
    return recipe.pipeline_parallel * stages_per_rank(recipe.pp_schedule, recipe.virtual_stages)


def even_bounds(num_layers: int, n: int) -> list[int]:
    """[0, b_1, ..., L]: module i runs blocks [b_i, b_{i+1}); the fewest blocks on the slowest
    module, counting blocks alone (`balance` with the embedding and head free), so every middle
    module holds one at least."""
    return balance({"embed": 0.0, "block": 1.0, "head": 0.0}, num_layers, n)


def clash(recipe) -> str | None:
    """What the pipeline's stage modules cannot carry (one line), or None. compose's pipeline
    path applies none of these transforms: without the refusal each would run the recipe
    without it. fp16 was tried: the schedule's backward never scales the loss, and the
    GradScaler's unscale_ fails ("Attempted unscale_ but _scale is None")."""
    if recipe.pipeline_parallel == 1:
        return None
    others = [f"{name}={getattr(recipe, name)}" for name, plain in (
        ("tensor_parallel", 1), ("context_parallel", 1), ("expert_parallel", 1), ("zero_stage", 0),
        ("offload", "none"), ("compile", False), ("packing", False), ("loss", "plain"),
        ("finetune", "none"), ("grad_compression", "none"), ("optimizer", "adamw"))
        if getattr(recipe, name) != plain]
    if others:
        return (f"pipeline_parallel runs the stage modules plain, with DDP's sum over dp by hand: "
                f"{', '.join(others)} would not apply to them; use it without pipeline_parallel")
    if recipe.precision not in PP_PRECISIONS:
        return (f"precision={recipe.precision} with pipeline_parallel: the schedule's backward "
                "never scales the loss by fp16's GradScaler; use fp32, bf16 or bf16_weights")
    return None


def shape_refusal(cfg: RunConfig, recipe) -> str | None:
    """Why the run's model or batch does not fit the schedule (one line), or None."""
    if recipe.pipeline_parallel == 1:
        return None
    n, p, m = modules_of(recipe), recipe.pipeline_parallel, recipe.micro_batches
    if cfg.model.tie_embeddings:
        return ("tie_embeddings=True puts one weight on the first and the last stage (its "
                "gradients would need summing); use tie_embeddings=False with pipeline_parallel")
    if cfg.model.num_layers < min_layers(n):
        return f"{n} stage modules need num_layers >= {min_layers(n)} (one block per middle module)"
    least = 2 * p - 1 if recipe.pp_schedule == "zbv" else 1 if recipe.pp_schedule == "gpipe" else p
    if m < least:
        return (f"pp_schedule={recipe.pp_schedule} needs micro_batches >= {least} on "
                f"{p} stages (fewer leave its warm-up unfilled)")
    if recipe.pp_schedule in ("interleaved_1f1b", "zero_bubble") and m % max(1, m // p):
        return f"torch's {recipe.pp_schedule} needs micro_batches a multiple of max(1, m // p) = {m // p}"
    return None


class PipelineStep:
    """This rank's stage modules and their schedule over the pp group; `run` is the trainer's
    forward_backward: one step's micro-batches, the mean loss on every rank."""

    def __init__(self, trainer: Trainer, recipe, layout, *, scale_grads: bool = True):
        cfg, model = trainer.cfg, trainer.model
        p, pp_rank = layout.pp, layout.pp_mesh.get_local_rank()
        self.trainer, self.layout, self.group = trainer, layout, layout.pp_mesh.get_group()
        self.n = modules_of(recipe)
        self.bounds = even_bounds(cfg.model.num_layers, self.n)
        self.ids = local_stages(recipe.pp_schedule, pp_rank, p, recipe.virtual_stages)
        self.modules = [StageModule(model, self.bounds[s], self.bounds[s + 1], first=s == 0,
                                    last=s == self.n - 1) for s in self.ids]
        device = torch.device(cfg.device)
        self.stages = [PipelineStage(mod, s, self.n, device, group=self.group)
                       for mod, s in zip(self.modules, self.ids)]
        looped = recipe.pp_schedule in LOOPED
        self.schedule = SCHEDULES[recipe.pp_schedule](
            self.stages if looped else self.stages[0], recipe.micro_batches, loss_fn=lm_loss,
            scale_grads=scale_grads)
        self.last_rank = layout.pp_mesh.mesh.flatten().tolist()[
            rank_of(recipe.pp_schedule, p)(self.n - 1)]  # global rank of the last module's
        keep_local(model, self.ids, self.bounds, self.n)

    def run(self) -> float:
        t = self.trainer
        losses: list[torch.Tensor] = []
        args = (t.inputs,) if 0 in self.ids else ()
        kwargs = {"target": t.targets, "losses": losses} if self.n - 1 in self.ids else {}
        with contextlib.ExitStack() as stack:
            for context in t.contexts:  # autocast around the forwards (and the loss)
                stack.enter_context(context())
            self.schedule.step(*args, return_outputs=False, **kwargs)
        if self.layout.dp > 1:  # DDP's average over the replicas of this stage, by hand
            dp_group = self.layout.dp_mesh.get_group()
            for param in t.model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=dp_group)
                    param.grad /= self.layout.dp
        loss = (torch.stack(losses).float().mean().detach() if losses
                else torch.zeros((), device=t.cfg.device))
        dist.broadcast(loss, src=self.last_rank, group=self.group)
        return loss.item()


def keep_local(model: nn.Module, ids: list[int], bounds: list[int], n: int) -> None:
    """Drop from the decoder what this rank's modules do not hold (an empty module in a block's
    place, so the kept ones keep their names): the rest of it lives on the other pp ranks."""
    kept = {i for s in ids for i in range(bounds[s], bounds[s + 1])}
    for i in range(len(model.layers)):
        if i not in kept:
            model.layers[i] = nn.Module()
    if 0 not in ids:
        model.embed = None
        if getattr(model, "pos_embed", None) is not None:
            model.pos_embed = None
    if n - 1 not in ids:
        model.norm, model.lm_head = None, None


def compose_pipeline(cfg: RunConfig, recipe, layout, *, lr: float, scale_grads: bool = True) -> Trainer:
    """compose's path for pipeline_parallel > 1: precision's autocast, checkpointing of the
    blocks, this dp rank's slice of the global batch, the stages and their schedule, AdamW over
    this rank's parameters."""
    trainer = Trainer(cfg, weights=transforms.weights_dtype(recipe.precision), lr=lr,
                      optimizer=False, batch_size=cfg.batch_size * layout.dp)
    transforms.apply_precision(trainer, recipe.precision)
    transforms.apply_checkpointing(trainer, recipe.checkpointing, every=recipe.checkpoint_every)
    if layout.dp > 1:
        r = layout.dp_mesh.get_local_rank()
        trainer.inputs, trainer.targets = (t.chunk(layout.dp)[r] for t in (trainer.inputs, trainer.targets))
    trainer.sizes = [cfg.batch_size // recipe.micro_batches] * recipe.micro_batches
    pipe = PipelineStep(trainer, recipe, layout, scale_grads=scale_grads)
    trainer.pipeline, trainer.forward_backward = pipe, pipe.run
    trainer.measure_norm = False  # this rank's stages' norm is not the model's
    trainer.build_optimizer()
    return trainer


def stage_plan(cfg: RunConfig, recipe, pp_rank: int) -> dict[str, int]:
    """The bytes one pp rank holds in fp32 (`planner.stage_params` of its modules, AdamW's two
    moments) and keeps for backward at its peak: the schedule's actions walked at the planner's
    bytes per micro-batch of each module (`planner.pipeline.stage_activation_bytes`,
    `pipeline_schedule.in_flight`), as the pipeline experiment predicts it."""
    n, p, m = modules_of(recipe), recipe.pipeline_parallel, recipe.micro_batches
    bounds, rows = even_bounds(cfg.model.num_layers, n), cfg.batch_size // m
    ids = local_stages(recipe.pp_schedule, pp_rank, p, recipe.virtual_stages)
    shape = dict(batch_size=rows, seq_len=cfg.seq_len)
    sizes = [planner.stage_params(dataclasses.replace(cfg.model, num_layers=bounds[s + 1] - bounds[s]),
                                  first=s == 0, last=s == n - 1) for s in ids]
    params = sum(sp.total for sp in sizes)
    # AdamW's step: torch's for-loop (the CPU's default) makes previous + 2 x current of its
    # temporaries at the largest pair, the multi-tensor one a copy of every v (planner.training)
    step = 4 * (max(sp.largest_pair for sp in sizes) if cfg.device == "cpu" else params)
    per_micro = [pipe_plan.stage_activation_bytes(cfg.model, blocks=bounds[s + 1] - bounds[s],
                                                  first=s == 0, last=s == n - 1, **shape)
                 for s in range(n)]
    loss = pipe_plan.loss_activation_bytes(cfg.model, **shape)
    orders = torch_orders(recipe.pp_schedule, p, m, recipe.virtual_stages)
    sharing = ((0, "W"),) + (((n - 1, "I"),) if rows == 1 else ())
    held = in_flight(orders, per_micro.__getitem__, early=lambda s: loss if s == n - 1 else 0,
                     sharing=sharing, shared=pipe_plan.pipeline_token_bytes(cfg.batch_size, cfg.seq_len))
    return {"params": params, "param_bytes": 4 * params, "activation_bytes": held[pp_rank],
            "step_bytes": step,
            "in_flight": pipe_plan.in_flight_micro_batches(recipe.pp_schedule, p, m, pp_rank,
                                                           recipe.virtual_stages)}


def no_case(recipe) -> str | None:
    """Why `planned` has no case for the recipe (one line), or None."""
    if recipe.precision != "fp32" or recipe.checkpointing != "none":
        return ("the planner's pipeline stages are fp32 without checkpointing "
                "(planner.pipeline.stage_activation_bytes): no case for "
                f"precision={recipe.precision}, checkpointing={recipe.checkpointing}")
    return None


def planned(cfg: RunConfig, recipe, world: int, rank: int):
    """`planner.MemoryPlan` of pp rank `rank // (world / pp)` (pp outermost): its modules' fp32
    weights, gradients and AdamW's two moments, and the saved activations at the schedule's
    peak (`stage_plan`), all held at once in the backward (an upper bound by the gradients not
    yet made); or the optimizer step's, with its temporaries (`stage_plan`'s step_bytes), where
    that is more. ConfigError where the planner has no case: its stage bytes are fp32's,
    without recomputation."""
    why = no_case(recipe)
    if why:
        raise ConfigError(why)
    pp_rank = rank // (world // recipe.pipeline_parallel)
    stage = stage_plan(cfg, recipe, pp_rank)
    states = stage["param_bytes"]
    note = (f"pipeline_parallel={recipe.pipeline_parallel}, {recipe.pp_schedule}: pp rank {pp_rank}'s "
            f"stage modules, {stage['params']:,} parameters (planner.stage_params)")
    phases = {"backward": 4 * states + stage["activation_bytes"], "step": 4 * states + stage["step_bytes"]}
    peak = max(phases, key=phases.get)
    return planner.MemoryPlan(
        num_params=stage["params"], param_bytes=states, grad_bytes=states, optimizer_bytes=2 * states,
        activation_bytes=stage["activation_bytes"], activation_bytes_per_layer=0,
        overhead_bytes=stage["step_bytes"] if peak == "step" else 0, phase_bytes=phases,
        held_at_peak=("param", "grad", "optimizer", "activation" if peak == "backward" else "overhead"),
        peak_phase=peak,
        formulas={"param": note, "activation": (
            f"{stage['in_flight']} micro-batch(es) in flight at the peak "
            "(planner.pipeline.in_flight_micro_batches); the schedule's actions walked at each "
            "module's bytes per micro-batch (planner.pipeline.stage_activation_bytes)")})
