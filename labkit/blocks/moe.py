"""Mixture-of-experts feed-forward (`MoE`, the decoder's MLP when ModelConfig.num_experts > 0),
and expert parallelism (`apply_expert_parallel`: each rank keeps num_experts / n experts, tokens
dispatched to their owners and combined back with all-to-all).

- Routing (`route`), as Mixtral and Qwen2-MoE in transformers: probabilities = softmax(router(x))
  in fp32, the k largest per token, their weights renormalised to sum to 1 (`norm_topk_prob`).
- Capacity (GShard, Switch): the tokens are split into `groups` (one data-parallel rank's tokens
  form one); each expert takes at most C = ceil(capacity_factor x tokens x k / E) of a group's
  assignments, every first choice before any second one, in token order (`kept_mask`). A dropped
  assignment adds nothing; a token whose every assignment is dropped keeps its residual alone.
  capacity_factor 0: no limit (Mixtral and Qwen2-MoE are dropless).
- Load-balancing loss (Switch eqs. 4-6, transformers' `load_balancing_loss_func`): per group
  E x sum_i f_i P_i, f_i the share of the group's tokens that chose expert i (before drops; the
  f_i sum to k), P_i expert i's mean router probability; averaged over groups and layers, times
  router_aux_loss_coef, added to the training loss (`add_aux_loss`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labkit.config import ModelConfig
from labkit.planner.moe import capacity

FAULTS = ("none", "unweighted_combine", "wrong_rank")


@dataclass
class Routing:
    """One forward's routing of T tokens to k experts each."""

    experts: torch.Tensor  # (T, k) int64: the expert of each assignment, largest weight first
    weights: torch.Tensor  # (T, k) fp32: its router weight
    kept: torch.Tensor  # (T, k) bool: within its expert's capacity
    probs: torch.Tensor  # (T, E) fp32: router probabilities (the loss's P)
    capacity: int  # assignments per expert and group; 0: no limit
    groups: int = 1


def kept_mask(experts: torch.Tensor, num_experts: int, cap: int, groups: int = 1) -> torch.Tensor:
    """(T, k) bool: each assignment's place in its expert's queue is below `cap`, queues filled
    per group, slot-major (every token's first choice before any token's second) in token order."""
    if not cap:
        return torch.ones_like(experts, dtype=torch.bool)
    T, k = experts.shape
    queue = experts.view(groups, T // groups, k).transpose(1, 2).reshape(groups, -1)  # (G, k Tg)
    hits = F.one_hot(queue, num_experts)  # (G, k Tg, E)
    place = (hits.cumsum(1) * hits).sum(-1) - 1
    return (place < cap).view(groups, k, T // groups).transpose(1, 2).reshape(T, k)


def route(logits: torch.Tensor, k: int, *, factor: float, groups: int = 1,
          norm: bool = True) -> Routing:
    """Top-k routing of logits (T, E), with capacity per group of T / groups tokens."""
    probs = logits.float().softmax(-1)
    weights, experts = probs.topk(k, dim=-1)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    T, E = probs.shape
    cap = capacity(T // groups, k, E, factor)
    return Routing(experts, weights, kept_mask(experts, E, cap, groups), probs, cap, groups)


def group_loads(routing: Routing, num_experts: int, kept: bool = False) -> torch.Tensor:
    """(groups, E) int64: assignments each expert got from each group (before drops, or kept)."""
    hits = F.one_hot(routing.experts, num_experts)  # (T, k, E)
    if kept:
        hits = hits * routing.kept[..., None]
    return hits.view(routing.groups, -1, num_experts).sum(1)


def group_routing(routing: Routing, group: int) -> Routing:
    """The routing of one capacity group's tokens alone (groups=1)."""
    T = routing.probs.shape[0] // routing.groups
    rows = slice(group * T, (group + 1) * T)
    return Routing(routing.experts[rows], routing.weights[rows], routing.kept[rows],
                   routing.probs[rows], routing.capacity)


def aux_loss(routing: Routing, num_experts: int) -> torch.Tensor:
    """E x sum_i f_i P_i per group, averaged over the groups (a scalar; k at perfect balance)."""
    G = routing.groups
    f = group_loads(routing, num_experts).float() / (routing.probs.shape[0] // G)  # (G, E)
    P = routing.probs.view(G, -1, num_experts).mean(1)
    return num_experts * (f * P).sum(-1).mean()


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights (nn.Linear's (out, in) per expert): w2(silu(w1 x) * w3 x)."""

    def __init__(self, num_experts: int, d: int, f: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(num_experts, f, d))
        self.w3 = nn.Parameter(torch.empty(num_experts, f, d))
        self.w2 = nn.Parameter(torch.empty(num_experts, d, f))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x (A, d), its rows grouped by expert, counts[e] for local expert e -> (A, d)."""
        out = [F.linear(F.silu(F.linear(rows, self.w1[e])) * F.linear(rows, self.w3[e]), self.w2[e])
               for e, rows in enumerate(x.split(counts))]
        return torch.cat(out) if out else x[:0]


class SwiGLU(nn.Module):
    """Qwen2-MoE's shared expert: a plain SwiGLU MLP."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def assignments(routing: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept assignments as (token, expert, weight), each (A,), sorted by expert, in token
    order within one (stable: the order an expert's rows keep however the tokens are split)."""
    T, k = routing.experts.shape
    token = torch.arange(T, device=routing.experts.device).repeat_interleave(k)
    keep = routing.kept.reshape(-1)
    token, expert = token[keep], routing.experts.reshape(-1)[keep]
    weight = routing.weights.reshape(-1)[keep]
    order = torch.argsort(expert, stable=True)
    return token[order], expert[order], weight[order]


def combine(x: torch.Tensor, token: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum over a token's kept assignments of weight x expert output: (T, d), zero where none,
    in x's dtype (under autocast the experts' outputs are 16-bit, the residual stream fp32)."""
    return torch.zeros_like(x).index_add(0, token, y.to(x.dtype) * weight[:, None].to(x.dtype))


def local_dispatch(moe: MoE, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Every expert here (one process): each kept assignment's row through its expert."""
    token, expert, weight = assignments(routing)
    counts = torch.bincount(expert, minlength=moe.cfg.num_experts).tolist()
    return combine(x, token, moe.experts(x[token], counts), weight)


class MoE(nn.Module):
    """Router, experts and (shared_expert_ffn_size > 0) Qwen2-MoE's sigmoid-gated shared expert.
    `groups`: capacity groups of the tokens (set by the caller: a data-parallel rank's tokens
    are one); `dispatch`: how routed rows reach their experts (here, or `ExpertParallel`).
    After each forward: `routing` (detached) and `aux` (the load-balancing loss, with grad)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, d, shared = cfg.num_experts, cfg.hidden_size, cfg.shared_expert_ffn_size
        self.cfg = cfg
        self.router = nn.Linear(d, E, bias=False)
        self.experts = Experts(E, d, cfg.expert_ffn_size)
        self.shared = SwiGLU(d, shared) if shared else None
        self.shared_gate = nn.Linear(d, 1, bias=False) if shared else None
        self.groups, self.dispatch = 1, local_dispatch
        self.routing: Routing | None = None
        self.aux: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, d = x.shape
        flat = x.reshape(-1, d)
        routing = route(self.router(flat), self.cfg.experts_per_token, groups=self.groups,
                        factor=self.cfg.capacity_factor, norm=self.cfg.norm_topk_prob)
        self.aux = aux_loss(routing, self.cfg.num_experts)
        self.routing = Routing(routing.experts, routing.weights.detach(), routing.kept,
                               routing.probs.detach(), routing.capacity, routing.groups)
        y = self.dispatch(self, flat, routing)
        if self.shared is not None:
            y = y + torch.sigmoid(self.shared_gate(flat)) * self.shared(flat)
        return y.view(B, T, d)


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_groups(model: nn.Module, groups: int) -> None:
    """Capacity per group of 1/groups of each forward's rows (the reference of n ranks: n)."""
    for moe in moe_layers(model):
        moe.groups = groups


def add_aux_loss(model: nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """loss + router_aux_loss_coef x the mean of the last forward's MoE layers' aux losses (a
    dense model's loss unchanged)."""
    cfg = getattr(model, "cfg", None)
    if not getattr(cfg, "num_experts", 0):
        return loss
    layers = moe_layers(model)
    return loss + cfg.router_aux_loss_coef * torch.stack([m.aux for m in layers]).mean()


# --- expert parallelism ------------------------------------------------------------------------

class AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with split sizes; its backward sends the gradients back (the
    same call with the splits swapped)."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class ExpertParallel:
    """MoE.dispatch over n ranks, each owning experts [r E/n, (r+1) E/n): per layer one all-to-all
    of the per-expert counts (E int64), one of the rows to their owners, one back; the backward
    repeats the two row exchanges in reverse. `traffic`: the last forward's rows this rank sent to
    and received from each rank (the split sizes, (send, recv)). `fault` (on purpose, for the
    check to catch): unweighted_combine adds expert outputs without their router weights;
    wrong_rank sends each row to the next rank's expert of the same local index."""

    def __init__(self, num_experts: int, group=None, fault: str = "none"):
        self.group, self.fault = group, fault
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts, self.local = num_experts, num_experts // self.n
        self.traffic: tuple[list[int], list[int]] = ([], [])

    def __call__(self, moe: MoE, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        token, expert, weight = assignments(routing)
        if self.fault == "wrong_rank":
            expert = (expert + self.local) % self.num_experts
            order = torch.argsort(expert, stable=True)
            token, expert, weight = token[order], expert[order], weight[order]
        counts = torch.bincount(expert, minlength=self.num_experts)  # (E,) rows per expert
        incoming = torch.empty_like(counts)  # (n x local): what each rank sends my experts
        dist.all_to_all_single(incoming, counts, group=self.group)
        send = counts.view(self.n, self.local).sum(1).tolist()
        recv = incoming.view(self.n, self.local).sum(1).tolist()
        self.traffic = (send, recv)
        rows = AllToAll.apply(x[token], send, recv, self.group)  # (R, d), by source rank
        y = AllToAll.apply(self.compute(moe, rows, incoming), recv, send, self.group)
        if self.fault == "unweighted_combine":
            weight = torch.ones_like(weight)
        return combine(x, token, y, weight)

    def compute(self, moe: MoE, rows: torch.Tensor, incoming: torch.Tensor) -> torch.Tensor:
        """The local experts on the received rows (source-major, by expert within a source):
        regrouped expert-major, computed, and put back in the order they came."""
        label = torch.arange(self.local, device=rows.device).repeat(self.n).repeat_interleave(incoming)
        order = torch.argsort(label, stable=True)
        y = moe.experts(rows[order], incoming.view(self.n, self.local).sum(0).tolist())
        return y[torch.argsort(order)]


def is_expert_param(name: str) -> bool:
    return ".experts." in name


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The routed experts' weights this process holds (a slice of them under expert parallelism)."""
    return [p for name, p in model.named_parameters() if is_expert_param(name)]


def apply_expert_parallel(model: nn.Module, group=None, fault: str = "none") -> nn.Module:
    """Keep this rank's num_experts / n experts of every MoE layer (its slice of the stacked
    weights, as built: every rank built the same seeded model) and dispatch with all-to-all."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    for moe in moe_layers(model):
        E = moe.cfg.num_experts
        if E % n:
            raise ValueError(f"num_experts={E} does not split over {n} ranks")
        mine = slice(r * E // n, (r + 1) * E // n)
        for name in ("w1", "w3", "w2"):
            whole = getattr(moe.experts, name)
            setattr(moe.experts, name, nn.Parameter(whole.detach()[mine].clone()))
        moe.dispatch = ExpertParallel(E, group, fault)
    return model
