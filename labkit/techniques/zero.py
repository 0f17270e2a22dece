"""ZeRO: data parallelism that stops keeping every model state on every rank.

Every rank trains the same decoder on its own slice of one global batch; the gradients are
averaged, so every variant ends with the same weights. Variants: `ddp` (the reference, ZeRO's
stage 0), `zero1` (`ZeroRedundancyOptimizer`), `zero2` (FSDP2, `reshard_after_forward=False`),
`zero3` (FSDP2's default) and `zero3_offload` (FSDP2's `CPUOffloadPolicy`; GPUs only). Which bytes
each keeps, and why: notebooks/text/11_zero.md.

`build_step` wraps the plain step with `transforms.apply_data_parallel`, then builds the optimizer
over the wrapped (sharded) parameters, whose shards its states take. The check holds each
variant to DDP twice: the first step's whole gradients, then the weights and losses after
CHECK_STEPS steps (AdamW's update hides a positive scale of a gradient, so the weights alone would
miss a missing average). `fault=corrupt_reduction` scales fault_rank's bucket before DDP's
all-reduce (`zero1`), or its reduce-scatter shard after it (`zero2`, `zero3`), and must fail it.
The timed step zeroes the gradients first, so `grad_bytes` is measured at rest after the step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit import planner
from labkit.config import ConfigError, knob
from labkit.blocks.distributed import DistConfig, corrupt_reduction, corrupt_scale, world_size
from labkit.blocks.layout import ZERO_MODES
from labkit.blocks.sharded import full_tensor
from labkit.blocks.training import Trainer, compare_grads, global_relative_difference, gradient_difference
from labkit.blocks.transforms import apply_data_parallel
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = (*ZERO_MODES, "zero3_offload")  # the data-parallel names compose and the planner use
REFERENCE = "ddp"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"timed_steps": 3, "seq_len": 32}, {"timed_steps": 2, "seq_len": 32, "num_layers": 2},
             {"timed_steps": 2, "seq_len": 32, "num_layers": 1})

STAGE = {**{mode: stage for stage, mode in enumerate(ZERO_MODES)}, "zero3_offload": 3}
LR = 1e-3
CHECK_STEPS = 2  # the second step also checks the sharded optimizer states the first one made
# Normwise relative difference of the weights after CHECK_STEPS steps, ||w - w_ref|| / ||w_ref||
# per tensor, and relative difference of the losses. AdamW is elementwise, and on two ranks every
# variant averages the gradients as (a + b) / 2, exactly: bitwise equal to DDP (gloo, here). More
# ranks may sum in another order (NCCL's rings and trees), and GPU kernels differ between the
# sharded and whole tensors: a few fp32 ulps (1.2e-7 each). On CUDA, backwards that accumulate
# with atomics (embedding, attention) differ run to run by such ulps, and AdamW's first steps
# (update ~ lr * g / |g|) turn a sign flip of a near-zero gradient into a whole lr: an H200 measured
# 3.3e-5 (zero3 against ddp, one rank, small preset), so there 1e-4 is allowed.
TOLERANCE = {"cpu": 1e-6, "cuda": 1e-4}


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="the ZeRO stage, and how it is built")
    reduction_fault = True  # see maybe_corrupt_reduction


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"zero trains in float32 (got {cfg.dtype}); valid: float32")


def skip_reason(cfg: Config) -> str | None:
    if cfg.variant == "zero3_offload" and not cfg.device.startswith("cuda"):
        return ("needs a GPU: CPUOffloadPolicy keeps the shards in host memory and copies each "
                "block to the GPU for its forward and backward; on CPU ranks they already are there")
    return None


def maybe_corrupt_reduction(model: torch.nn.Module, cfg: Config) -> None:
    """Under fault=corrupt_reduction, on fault_rank, every variant but the reference:
    `corrupt_reduction`."""
    scale = corrupt_scale(cfg)
    if scale is not None and cfg.variant != REFERENCE:
        corrupt_reduction(model, scale)


def build_step(cfg: Config) -> Trainer:
    """The plain step on the global batch (nproc x batch_size sequences, the same on every rank),
    made data parallel by the variant's transform (this rank's slice of the batch, DDP or FSDP2),
    the fault's hook added, then the optimizer built over the wrapped (sharded) parameters. Each
    step drops the previous step's gradients first (so this one's stay at rest, where
    `grad_bytes` is measured); no gradient norm (on DTensors it would add collectives)."""
    trainer = Trainer(cfg, lr=LR, batch_size=cfg.batch_size * world_size(), optimizer=False)
    offload = cfg.variant == "zero3_offload"
    apply_data_parallel(trainer, "zero3" if offload else cfg.variant, offload=offload)
    maybe_corrupt_reduction(trainer.net, cfg)
    trainer.grads_at_rest, trainer.measure_norm = True, False
    trainer.build_optimizer()
    return trainer


def check(trainer: Trainer) -> dict:
    """CHECK_STEPS steps; the losses, host copies of the whole gradients of the first step (kept
    at rest after it) and of the whole weights after the last."""
    losses = [trainer.step()]
    grads = whole(trainer, {n: p.grad for n, p in trainer.model.named_parameters()})
    losses += [trainer.step() for _ in range(CHECK_STEPS - 1)]
    weights = whole(trainer, dict(trainer.model.named_parameters()))
    return {"losses": losses, "grads": grads, "weights": weights}


def whole(trainer: Trainer, tensors: dict[str, torch.Tensor]) -> dict:
    """Host copies, gathered whole (collectives, in the same order on every rank)."""
    return {n: full_tensor(t, trainer.cfg.device).cpu().numpy().copy() for n, t in tensors.items()}


def grads(trainer: Trainer) -> list[torch.Tensor]:
    return [p.grad for p in trainer.model.parameters() if p.grad is not None]


def build(cfg: Config) -> Workload:
    trainer = build_step(cfg)
    # FlopCounterMode under FSDP sees DTensor ops with global shapes: FLOPs are not counted.
    return Workload(step=trainer.step, check=lambda: check(trainer),
                    tokens_per_step=cfg.batch_size * cfg.seq_len,  # this rank's
                    # DTensors: storage_bytes counts the local shard
                    tensors={"param_bytes": lambda: list(trainer.model.parameters()),
                             "grad_bytes": lambda: grads(trainer),
                             "optimizer_bytes": trainer.optimizer_tensors},
                    notes=notes(cfg), count_flops=False, compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The whole gradients of the first step, and this rank's losses and the whole weights after
    CHECK_STEPS steps, against plain DDP's."""
    _, per_tensor = gradient_difference(reference["weights"], outputs["weights"])
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(outputs["losses"], reference["losses"]))
    tol = TOLERANCE["cuda" if cfg.device.startswith("cuda") else "cpu"]
    # checked over the whole model; the largest per-tensor difference shown (a zero-initialised
    # bias, e.g. Qwen2's, makes it large without anything being wrong: see
    # global_relative_difference)
    weights = global_relative_difference(reference["weights"], outputs["weights"])
    return compare_grads(reference, outputs, tol,
                         reported={"loss": outputs["losses"][-1], "weight_max_rel_diff": per_tensor},
                         extra={"weight_rel_diff": weights, "loss_rel_diff": loss_rel})


def at_rest_stages(variant: str) -> tuple[int, int, int]:
    """The ZeRO stage whose (param, grad, optimizer) bytes this variant keeps after its step:
    FSDP2 reshards the parameters after the backward whatever reshard_after_forward says."""
    stage = STAGE[variant]
    return (3 if stage >= 2 else stage, stage, stage)


def expected(cfg: Config) -> dict[str, float]:
    """Per rank: the planner's model states for what this variant keeps at rest, and its peak."""
    n = cfg.nproc or 2
    psi = planner.num_params(cfg.model)
    stages = at_rest_stages(cfg.variant)
    states = [planner.zero_model_state_bytes(psi, stage=s, dp=n, precision="fp32",
                                             optimizer="adamw")[i] for i, s in enumerate(stages)]
    out = dict(zip(("param_bytes", "grad_bytes", "optimizer_bytes"), map(float, states)))
    if cfg.variant != "zero3_offload":  # the planner has no offload: its peak is on the device
        plan = planner.training_memory(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                       precision="fp32", optimizer="adamw",
                                       zero_stage=STAGE[cfg.variant], gpus=n, device=cfg.device,
                                       fsdp2=True)
        out["peak_mem_bytes"] = float(plan.total_bytes)
    return out


COUNTERS = ("AdamW's moments (K = 8 bytes per parameter) plus one 4-byte step counter per "
            "parameter tensor, which the planner leaves out.")
DDP_PEAK = ("DDP's gradient buckets (4Ψ; the gradients are views of them) live through the whole "
            "step, so its backward runs with every gradient allocated (the planner counts them).")
FSDP2_PEAK = ("In the backward FSDP2 also holds a block's reduce-scatter buffers (its flat "
              "fp32 gradient and the output shard, beside the block's own gradients), of which "
              "the planner counts only the previous block's flat gradient, under ZeRO-3: where "
              "the backward sets the peak (small batches), the measured peak is that much above "
              "the prediction.")
NOTES = {
    "ddp": {"grad_bytes": "DDP's all-reduce buckets, which the gradients are views of.",
            "peak_mem_bytes": DDP_PEAK},
    "zero1": {"optimizer_bytes": COUNTERS + " The paper's P_os; ZeroRedundancyOptimizer gives each "
                                            "rank whole tensors, balanced by size: near 1/Nd.",
              "peak_mem_bytes": DDP_PEAK + " Its AdamW steps whole tensors: temporaries of the "
                                           "largest whole tensors, where the planner shards them."},
    "zero2": {"param_bytes": "FSDP2 reshards parameters after the backward even with "
                             "reshard_after_forward=False, so at rest they are sharded (predicted: "
                             "stage 3's 4Ψ/Nd); the paper's stage 2 (P_os+g) keeps them whole, 4Ψ.",
              "peak_mem_bytes": "predicted: FSDP2's ZeRO-2 as built, each block whole from "
                                "its forward to its backward beside its shards. " + FSDP2_PEAK},
    "zero3": {"param_bytes": "The paper's P_os+g+p: 4Ψ/Nd.",
              "peak_mem_bytes": "predicted: FSDP2's ZeRO-3 as built, each block gathered for "
                                "its forward and again for its backward, the root unit kept "
                                "between them. " + FSDP2_PEAK},
    "zero3_offload": {"param_bytes": "in host memory, as are the gradients and optimizer states.",
                      "peak_mem_bytes": "on the GPU: the blocks gathered at a time and the "
                                        "activations; the planner does not model offload."},
}


def notes(cfg: Config) -> dict[str, str]:
    return {"optimizer_bytes": COUNTERS, **NOTES[cfg.variant]}
