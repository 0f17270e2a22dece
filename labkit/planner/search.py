"""Recommendation: the cheapest training plan that fits a GPU (`recommend`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from labkit.config import ConfigError, ModelConfig
from labkit.planner.plan import CHECKPOINTING, MemoryPlan, _positive
from labkit.planner.training import training_memory


# Tried in order, cheapest first. ZeRO stages 1-2 move the same bytes as plain data parallelism
# (2Ψ per step, the ZeRO paper's section 7), so they come before any recomputation; stage 3 moves
# 1.5x that on every step, so it comes last; selective recomputation (elementwise ops again) comes
# before full (a whole extra forward). The recipe panel's search takes the same order.
SEARCH = tuple((ckpt, zero) for ckpt in CHECKPOINTING for zero in (0, 1, 2)) + \
    tuple((ckpt, 3) for ckpt in CHECKPOINTING)
# In the recipe's words: bf16 autocast first (what `labkit run recipe` and most trainers run),
# then bf16_weights (16-bit weights and gradients with fp32 master copies: no cached casts, all
# activations in 16 bits); bf16_pure halves the optimizer state at some cost in accuracy and is
# no recipe of labkit's, so it is the last resort. The recipe panel searches the first two.
RECOMMENDED_PRECISIONS = ("bf16", "bf16_weights", "bf16_pure")


@dataclass(frozen=True)
class Recommendation:
    """A plan for `effective_batch` sequences per optimizer step: micro_batch x
    accumulation_steps x data-parallel ranks. `fits` is False when nothing tried fits (then the
    fields describe the smallest plan tried)."""

    precision: str
    checkpointing: str
    zero_stage: int
    micro_batch: int
    accumulation_steps: int
    effective_batch: int
    total_bytes: int
    fits: bool
    reason: str


def recommend(m: ModelConfig | None = None, *, num_params: int | None = None,
              effective_batch: int, seq_len: int = 2048, gpus: int = 1, gpu_mem_bytes: int,
              tp: int = 1, pp: int = 1, optimizer: str = "adamw", device: str | None = "cuda",
              optimizer_impl: str | None = None) -> Recommendation:
    """The first plan that fits, trying precisions, then (checkpointing, ZeRO stage) pairs in the
    order of `SEARCH`, each at the largest micro-batch that divides the batch per rank."""
    _positive(effective_batch=effective_batch, gpu_mem_bytes=gpu_mem_bytes, gpus=gpus, tp=tp, pp=pp)
    dp = gpus // (tp * pp) or 1
    if effective_batch % dp:
        raise ConfigError(f"effective batch {effective_batch} is not a multiple of the {dp} "
                          "data-parallel ranks")
    per_rank = effective_batch // dp
    kw = dict(num_params=num_params, seq_len=seq_len, optimizer=optimizer, tp=tp, pp=pp,
              gpus=gpus, device=device, optimizer_impl=optimizer_impl)
    smallest = None
    for precision in RECOMMENDED_PRECISIONS:
        for ckpt, zero in SEARCH:
            if zero and dp == 1 or ckpt != "none" and m is None:
                continue  # ZeRO needs data parallelism; recomputation needs a shape
            plan, micro = _largest_micro_batch(m, per_rank, gpu_mem_bytes, precision=precision,
                                               checkpointing=ckpt, zero_stage=zero, **kw)
            rec = Recommendation(precision, ckpt, zero, micro, per_rank // micro, effective_batch,
                                 plan.total_bytes, plan.total_bytes <= gpu_mem_bytes, "")
            if rec.fits:
                return dataclasses.replace(rec, reason=_why(rec, dp))
            smallest = min(smallest or rec, rec, key=lambda x: x.total_bytes)
    return dataclasses.replace(smallest, reason=(
        "nothing tried fits: more GPUs, more tensor/pipeline parallelism, a shorter sequence or "
        "CPU offload are needed; this is the smallest plan tried"))


def _largest_micro_batch(m, per_rank: int, gpu_mem_bytes: int, **kw) -> tuple[MemoryPlan, int]:
    """The largest divisor of `per_rank` whose plan fits (else micro-batch 1), and its plan."""
    for micro in sorted((n for n in range(1, per_rank + 1) if per_rank % n == 0), reverse=True):
        plan = training_memory(m, batch_size=micro, accumulation_steps=per_rank // micro, **kw)
        if plan.total_bytes <= gpu_mem_bytes:
            return plan, micro
    return plan, 1


def _why(rec: Recommendation, dp: int) -> str:
    parts = [f"{rec.precision} precision",
             "no recomputation" if rec.checkpointing == "none" else f"{rec.checkpointing} recomputation",
             f"ZeRO stage {rec.zero_stage}" if dp > 1 else "one data-parallel rank",
             f"micro-batch {rec.micro_batch} x {rec.accumulation_steps} accumulation step(s) x {dp} rank(s)"]
    return "cheapest plan that fits: " + ", ".join(parts)
