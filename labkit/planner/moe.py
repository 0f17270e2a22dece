"""Mixture of experts: parameters (all of them, the ones one token uses, one expert-parallel
rank's), the capacity and what it drops, the expert load under uniform routing, the
load-balancing loss, and the all-to-all bytes of expert parallelism (`labkit.blocks.moe`).

Uniform routing is the reference line: each token's k experts drawn at random, distinct, so an
expert's load over T tokens is Binomial(T, k/E) (mean T k / E).
"""
from __future__ import annotations

import math
from typing import Sequence

from labkit.config import ConfigError, ModelConfig
from labkit.planner.model import num_params
from labkit.planner.precision import PRECISION_BYTES
from labkit.planner.sharding import zero_model_state_bytes


# Mixtral-8x7B's published config.json (mistralai/Mixtral-8x7B-v0.1), as `labkit.blocks.hf` reads it:
# the shape the notebook, the drills and the quiz plan (a preset would change every preset table).
MIXTRAL_8X7B = ModelConfig(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8, ffn_size=14336,
                           vocab_size=32000, max_seq_len=32768, rope_theta=1e6, norm_eps=1e-5,
                           num_experts=8, experts_per_token=2, moe_ffn_size=14336,
                           router_aux_loss_coef=0.02)


def _need_moe(m: ModelConfig) -> None:
    if not m.num_experts:
        raise ConfigError("a mixture-of-experts formula needs num_experts > 0")


def expert_params(m: ModelConfig) -> int:
    """Every routed expert's weights over the model: L x E x 3 d f (the router and a shared
    expert are not routed)."""
    return m.num_layers * m.num_experts * 3 * m.hidden_size * m.expert_ffn_size


def active_params(m: ModelConfig) -> int:
    """Parameters one token's forward uses: all but the E - k experts it is not routed to in
    each layer (embedding and head included, as Mixtral's 12.9B counts them)."""
    _need_moe(m)
    unused = m.num_experts - m.experts_per_token
    return num_params(m) - expert_params(m) // m.num_experts * unused


def ep_rank_params(m: ModelConfig, ep: int) -> int:
    """Parameters one of `ep` expert-parallel ranks holds: E / ep experts per layer, everything
    else (attention, router, norms, embedding, head, shared expert) replicated."""
    check_ep(m, ep)
    return num_params(m) - expert_params(m) + expert_params(m) // ep


def check_ep(m: ModelConfig, ep: int) -> None:
    _need_moe(m)
    if ep < 1 or m.num_experts % ep:
        raise ConfigError(f"ep={ep} does not divide num_experts={m.num_experts}; valid: a divisor")


def ep_memory(m: ModelConfig, ep: int, precision: str = "bf16_weights", optimizer: str = "adamw") -> dict:
    """One expert-parallel rank's model states, in bytes (the replicated part not sharded by
    ZeRO): weights, gradients and optimizer states at `precision`."""
    mine = ep_rank_params(m, ep)
    experts = expert_params(m) // ep
    param, grad, opt = zero_model_state_bytes(mine, stage=0, dp=1, precision=precision,
                                              optimizer=optimizer)
    return {"ep": ep, "params": mine, "expert_params": experts, "replicated_params": mine - experts,
            "param_bytes": param, "expert_param_bytes": experts * PRECISION_BYTES[precision].weight,
            "grad_bytes": grad, "optimizer_bytes": opt, "model_states_bytes": param + grad + opt}


# --- capacity and drops -------------------------------------------------------------------------

def capacity(tokens: int, k: int, num_experts: int, factor: float) -> int:
    """C = ceil(factor x tokens x k / E): the assignments one expert takes from a group of
    `tokens` tokens; 0 (no limit) when factor is 0."""
    return math.ceil(factor * tokens * k / num_experts) if factor else 0


def dropped_assignments(loads: Sequence[int], cap: int) -> int:
    """sum_e max(0, load_e - C): exact, whichever assignments a full expert refuses."""
    return sum(max(0, load - cap) for load in loads) if cap else 0


def _binomial(n: int, p: float) -> list[float]:
    """Binomial(n, p)'s probabilities, computed in logs (math.comb overflows a float past n ~ 1000)."""
    if p >= 1.0:
        return [0.0] * n + [1.0]
    return [math.exp(math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1)
                     + x * math.log(p) + (n - x) * math.log1p(-p)) for x in range(n + 1)]


def uniform_drop_fraction(tokens: int, k: int, num_experts: int, factor: float) -> float:
    """Expected share of a group's T k assignments dropped under uniform routing: E x
    E[max(0, L - C)] / (T k), L ~ Binomial(T, k/E). Exact for that routing (linearity of
    expectation needs no independence between the experts' loads)."""
    cap = capacity(tokens, k, num_experts, factor)
    if not cap:
        return 0.0
    pmf = _binomial(tokens, k / num_experts)
    over = sum(max(0, x - cap) * q for x, q in enumerate(pmf))
    return num_experts * over / (tokens * k)


def uniform_max_load_ratio(tokens: int, k: int, num_experts: int) -> float:
    """E[max_e L_e] / (T k / E) under uniform routing, the loads taken as independent
    Binomial(T, k/E) (they sum to T k, so slightly negatively correlated: a small overestimate)."""
    pmf = _binomial(tokens, k / num_experts)
    cdf, below = 0.0, []
    for q in pmf:
        cdf += q
        below.append(min(cdf, 1.0))
    expected = sum(1 - below[x - 1] ** num_experts for x in range(1, tokens + 1))
    return expected / (tokens * k / num_experts)


def load_balancing_loss(loads: Sequence[int], mean_probs: Sequence[float], tokens: int) -> float:
    """E x sum_i f_i P_i with f_i = load_i / T (the f_i sum to k) and P_i expert i's mean router
    probability: k when both are uniform (f_i = k/E, P_i = 1/E)."""
    E = len(loads)
    return E * sum(load / tokens * p for load, p in zip(loads, mean_probs))


# --- expert parallelism's all-to-all ------------------------------------------------------------

def all_to_all_bytes(sends: Sequence[Sequence[Sequence[int]]], rank: int, *, hidden: int,
                     num_experts: int, dtype_bytes: int = 4) -> int:
    """One training step's all-to-all bytes on `rank`, S as CommCounter counts it (the larger of
    an all-to-all's input and output), from each layer's routing: sends[l][i][j] rows rank i
    sends rank j in layer l. Per layer: the counts' exchange (E int64: 8E), then 4 exchanges of
    rows (dispatch and combine, forward and backward), each max(sent, received) x d x bytes."""
    total = 0
    for matrix in sends:
        sent = sum(matrix[rank])
        received = sum(row[rank] for row in matrix)
        total += 8 * num_experts + 4 * max(sent, received) * hidden * dtype_bytes
    return total


def offrank_bytes(sends: Sequence[Sequence[Sequence[int]]], rank: int, *, hidden: int,
                  dtype_bytes: int = 4) -> int:
    """Bytes `rank` hands to other ranks in one step: per layer its rows to their experts and the
    results back to their sources (forward), and the gradients of both back (backward)."""
    total = 0
    for matrix in sends:
        out = sum(matrix[rank]) - matrix[rank][rank]
        back = sum(row[rank] for row in matrix) - matrix[rank][rank]
        total += 2 * (out + back) * hidden * dtype_bytes
    return total


def uniform_offrank_bytes(m: ModelConfig, tokens: int, ep: int, dtype_bytes: int = 4) -> float:
    """`offrank_bytes` expected under uniform routing: (ep - 1) / ep of a rank's kept
    assignments leave it, and as many arrive, each way twice (forward and backward), per layer."""
    check_ep(m, ep)
    k, E = m.experts_per_token, m.num_experts
    kept = tokens * k * (1 - uniform_drop_fraction(tokens, k, E, m.capacity_factor))
    return m.num_layers * 4 * kept * (ep - 1) / ep * m.hidden_size * dtype_bytes
