"""Expert parallelism as a transform of a training step (`Recipe(expert_parallel=N)`): each MoE
layer's experts split over an ep group of data-parallel replicas (each keeps num_experts / ep of
them), every routed row sent to its expert's owner and back with all-to-all
(`labkit.blocks.moe.ExpertParallel`), the experts' gradients kept out of DDP and reduced by hand
over the ranks that hold the same experts. `compose` applies it after tensor and context
parallelism, before the data-parallel wrapper (which must be told to leave the experts out).

    apply_expert_parallel(trainer, layout.ep_mesh, layout.ep_replicas_mesh, data_ranks=layout.dp_cp)

What the recipe's step equals, and why. A rank's forward routes its own micro-batch's tokens:
the capacity C = ceil(factor x T x k / E) and the load-balancing loss E x sum_i f_i P_i are
computed over that micro-batch's T tokens (one group), with or without expert parallelism. The
plain step of the global batch that routes the same way splits its rows into the same groups:
`capacity_groups` = dp x micro_batches groups of consecutive rows (`moe.set_groups`). Then, in
exact arithmetic:
- every token picks the same k experts with the same weights (its own router logits), the same
  assignments are dropped (the queues fill per group, in token order), and each kept row passes
  through the same expert weights, here or on the expert's owner;
- the loss: each rank's is its micro-batches' mean cross-entropy plus coef x the mean over layers
  of its groups' aux losses, weighted by their share; the mean over the dp ranks (DDP) is the
  plain step's cross-entropy plus coef x the mean over all groups: the plain step's loss;
- the gradients: a replicated weight's are DDP's mean over the ranks, as for a dense model; an
  expert's reach its owner through the all-to-all's backward from every rank of the ep group, so
  the owner holds the sum over that group of d(rank loss)/dW; the global loss is the mean over the
  dp ranks, so the expert's gradient is the sum of that over the dp / ep ranks holding the same
  experts, divided by dp (`ExpertReduction`): DDP's mean over all dp ranks would instead average
  different experts' gradients together (and its constructor's broadcast of rank 0's weights,
  seen without the ignore list, gives every rank rank 0's experts).
The gradient norm the Trainer measures is this rank's (its own experts), not the whole model's.
In fp32 the results differ by rounding only (other matmul shapes, sums in another order); a
router logit within rounding of a tie could pick another expert, which the seeded tiny model
does not meet. With capacity_factor=0 (no limit: Mixtral's, Qwen2-MoE's) and
router_aux_loss_coef=0 the groups do not matter: the plain step's one group gives the same step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from labkit.blocks import moe
from labkit.config import ModelConfig


def capacity_groups(replicas: int, micro_batches: int) -> int:
    """The routing groups of the plain step of the global batch that route as the recipe's ranks
    do: one per rank's micro-batch, consecutive rows (replica-major, then micro-batch)."""
    return replicas * micro_batches


def groups_matter(model: ModelConfig) -> bool:
    """Whether an MoE's step depends on how its tokens are grouped: a capacity that can drop, or
    a load-balancing loss (a product of two per-group means) in the loss."""
    return bool(model.num_experts and (model.capacity_factor or model.router_aux_loss_coef))


def shape_refusal(model: ModelConfig, ep: int) -> str | None:
    """Why the model's experts do not split over `ep` ranks (one line), or None."""
    if ep == 1:
        return None
    if not model.num_experts:
        return (f"expert_parallel={ep} splits a mixture of experts; this model is dense: set "
                "num_experts (e.g. --set num_experts=4)")
    if model.num_experts % ep:
        return (f"expert_parallel={ep} splits each layer's num_experts={model.num_experts} experts "
                f"evenly: use a divisor of {model.num_experts}")
    return None


@dataclass
class ExpertReduction:
    """The experts' gradients, after the last backward: summed over `group` (the ranks holding
    the same experts; None: this rank alone) and divided by `divisor` (the ranks whose mean loss
    is the step's: dp). A Trainer.reduce_grads. Under a GradScaler an overflow in one rank's
    experts is made every rank's (`share_overflow`), so all of them skip the step together."""

    params: list[torch.nn.Parameter] = field(repr=False)
    group: object
    divisor: int

    def __call__(self, trainer) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        for g in grads:
            if self.group is not None:
                dist.all_reduce(g, group=self.group)
            g.div_(self.divisor)
        if trainer.scaler is not None and grads:
            share_overflow(grads)


def share_overflow(grads: list[torch.Tensor]) -> None:
    """One all-reduce (max) over every rank of whether any rank's expert gradients hold an inf
    or nan; if so, an inf in this rank's too. DDP's sum spreads an overflow in a replicated
    gradient to every rank, but each rank's experts are its own: without this, the ranks whose
    experts did not overflow would step while the others' scalers skip, and the replicas part."""
    bad = torch.stack([g.isfinite().all().logical_not() for g in grads]).any().float().reshape(1)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        grads[0].view(-1)[0] = float("inf")


def expert_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if moe.is_expert_param(name)]


def apply_expert_parallel(trainer, ep_mesh, replicas_mesh, *, data_ranks: int):
    """Each MoE layer keeps this rank's num_experts / ep experts of `ep_mesh`'s group (its slice of
    the stacked weights every rank built alike) and dispatches over that group with all-to-all;
    DDP is told to leave those weights out; `trainer.expert_reduction` sums their gradients over
    `replicas_mesh` (the ranks with the same experts) and divides by `data_ranks`;
    `trainer.expert_group` is the ep group."""
    trainer.expert_group = ep_mesh.get_group()
    moe.apply_expert_parallel(trainer.model, group=trainer.expert_group)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        trainer.model, expert_names(trainer.model))
    group = replicas_mesh.get_group() if replicas_mesh.size() > 1 else None
    trainer.expert_reduction = ExpertReduction(moe.expert_parameters(trainer.model), group, data_ranks)
    trainer.reduce_grads = trainer.expert_reduction
    return trainer


def traffic(model: torch.nn.Module) -> list[list[int]]:
    """The rows this rank sent each rank of its ep group in the last forward, per MoE layer."""
    return [layer.dispatch.traffic[0] for layer in moe.moe_layers(model)
            if isinstance(layer.dispatch, moe.ExpertParallel)]


def gather_experts(trainer, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` by parameter name (weights or gradients), each expert weight's slice gathered
    whole from the ep group in rank order: as one process holds it. A collective on every rank
    of the group; unchanged without expert parallelism."""
    group = getattr(trainer, "expert_group", None)
    if group is None:
        return tensors
    out = dict(tensors)
    for name in expert_names(trainer.model):
        mine = tensors[name].contiguous()
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, mine, group=group)
        out[name] = torch.cat(parts)
    return out
