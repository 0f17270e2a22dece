"""How each term of a training plan was computed, in words, for the table that `labkit plan`
and the notebook show."""
from __future__ import annotations

from labkit.planner.activations import _checkpointed_on_stage
from labkit.planner.model import StageParams
from labkit.planner.plan import MemoryPlan, _Run
from labkit.planner.precision import (EAGER_FP32_BYTES, EAGER_QUANTIZED_BYTES, LOW_BIT, QUANTIZED_MIN,
                                      optimizer_bytes_per_param)


_LAYER_FORMULAS = {  # per token; a = activation bytes, d/q/kv/f/h = local widths
    ("llama", "none"): "2·(4d + 4 + 2a·d) + a·(2q + 2kv) + 4h + 4a·f",
    ("gpt2", "none"): "2·(2a·d + 2σ) + a·(2q + 2kv) + 4h + 2a·f",
    ("llama", "selective"): "a·(3d + 2q + 2kv + 2f) + 4h",
    ("gpt2", "selective"): "a·(3d + 2q + 2kv + f) + 4h",
    ("llama", "full"): "a·d", ("gpt2", "full"): "a·d",
}


def _formulas(r: _Run, sp: StageParams, plan: MemoryPlan, first: bool) -> dict[str, str]:
    """How each term was computed, for the human table."""
    nd = f"/Nd (Nd = {r.dp})"
    out = {"param": f"{r.prec.weight}·Ψ{nd if r.zero_stage >= 3 else ''}, Ψ = {sp.total:,} here",
           "grad": f"{r.prec.grad}·Ψ{nd if r.zero_stage >= 2 else ''}",
           "optimizer": _optimizer_words(r, nd),
           "overhead": _overhead_words(r, plan)}
    if r.m is None:
        out["activation"] = "no model shape given (only --params): not predicted"
        return out
    s = r.shape
    widths = f"a={r.prec.act} d={s.d} q={s.q} kv={s.kv} f={s.f} h={s.heads}"
    k = _checkpointed_on_stage(r, sp.num_layers)
    layers = f"{k} layers × b·s·[{_LAYER_FORMULAS[(r.m.arch, r.checkpointing)]}]" if k else ""
    plain = sp.num_layers - k
    layers += (" + " if k and plain else "") + (
        f"{plain} layers × b·s·[{_LAYER_FORMULAS[(r.m.arch, 'none')]}]" if plain else "")
    flight = f"{r.pp} micro-batches in flight × " if first and r.pp > 1 else ""
    out["activation"] = (f"{flight}({layers}) ({widths}) + embedding/head/loss; Korthikanti et "
                         "al.'s analysis redone for this block")
    return out


def _optimizer_words(r: _Run, nd: str) -> str:
    if r.optimizer in LOW_BIT:
        q = LOW_BIT[r.optimizer]
        return (f"m + v of each tensor of ≥ {QUANTIZED_MIN} elements in {q.bits}-bit codes, an fp32 "
                f"scale per {q.block} and a {q.map_size}-value map each; fp32 for the smaller ones")
    k = optimizer_bytes_per_param(r.precision, r.optimizer)
    return f"K·Ψ{nd if r.zero_stage >= 1 else ''}, K = {k} ({_k_words(r)})"


def _k_words(r: _Run) -> str:
    moments = "momentum" if r.optimizer == "sgd" else "m + v"
    master = "fp32 master + " if r.prec.master else ""
    return f"{master}{moments} in {'fp32' if r.prec.moment == 4 else '16 bits'}"


def _overhead_words(r: _Run, plan: MemoryPlan) -> str:
    if plan.peak_phase == "backward":
        loss = (f"the chunked loss's backward ({r.loss_chunk} tokens of logits at a time, the "
                "head's gradient and the hidden states')" if r.loss_chunk else
                "the loss's fp32 gradients (8·b·s·V), the head's gradients")
        return (f"backward: the largest of {loss}, a block's backward (its recomputed forward, "
                "w2's gradient and the MLP's f-wide gradients) + ZeRO working buffers")
    if plan.peak_phase == "forward":
        return ("forward: FSDP2's first all-gathers, the root unit's and the first block's, each "
                "flat output beside the parameters it is copied out to")
    if plan.peak_phase == "reduce":
        return ("FSDP2's last reduce-scatter (the root unit's, after the backward): one vocabulary "
                "matrix's whole gradient and the root's reduce-scatter input in the reduce dtype")
    if plan.peak_phase == "embedding":
        return ("tensor parallelism's embedding backward: the whole-vocabulary gradient (V·d) on "
                "every rank, beside every other gradient, before the rank keeps its rows (under "
                "FSDP2 also the gathered root unit and its tp-local gradients)")
    upcast = "fp32 copy of the gradients (4·Ψ_opt) + " if r.prec.master else ""
    adam = {"single": "2 temporaries per parameter, the largest pair (for-loop Adam)",
            "foreach": "one copy of v (multi-tensor Adam)", "fused": "none (fused Adam)",
            "eager": (f"the largest tensor's eager update ({EAGER_QUANTIZED_BYTES} B per element "
                      f"with low-bit moments, {EAGER_FP32_BYTES} with fp32 ones: low_bit_update_bytes)"),
            "compiled": "none (the compiled update: one fused kernel per tensor)"}[r.impl]
    return f"optimizer step: {upcast}{'nothing (SGD)' if r.optimizer == 'sgd' else adam}"
