"""Exercises on mixture of experts with expert parallelism: an expert's capacity (how many
assignments it takes before it drops), and the expert weights one expert-parallel rank keeps.
They name RUNS["moe"]: two gloo ranks, each routing its own tokens to the experts they own.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit import planner
from labkit.study.exercises.core import TOPICS, Exercise, Setup, show
from labkit.study.exercises.inference import measured_is

MIB = 2**20


def tokens(s: Setup) -> int:
    """Tokens one rank routes per step: its own rows."""
    cfg = s.cfg("ep")
    return cfg.batch_size * cfg.seq_len


def capacity(s: Setup) -> int:
    cfg = s.cfg("ep")
    return planner.capacity(tokens(s), cfg.experts_per_token, cfg.num_experts, cfg.capacity_factor)


def routing_words(s: Setup) -> str:
    cfg = s.cfg("ep")
    return (f"Each of the {cfg.nproc} ranks routes its own {tokens(s)} tokens ({cfg.batch_size} "
            f"sequences of {cfg.seq_len}) to the top {cfg.experts_per_token} of {cfg.num_experts} "
            f"experts, with capacity factor {cfg.capacity_factor:g}.")


def expert_mib(s: Setup, ranks: int | None = None) -> float:
    """fp32 bytes of the experts one of `ranks` expert-parallel ranks keeps, in MiB."""
    cfg = s.cfg("ep")
    return 4 * planner.expert_params(cfg.model) / (ranks or cfg.nproc) / MIB


def expert_words(s: Setup) -> str:
    m = s.cfg("ep").model
    return (f"The model has {m.num_layers} MoE layers of {m.num_experts} SwiGLU experts; each expert "
            f"has three {m.hidden_size} x {m.expert_ffn_size} matrices (w1, w3: d -> f; w2: f -> d), "
            f"fp32. {s.cfg('ep').nproc} ranks split the experts evenly; everything else is replicated.")


def build_exercises() -> list[Exercise]:
    topic = TOPICS[3]  # multi-GPU and distributed setups
    return [
        Exercise(
            "moe_capacity", topic, "moe", answer=capacity, details=routing_words,
            evidence=lambda r, s: {"tokens": tokens(s), "measured": show(r.get("ep", "capacity_tokens")),
                                   "dropped": show(100 * (r.get("ep", "dropped_fraction") or 0), "%")},
            level=2, unit="assignments", abs_tol=0.5,
            mistake=lambda s: planner.capacity(tokens(s), 1, s.cfg("ep").num_experts,
                                               s.cfg("ep").capacity_factor),
            supports=lambda r, s: measured_is("ep", "capacity_tokens", capacity(s), r)),
        Exercise(
            "moe_expert_bytes", topic, "moe", answer=expert_mib, details=expert_words,
            evidence=lambda r, s: {"single": show((r.get("single", "expert_param_bytes") or 0) / MIB, "MiB"),
                                   "measured": show((r.get("ep", "expert_param_bytes") or 0) / MIB, "MiB")},
            level=1, unit="MiB", rel_tol=0.01, mistake=lambda s: expert_mib(s, 1),
            supports=lambda r, s: measured_is("ep", "expert_param_bytes", expert_mib(s) * MIB, r)),
    ]
