"""The whole answer, as `labkit plan` and the notebook show it (`plan_report`): the step's terms
per GPU, whether it fits, serving at the same batch and sequence, the cheapest plan that fits,
and the fine-tuning frontier."""
from __future__ import annotations

import dataclasses
import math

from labkit.config import MODELS, PRESETS, ConfigError, ModelConfig, check_choice
from labkit.planner.finetune import (FINETUNE_METHODS, finetune_frontier, finetune_memory,
                                     lora_module_names, parse_lora_targets)
from labkit.planner.quantized import NF4_BLOCK_SIZE
from labkit.planner.inference import inference_memory, kv_bytes_per_token
from labkit.planner.model import num_params as _count_params
from labkit.planner.moe import active_params, ep_memory, expert_params
from labkit.planner.plan import MemoryPlan, _positive
from labkit.planner.precision import DTYPE_OF, PRECISIONS
from labkit.planner.search import recommend
from labkit.planner.training import training_memory

GIB = 2**30


def plan_report(*, model: str | ModelConfig | None = None, params: float | str | None = None,
                batch_size: int = 1, seq_len: int | None = None, precision: str = "bf16_weights",
                optimizer: str = "adamw", optimizer_impl: str = "foreach", zero_stage: int = 0,
                tp: int = 1, pp: int = 1, gpus: int | None = None, gpu_mem_gib: float = 80.0,
                checkpointing: str = "none", effective_batch: int | None = None,
                finetune: str | None = None, lora_rank: int = 8, lora_alpha: float = 16.0,
                lora_targets: str | tuple = "q,v", ep: int = 1) -> dict:
    """One JSON-safe answer for a GPU run: the per-GPU terms of the step at `batch_size` sequences
    per micro-batch, whether it fits `gpu_mem_gib`, the KV cache for serving at the same batch and
    sequence, and the cheapest plan that fits `effective_batch` sequences per optimizer step.
    `model` is a preset (default `tiny`) or a ModelConfig (e.g. read from a Hugging Face
    config.json by `labkit.blocks.hf.model_config`); `params` a bare parameter count instead.
    `finetune` (full, lora, qlora): the step is `finetune_memory`'s on one GPU, in the compute
    dtype `precision` implies (fp32 for fp32, fp16 for fp16, bf16 otherwise), with
    `trainable_params` at the top level, `finetune` (its settings) and `finetune_frontier`;
    `lora_alpha` scales the update, not the memory. A mixture-of-experts shape adds `moe`: its
    active parameters per token and one of `ep` expert-parallel ranks' model states."""
    m, psi, name = _model_or_params(model, params)
    moe = _moe_fields(m, ep, precision, optimizer)
    if seq_len is None:
        seq_len = min(2048, m.max_seq_len) if m else 2048
    gpus = tp * pp if gpus is None else gpus
    mem = _gpu_mem_bytes(gpu_mem_gib)
    _positive(batch_size=batch_size, tp=tp, pp=pp, gpus=gpus)
    effective_batch, accumulation = _accumulation(batch_size, effective_batch, gpus // (tp * pp) or 1)
    common = dict(num_params=None if m else psi, seq_len=seq_len, optimizer=optimizer, tp=tp,
                  pp=pp, gpus=gpus, device="cuda", optimizer_impl=optimizer_impl)
    if finetune is not None:
        ft = _finetune_settings(m, finetune, precision, lora_rank, lora_alpha, lora_targets,
                                tp=tp, pp=pp, gpus=gpus, zero_stage=zero_stage, accumulation=accumulation)
        plan = finetune_memory(m, method=finetune, lora_rank=lora_rank, lora_targets=ft["lora_targets"],
                               batch_size=batch_size, seq_len=seq_len, compute_dtype=ft["compute_dtype"],
                               checkpointing=checkpointing, device="cuda")
    else:
        plan = training_memory(m, batch_size=batch_size, precision=precision, zero_stage=zero_stage,
                               checkpointing=checkpointing, accumulation_steps=accumulation, **common)
    rec = recommend(m, effective_batch=effective_batch, gpu_mem_bytes=mem, **common)
    inputs = dict(batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
                  optimizer_impl=optimizer_impl, zero_stage=zero_stage, tp=tp, pp=pp, gpus=gpus,
                  dp=gpus // (tp * pp), gpu_mem_gib=gpu_mem_gib, checkpointing=checkpointing,
                  effective_batch=effective_batch, accumulation_steps=accumulation)
    serving = _serving_fields(m, inputs, mem)
    out = {"model": name, "num_params": psi, "inputs": inputs, **_plan_fields(plan, mem), **serving,
           "recommendation": dataclasses.asdict(rec), **moe}
    # The cache serving this batch and sequence would hold; not part of the training total.
    out["per_gpu"]["kv_cache_bytes"] = serving["inference"]["kv_cache_bytes"] if m else 0
    if finetune is not None:
        out["per_gpu"]["linear_weight_bytes"] = plan.linear_weight_bytes
        out.update(trainable_params=plan.trainable_params, finetune=ft, finetune_frontier=finetune_frontier(
            m, gpu_mem_bytes=mem, seq_len=seq_len, lora_rank=lora_rank, lora_targets=ft["lora_targets"],
            compute_dtype=ft["compute_dtype"], device="cuda"))
    return out


def _finetune_settings(m: ModelConfig | None, method: str, precision: str, rank: int, alpha: float,
                       targets, *, tp: int, pp: int, gpus: int, zero_stage: int,
                       accumulation: int) -> dict:
    """The fine-tuning inputs, checked: one GPU, a model shape, a known method and targets."""
    check_choice("finetune method", method, FINETUNE_METHODS)
    check_choice("precision", precision, PRECISIONS)
    if m is None:
        raise ConfigError("--finetune needs a model shape (--model or --hf-model), not --params")
    if (tp, pp, gpus, zero_stage, accumulation) != (1, 1, 1, 0, 1):
        raise ConfigError("--finetune plans one GPU: tp, pp and gpus 1, zero-stage 0, no accumulation")
    _positive(lora_rank=rank)
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"lora_alpha={alpha!r} must be a positive number")
    parsed = parse_lora_targets(targets)
    if method != "full":
        lora_module_names(m, parsed)
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[DTYPE_OF[precision]]
    return {"method": method, "lora_rank": rank, "lora_alpha": alpha, "lora_targets": list(parsed),
            "lora_modules": lora_module_names(m, parsed) if method != "full" else [],
            "compute_dtype": dtype, "adapter_dtype": dtype, "nf4_block_size": NF4_BLOCK_SIZE}


def _model_or_params(model: str | ModelConfig | None, params) -> tuple[ModelConfig | None, int, str | None]:
    if model is not None and params is not None:
        raise ConfigError("give --model or --params, not both")
    if isinstance(model, ModelConfig):  # a shape of one's own: named by the folder it came from
        return model, _count_params(model), model.source or "custom shape"
    if params is None:
        name = model or "tiny"
        if name not in MODELS:
            raise ConfigError(f"unknown model {name!r}; valid: {', '.join(PRESETS)}")
        return MODELS[name], _count_params(MODELS[name]), name
    try:
        value = float(params)
    except (TypeError, ValueError):
        raise ConfigError(f"params={params!r} is not a number (e.g. 7.5e9)") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise ConfigError(f"params={params!r} must be a positive whole number of parameters")
    return None, int(value), None


def _moe_fields(m: ModelConfig | None, ep: int, precision: str, optimizer: str) -> dict:
    """{"moe": ...} for a mixture-of-experts shape: experts, total and active parameters per
    token, and one of `ep` expert-parallel ranks' model states (experts split, the rest
    replicated); {} for a dense one (where ep must be 1)."""
    _positive(ep=ep)
    if m is None or not m.num_experts:
        if ep != 1:
            raise ConfigError(f"ep={ep}: expert parallelism needs a mixture-of-experts model (num_experts > 0)")
        return {}
    return {"moe": {"num_experts": m.num_experts, "experts_per_token": m.experts_per_token,
                    "expert_params": expert_params(m), "active_params": active_params(m),
                    "per_rank": ep_memory(m, ep, precision, optimizer)}}


def _gpu_mem_bytes(gib: float) -> int:
    if not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib <= 0:
        raise ConfigError(f"gpu_mem_gib={gib!r} must be a positive number of GiB")
    return int(gib * GIB)


def _accumulation(batch_size: int, effective_batch: int | None, dp: int) -> tuple[int, int]:
    """(effective batch, accumulation steps) for micro-batches of `batch_size` on `dp` ranks."""
    if effective_batch is None:
        return batch_size * dp, 1
    _positive(effective_batch=effective_batch)
    if effective_batch % (batch_size * dp):
        raise ConfigError(f"effective batch {effective_batch} is not a multiple of batch size "
                          f"{batch_size} x {dp} data-parallel ranks")
    return effective_batch, effective_batch // (batch_size * dp)


def _plan_fields(plan: MemoryPlan, mem: int) -> dict:
    terms = ("param", "grad", "optimizer", "activation", "overhead")
    per_gpu = {f"{t}_bytes": getattr(plan, f"{t}_bytes") for t in terms}
    per_gpu.update({f"{t}_bytes": getattr(plan, f"{t}_bytes") for t in ("weight_copy", "gathered")
                    if getattr(plan, f"{t}_bytes")})  # autocast's casts, FSDP2's gathered weights
    per_gpu.update(model_states_bytes=plan.model_states_bytes, total_bytes=plan.total_bytes,
                   activation_bytes_per_layer=plan.activation_bytes_per_layer)
    return {"per_gpu": per_gpu, "held_at_peak": list(plan.held_at_peak),
            "peak_phase": plan.peak_phase, "phase_bytes": plan.phase_bytes, "stage": plan.stage,
            "formulas": plan.formulas, "gpu_mem_bytes": mem, "fits": plan.total_bytes <= mem,
            "headroom_bytes": mem - plan.total_bytes}


def _serving_fields(m: ModelConfig | None, inputs: dict, mem: int) -> dict:
    """The KV cache (per GPU, at the same batch and sequence) and a serving plan: weights + cache.
    It is not part of the training step's total."""
    if m is None:
        return {"kv_cache_bytes_per_token": None, "inference": None}
    b, s, p = inputs["batch_size"], inputs["seq_len"], inputs["precision"]
    serve = inference_memory(m, batch_size=b, seq_len=s, precision=p, tp=inputs["tp"], pp=inputs["pp"])
    return {"kv_cache_bytes_per_token": kv_bytes_per_token(m, DTYPE_OF[p]),
            "inference": {"param_bytes": serve.param_bytes, "kv_cache_bytes": serve.kv_cache_bytes,
                          "total_bytes": serve.total_bytes, "fits": serve.total_bytes <= mem}}
