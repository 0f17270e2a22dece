"""Mixture of experts with expert parallelism: the decoder's MoE feed-forward (top-k router,
capacity, dropped tokens, load-balancing loss) trained on n ranks, each keeping E/n experts.

- `single` (the reference): every rank runs the whole model on the whole global batch (n x
  batch_size rows), capacity counted per rank's rows (n groups, as `ep` routes them), no
  communication.
- `ep`: expert and data parallel: each rank trains its own batch_size rows and keeps E/n experts
  of every layer, the rest replicated. Per MoE layer an all-to-all of the per-expert counts, one
  of the routed rows to their experts' owners and one back (`labkit.blocks.moe.ExpertParallel`;
  the backward sends the gradients back the same way); the replicated weights' gradients
  all-reduced (summed: each rank's loss weighted 1/n).
Checked against `single`: each rank's logits, the global loss (with the load-balancing loss) and
every gradient (experts gathered whole), within fp32 rounding. Measured beside predicted: the
all-to-all bytes (CommCounter) against the formula from the routing, the bytes sent to other
ranks against uniform routing's, the dropped share against sum_e max(0, load_e - C), the load
imbalance and the aux loss, parameter bytes per rank against the planner. moe_fault
(unweighted_combine, wrong_rank) and fault=corrupt_reduction must fail the check.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from labkit import planner
from labkit.blocks import moe
from labkit.blocks.distributed import DistConfig, corrupt_scale, default_nproc, rank, world_size
from labkit.blocks.losses import lm_loss
from labkit.blocks.training import Trainer, compare_grads
from labkit.config import PRESETS, ConfigError, knob
from labkit.measure.comm import CommCounter
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("single", "ep")
REFERENCE = "single"
# The MoE shape at every preset (the Config mirrors these knobs: one name sets both); tiny: 2
# layers of 4 experts, 128 tokens per rank.
SHAPE = {"num_experts": 4, "experts_per_token": 2, "capacity_factor": 1.25, "router_aux_loss_coef": 0.01}
SIZES = {p: dict(SHAPE) for p in PRESETS} | {
    "tiny": {**SHAPE, "moe_ffn_size": 256, "num_layers": 2, "batch_size": 4, "seq_len": 32}}
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"timed_steps": 2}, {"timed_steps": 1, "seq_len": 16, "num_layers": 1})
MIRRORED = tuple(SHAPE)
LR = 1e-3
# Relative differences allowed against `single` (fp32): the same rows through the same experts
# in the same order, other matmul shapes and sums of gradients over ranks in another order.
TOLERANCE = 1e-5
# torch 2.13 renamed the tensor form and deprecates the old name, which 2.6 needs
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="one process's whole MoE, or expert parallel")
    num_experts: int = knob(4, min=1, help="experts per MoE layer (a multiple of the ranks)")
    experts_per_token: int = knob(2, min=1, help="k of top-k: the experts each token is sent to")
    capacity_factor: float = knob(1.25, min=0.0, help="expert capacity = ceil(factor x tokens x k / "
                                  "experts) per rank's tokens, the rest dropped; 0: no limit")
    router_aux_loss_coef: float = knob(0.01, min=0.0, help="weight of the load-balancing loss")
    moe_fault: str = knob("none", choices=moe.FAULTS, help="a bug on purpose, for the check to "
                          "catch: expert outputs combined without router weights, or rows sent "
                          "to the wrong rank")
    reduction_fault = True  # fault_rank's replicated gradients doubled before the all-reduce


def ep_degree(cfg: Config) -> int:
    """n: every rank keeps E/n experts (1 for the reference, which keeps them all)."""
    return 1 if cfg.variant == REFERENCE else cfg.nproc or default_nproc(cfg.device)


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"moe checks against one process in float32 (got {cfg.dtype}); valid: float32")
    for name in MIRRORED:
        if getattr(cfg, name) != getattr(cfg.model, name):
            raise ConfigError(f"{name}: the run's {getattr(cfg, name)} and the model's "
                              f"{getattr(cfg.model, name)} differ; set it by name (both follow)")
    n = cfg.nproc or default_nproc(cfg.device)
    if cfg.num_experts % n:
        raise ConfigError(f"num_experts={cfg.num_experts} does not split over {n} ranks; "
                          f"valid: a multiple of {n}")


def reference_ignores(cfg: Config) -> tuple[str, ...]:
    """`single` routes on one process: no expert-parallel dispatch for moe_fault to break."""
    return ("moe_fault",)


def build_step(cfg: Config) -> Trainer:
    """The plain step on the global batch; `ep` keeps this rank's rows and experts, weighs its
    loss 1/n and sums the replicated gradients; then AdamW over what this rank holds."""
    n, r = world_size(), rank()
    trainer = Trainer(cfg, lr=LR, batch_size=cfg.batch_size * n, optimizer=False)
    if cfg.variant == REFERENCE:
        moe.set_groups(trainer.model, n)  # capacity per rank's rows, as ep routes them
    else:
        rows = slice(r * cfg.batch_size, (r + 1) * cfg.batch_size)
        trainer.inputs, trainer.targets = trainer.inputs[rows], trainer.targets[rows]
        moe.apply_expert_parallel(trainer.model, fault=cfg.moe_fault)
        trainer.loss_weight = 1 / n
        trainer.reduce_grads = functools.partial(reduce_replicated, scale=corrupt_scale(cfg))
    trainer.grads_at_rest, trainer.measure_norm = True, False
    trainer.build_optimizer()
    return trainer


def reduce_replicated(trainer: Trainer, scale: float | None) -> None:
    """One all-reduce (sum) of every replicated parameter's gradient, flattened; the experts'
    are whole already (the all-to-all's backward brought every rank's rows). `scale`: the fault."""
    grads = [p.grad for name, p in trainer.model.named_parameters()
             if not moe.is_expert_param(name) and p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if scale is not None:
        flat.mul_(scale)
    dist.all_reduce(flat)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def whole_grads(trainer: Trainer, ep: bool) -> dict[str, np.ndarray]:
    """Host copies of every gradient, an expert's gathered from every rank (in rank order)."""
    out = {}
    for name, p in trainer.model.named_parameters():
        g = p.grad.detach()
        if ep and moe.is_expert_param(name):
            whole = g.new_empty((world_size() * g.shape[0], *g.shape[1:]))
            ALL_GATHER(whole, g.contiguous())
            g = whole
        out[name] = g.cpu().numpy().copy()
    return out


def check_step(trainer: Trainer, cfg: Config, facts: dict) -> dict:
    """One training step: this rank's logits, the global loss, whole gradients; its
    communication counted and its routing read into `facts`."""
    n, r, ep = world_size(), rank(), cfg.variant != REFERENCE
    trainer.drop_grads()
    with CommCounter() as counter:
        logits = trainer.model(trainer.inputs)  # (rows, T, V)
        loss = moe.add_aux_loss(trainer.model, lm_loss(logits, trainer.targets))
        trainer.backward(loss)
        if trainer.reduce_grads is not None:
            trainer.reduce_grads(trainer)
    facts.update(counter.metrics(), all_to_all_bytes=float(counter.bytes["all_to_all"]))
    facts.update(routing_facts(trainer, 0 if ep else r))
    total = loss.detach().clone()
    if ep:
        dist.all_reduce(total)
    mine = logits if ep else logits[r * cfg.batch_size:(r + 1) * cfg.batch_size]
    out = {"loss": total.item() / (n if ep else 1), "logits": mine.detach().cpu().numpy().copy(),
           "grads": whole_grads(trainer, ep)}
    trainer.update()
    return out


def routing_facts(trainer: Trainer, group: int) -> dict:
    """This rank's tokens' routing in every layer: loads (before drops) and kept per expert,
    mean router probabilities, the capacity, the aux loss, and (ep) the split sizes sent."""
    layers = moe.moe_layers(trainer.model)
    E = layers[0].cfg.num_experts
    out: dict = {"loads": [], "kept": [], "probs": [], "aux": [], "sends": []}
    for layer in layers:
        mine = moe.group_routing(layer.routing, group)
        out["loads"].append(moe.group_loads(mine, E)[0].tolist())
        out["kept"].append(moe.group_loads(mine, E, kept=True)[0].tolist())
        out["probs"].append(mine.probs.mean(0).tolist())
        out["aux"].append(moe.aux_loss(mine, E).item())
        if isinstance(layer.dispatch, moe.ExpertParallel):
            out["sends"].append(layer.dispatch.traffic)
    out["capacity"], out["tokens"] = mine.capacity, len(mine.probs)
    return out


def measured_metrics(f: dict, cfg: Config) -> dict[str, float]:
    """The rows' values from one check step's facts."""
    k, d = cfg.experts_per_token, cfg.model.hidden_size
    loads, kept = np.array(f["loads"]), np.array(f["kept"])
    out = {"dropped_fraction": float((loads - kept).sum() / (len(loads) * f["tokens"] * k)),
           "load_imbalance": float(np.mean(loads.max(1) / loads.mean(1))),
           "aux_loss": float(np.mean(f["aux"])),
           "capacity_tokens": float(f["capacity"])}
    out.update({m: f[m] for m in ("comm_bytes", "comm_bus_bytes", "all_reduce_count", "all_to_all_bytes")})
    if f["sends"]:  # split sizes handed to all_to_all: rows out to other ranks and back, x 2 for backward
        r = rank()
        rows = sum(sum(s) - s[r] + sum(v) - v[r] for s, v in f["sends"])
        out.update(offrank_bytes=float(2 * rows * d * 4), all_to_all_count=f["all_to_all_count"])
    return out


def routing_predictions(f: dict, cfg: Config) -> dict[str, float]:
    """From this step's routing: drops sum_e max(0, load_e - C), the aux loss's formula, and
    (ep) the all-to-all bytes of every rank's split sizes (gathered: every rank calls this)."""
    m, k, T = cfg.model, cfg.experts_per_token, f["tokens"]
    dropped = sum(planner.dropped_assignments(loads, f["capacity"]) for loads in f["loads"])
    out = {"dropped_fraction": dropped / (len(f["loads"]) * T * k),
           "aux_loss": float(np.mean([planner.load_balancing_loss(lo, p, T)
                                      for lo, p in zip(f["loads"], f["probs"])]))}
    if cfg.variant != REFERENCE:
        everyone = [None] * world_size()
        dist.all_gather_object(everyone, [s for s, _ in f["sends"]])
        sends = [[everyone[i][layer] for i in range(world_size())] for layer in range(len(f["sends"]))]
        a2a = planner.all_to_all_bytes(sends, rank(), hidden=m.hidden_size, num_experts=m.num_experts)
        out.update(all_to_all_bytes=float(a2a), comm_bytes=float(a2a + 4 * replicated_params(cfg)))
    return out


def replicated_params(cfg: Config) -> int:
    return planner.num_params(cfg.model) - planner.expert_params(cfg.model)


def build(cfg: Config) -> Workload:
    trainer = build_step(cfg)
    facts: dict = {}  # filled by the check step
    return Workload(step=trainer.step, check=functools.partial(check_step, trainer, cfg, facts),
                    tokens_per_step=len(trainer.inputs) * cfg.seq_len,
                    tensors={"param_bytes": trainer.model.parameters,
                             "expert_param_bytes": functools.partial(moe.expert_parameters, trainer.model),
                             "grad_bytes": lambda: [p.grad for p in trainer.model.parameters()],
                             "optimizer_bytes": trainer.optimizer_tensors},
                    report=lambda: measured_metrics(facts, cfg),
                    predicted=lambda: routing_predictions(facts, cfg),
                    notes=notes(cfg), count_flops=False, compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """This rank's logits, the global loss and every gradient against one process's."""
    logits = float(np.abs(outputs["logits"].astype(np.float64) - reference["logits"]).max())
    loss = abs(outputs["loss"] - reference["loss"])
    return compare_grads(reference, outputs, TOLERANCE,
                         extra={"logits_max_abs_diff": logits, "loss_abs_diff": loss})


def expected(cfg: Config) -> dict[str, float]:
    """Per rank, from the shapes: parameters (E/n experts, the rest whole), their gradients and
    AdamW's moments; uniform routing's load imbalance and off-rank bytes; the all-to-all count."""
    m, n = cfg.model, ep_degree(cfg)
    T, k, E = cfg.batch_size * cfg.seq_len, cfg.experts_per_token, cfg.num_experts
    params = planner.ep_rank_params(m, n)
    out = {"param_bytes": 4.0 * params, "grad_bytes": 4.0 * params, "optimizer_bytes": 8.0 * params,
           "expert_param_bytes": 4.0 * planner.expert_params(m) / n,
           "capacity_tokens": float(planner.capacity(T, k, E, cfg.capacity_factor)),
           "load_imbalance": planner.uniform_max_load_ratio(T, k, E),
           "logits_max_abs_diff": 0.0, "loss_abs_diff": 0.0, "grad_max_rel_diff": 0.0}
    if n > 1:
        out.update(offrank_bytes=planner.uniform_offrank_bytes(m, T, n),
                   all_to_all_count=5.0 * m.num_layers, all_reduce_count=1.0)
    return out


def notes(cfg: Config) -> dict[str, str]:
    T, k, E = cfg.batch_size * cfg.seq_len, cfg.experts_per_token, cfg.num_experts
    uniform = planner.uniform_drop_fraction(T, k, E, cfg.capacity_factor)
    return {"dropped_fraction": "assignments over capacity / tokens x k, this rank's tokens, every "
                                "layer; predicted: sum_e max(0, load_e - C) of the router's loads "
                                f"(exact). Uniform routing would drop {uniform:.2%}.",
            "load_imbalance": "max / mean expert load (before drops), mean over layers; predicted: "
                              "uniform routing's expected max (independent binomial loads).",
            "aux_loss": "E x sum_i f_i P_i, this rank's tokens, mean over layers (k at perfect "
                        "balance); predicted: the formula on the loads and mean probabilities.",
            "all_to_all_bytes": "counted by CommCounter: S = max(input, output) per all-to-all; "
                                "predicted: 8E + 4 x max(rows sent, received) x d x 4 per layer, "
                                "from every rank's split sizes.",
            "offrank_bytes": "rows handed to other ranks, forward and backward, x d x 4; predicted: "
                             "uniform routing, (n-1)/n of the kept assignments.",
            "comm_bytes": "the all-to-alls and one all-reduce of the replicated gradients.",
            "optimizer_bytes": "AdamW's m and v (8 bytes a parameter; the step counters, 4 bytes "
                               "a tensor, left out)."}
