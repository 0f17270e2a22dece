"""The plan: its inputs, checked and resolved (`_Run`, `_resolve`: ConfigError naming the valid
choices), and what it predicts (`MemoryPlan`), shared by the training, inference and fine-tuning
planners."""
from __future__ import annotations

from dataclasses import dataclass, field

from labkit import hardware
from labkit.config import ConfigError, ModelConfig, check_choice
from labkit.planner.model import LocalShape, check_tp, local_shape
from labkit.planner.model import num_params as _count_params  # `num_params` is also a keyword here
from labkit.planner.precision import (LOW_BIT, LOW_BIT_IMPLS, OPTIMIZERS, PRECISIONS, PrecisionBytes,
                                      precision_bytes)

CHECKPOINTING = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
OPTIMIZER_IMPLS = ("single", "foreach", "fused")


@dataclass(frozen=True)
class MemoryPlan:
    """What one training step holds on one GPU, in bytes. `total_bytes` is the predicted peak: the
    sum of the terms in `held_at_peak` (gradients and activations do not coexist in full: the
    gradients are allocated in backward as the activations are freed; see `training_memory`)."""

    num_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # per GPU, over the layers (and micro-batches in flight) it holds
    activation_bytes_per_layer: int  # one layer, one micro-batch, under the chosen checkpointing
    overhead_bytes: int  # what else the peak holds (loss/optimizer temporaries, working buffers)
    kv_cache_bytes: int = 0
    weight_copy_bytes: int = 0  # autocast's 16-bit weight casts held at the peak (autocast cases)
    gathered_bytes: int = 0  # FSDP2's ZeRO-2: the whole parameters held beside the shards
    kept_weight_copy_bytes: int = 0  # autocast's casts the backward keeps (saved for it)
    held_at_peak: tuple[str, ...] = ("param", "grad", "optimizer", "activation", "overhead", "kv_cache")
    peak_phase: str = ""  # where the peak is: "backward", "step" (the optimizer step), under
    # FSDP2 also "forward" (its first all-gathers) or "reduce" (its last reduce-scatter), under
    # tensor parallelism "embedding" (the embedding's whole-vocabulary gradient)
    phase_bytes: dict = field(default_factory=dict, compare=False)  # each phase's predicted peak
    formulas: dict = field(default_factory=dict, compare=False)  # term -> how it was computed
    stage: str = "all"  # the pipeline stage described: all, first or last
    trainable_params: int = 0  # fine-tuning (`finetune_memory`): parameters the optimizer updates
    linear_weight_bytes: int = 0  # fine-tuning: the base's block linear weights as stored

    @property
    def model_states_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, f"{term}_bytes") for term in self.held_at_peak)


@dataclass(frozen=True)
class _Run:
    """Validated inputs of one plan, with what follows from them."""

    m: ModelConfig | None
    num_params: int
    batch_size: int
    seq_len: int
    precision: str
    prec: PrecisionBytes
    optimizer: str
    zero_stage: int
    tp: int
    pp: int
    dp: int
    checkpointing: str
    checkpointed_layers: int | None
    accumulation_steps: int
    impl: str  # the optimizer's implementation: torch's default for the device unless given
    fsdp2: bool  # ZeRO stages 2-3 as FSDP2 builds them (shards kept beside gathered parameters)
    stat: int  # bytes of LayerNorm's mean/rstd: fp32 on CUDA, the activation dtype on the CPU
    shape: LocalShape | None
    loss_chunk: int = 0  # the chunked loss's tokens of logits at a time (0: the plain loss)
    packed: bool = False  # documents packed into the rows, a per-document mask (labkit.blocks.packing)
    sequence_parallel: bool = False  # Megatron's: the norms and the residual stream split by tokens over tp

    @property
    def fsdp2_sharded(self) -> bool:
        return fsdp2_sharded(self.fsdp2, self.zero_stage, self.dp)


def fsdp2_sharded(fsdp2: bool, zero_stage: int, dp: int) -> bool:
    """FSDP2 shards the parameters over data-parallel ranks (ZeRO-2/3, dp > 1)."""
    return fsdp2 and zero_stage >= 2 and dp > 1


def _positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")


def _resolve(m: ModelConfig | None = None, *, num_params: int | None = None, batch_size: int = 1,
             seq_len: int = 2048, precision: str = "fp32", optimizer: str = "adamw",
             zero_stage: int = 0, tp: int = 1, pp: int = 1, gpus: int = 1,
             checkpointing: str = "none", checkpointed_layers: int | None = None,
             accumulation_steps: int = 1, device: str | None = None,
             optimizer_impl: str | None = None, fsdp2: bool = False, loss_chunk: int = 0,
             packed: bool = False, sequence_parallel: bool = False) -> _Run:
    """Check every input (ConfigError naming the valid choices) and derive the rest."""
    _positive(batch_size=batch_size, seq_len=seq_len, tp=tp, pp=pp, gpus=gpus,
              accumulation_steps=accumulation_steps)
    if loss_chunk < 0 or (loss_chunk and tp > 1):
        raise ConfigError(f"loss_chunk={loss_chunk}: 0 (the plain loss) or a count of tokens, "
                          "with tp=1 (the chunks need the head's whole vocabulary)")
    if sequence_parallel and (seq_len % tp or checkpointing != "none"):
        raise ConfigError(f"sequence_parallel splits seq_len={seq_len} over tp={tp} ranks: it needs a "
                          f"multiple of tp, and is planned without checkpointing (not {checkpointing!r})")
    check_choice("precision", precision, PRECISIONS), check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("checkpointing", checkpointing, CHECKPOINTING)
    if zero_stage not in ZERO_STAGES:
        raise ConfigError(f"zero_stage={zero_stage!r} is not a ZeRO stage; valid: 0, 1, 2, 3")
    if gpus % (tp * pp):
        raise ConfigError(f"gpus={gpus} is not a multiple of tp x pp = {tp * pp}")
    psi = _check_model(m, num_params, seq_len=seq_len, tp=tp, pp=pp)
    _check_checkpointed(m, checkpointing, checkpointed_layers)
    device = device or hardware.default_device()
    dp = gpus // (tp * pp)
    impl = _optimizer_impl(optimizer, optimizer_impl, device, m=m, precision=precision,
                           sharded=zero_stage >= 1 and dp > 1)
    p = precision_bytes(precision, fsdp2_sharded=fsdp2_sharded(fsdp2, zero_stage, dp))
    return _Run(m=m, num_params=psi, batch_size=batch_size, seq_len=seq_len, precision=precision,
                prec=p, optimizer=optimizer, zero_stage=zero_stage, tp=tp, pp=pp,
                dp=dp, checkpointing=checkpointing,
                checkpointed_layers=checkpointed_layers, accumulation_steps=accumulation_steps,
                impl=impl, fsdp2=fsdp2, stat=p.residual if device.startswith("cpu") else 4,
                shape=local_shape(m, tp) if m is not None else None, loss_chunk=loss_chunk,
                packed=packed, sequence_parallel=sequence_parallel)


def _optimizer_impl(optimizer: str, impl: str | None, device: str, *, m: ModelConfig | None,
                    precision: str, sharded: bool) -> str:
    """How the optimizer updates: torch's default for the device (a for-loop on the CPU,
    multi-tensor on CUDA) unless given; a low-bit AdamW eagerly on the CPU, compiled on CUDA
    (`labkit.blocks.optimizers`), on whole tensors of a known shape, without master copies."""
    if optimizer not in LOW_BIT:
        return check_choice("optimizer_impl", impl or ("single" if device.startswith("cpu") else "foreach"),
                            OPTIMIZER_IMPLS)
    if m is None or sharded or precision_bytes(precision).master:
        raise ConfigError(f"optimizer={optimizer} is planned from each whole tensor's size: it needs "
                          "the model's shape, zero_stage 0 (or one replica) and no master copies "
                          f"(precision={precision})")
    return check_choice("optimizer_impl", impl or ("eager" if device.startswith("cpu") else "compiled"),
                        LOW_BIT_IMPLS)


def _check_model(m: ModelConfig | None, num_params: int | None, *, seq_len: int, tp: int,
                 pp: int) -> int:
    """Ψ, from the shape or as given (exactly one of them)."""
    if m is None:
        if num_params is None:
            raise ConfigError("give a model shape or num_params")
        _positive(num_params=num_params)
        return num_params
    if num_params is not None and num_params != _count_params(m):
        raise ConfigError("give a model shape or num_params, not both")
    if pp > m.num_layers:
        raise ConfigError(f"pp={pp} pipeline stages for {m.num_layers} layers: at most one stage per layer")
    if seq_len > m.max_seq_len:
        raise ConfigError(f"seq_len={seq_len} is longer than the model's context ({m.max_seq_len})")
    check_tp(m, tp)
    return _count_params(m)


def _check_checkpointed(m: ModelConfig | None, mode: str, layers: int | None) -> None:
    if layers is None:
        return
    total = m.num_layers if m is not None else layers
    if not isinstance(layers, int) or not 0 <= layers <= total:
        raise ConfigError(f"checkpointed_layers={layers!r} must be between 0 and {total}")
    if mode == "none" and layers:
        raise ConfigError("checkpointed_layers needs checkpointing selective or full")
