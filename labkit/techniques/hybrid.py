"""2-D parallelism: a (data x tensor) device mesh on 4 ranks, against the 1-D layouts.

One training step (AdamW, fp32) on one global batch of `batch_size` sequences, laid out four ways:

- `single` (the reference): the plain model on the whole batch, computed alike on every rank.
- `fsdp`: 1-D FSDP2 (ZeRO-3) over all n ranks: every rank holds 1/n of every parameter, gradient
  and optimizer state, and trains on 1/n of the batch; the parameters are all-gathered block by
  block for the forward and again for the backward, the gradients reduce-scattered.
- `tp`: 1-D tensor parallel over all n ranks (Megatron's split, `transforms.apply_tp`): every
  rank holds 1/n of the heads, MLP width and vocabulary and sees the whole batch. n must divide the
  kv heads: the tiny preset has 2, so run it with `num_kv_heads=4` (else it is skipped).
- `fsdp_tp`: a (dp, tp) = (n / tp, tp) mesh: tensor parallel inside each group of `tp` ranks (the
  fast links on a real machine), FSDP across the groups; each dp group trains on 1/dp of the batch.
  Per rank: 1/n of the model states, like `fsdp`, but the all-gathers move 1/tp as much (each
  gathers a TP shard) and the activations of the split matmuls are 1/tp.

The transforms (`labkit.blocks.transforms`), in torchtitan's order: `apply_tensor_parallel` on the
"tp" sub-mesh, then ZeRO-3 on the "dp" sub-mesh (`apply_data_parallel`, FSDP2, as a recipe's
zero3, which also takes the dp group's rows of the batch), then the optimizer
(`build_sharded_step` builds it last), over one `Layout`'s mesh. FSDP goes last because it shards
whatever parameters it finds, TP's DTensors included (they become 2-D DTensors on the (dp, tp)
mesh), while parallelize_module cannot split a parameter FSDP has already sharded; and FSDP must
see the final parameters to group them for its all-gathers. The loss (the mean over the dp groups) and every gradient
(gathered with `full_tensor()`) must equal the reference's at fp32 precision. Under
`fault=corrupt_reduction` fault_rank spoils the reductions of the techniques its layout applies
(`with_fault`): tensor parallel's sum of the wo and w2 partial products, FSDP2's reduce-scatter
shard; that check must fail.
"""
from __future__ import annotations

from dataclasses import dataclass

import functools
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from labkit import planner
from labkit.config import ConfigError, knob
from labkit.blocks.distributed import DistConfig, corrupt_reduction, corrupt_scale
from labkit.blocks.sharded import (TP_TOLERANCE as TOLERANCE, backward, build_sharded_step,
                                   check_tp_shape, corrupt_row_outputs, full_grads, grads, train_step)
from labkit.blocks.training import Trainer, compare_grads, lm_loss, optimizer_state
from labkit.blocks.layout import Layout
from labkit.blocks.transforms import apply_data_parallel, apply_tensor_parallel
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
CPU_RANKS = 4  # ranks without GPUs (with them: one per GPU): a 2 x 2 mesh
VARIANTS = ("single", "fsdp", "tp", "fsdp_tp")
REFERENCE = "single"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"timed_steps": 3, "seq_len": 32}, {"timed_steps": 2, "seq_len": 32, "num_layers": 2},
             {"timed_steps": 2, "seq_len": 32, "num_layers": 1})

SIZES = {"tiny": {"num_kv_heads": 4}}  # 4-way tensor parallel splits the kv heads four ways


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="the layout of the ranks")
    tp: int = knob(2, min=1, help="fsdp_tp's tensor-parallel degree; dp = nproc / tp")
    reduction_fault = True  # see with_fault


def world(cfg: Config) -> int:
    return cfg.nproc or CPU_RANKS  # nproc is filled in before the ranks start


def layout(cfg: Config) -> tuple[int, int]:
    """(dp, tp) of the variant: how many ways the batch and the matrices are split."""
    n = world(cfg)
    return {"single": (1, 1), "fsdp": (n, 1), "tp": (1, n), "fsdp_tp": (n // cfg.tp, cfg.tp)}[cfg.variant]


def validate(cfg: Config) -> None:
    n = world(cfg)
    if n % cfg.tp:
        valid = [t for t in range(1, n + 1) if n % t == 0]
        raise ConfigError(f"nproc={n} ranks must be dp x tp: tp={cfg.tp} does not divide it; "
                          f"valid tp: {valid}")
    check_tp_shape(cfg, cfg.tp)


def skip_reason(cfg: Config) -> str | None:
    dp, tp = layout(cfg)
    m = cfg.model
    if m.num_kv_heads % tp or m.num_heads % tp:
        return (f"{tp}-way tensor parallel needs num_heads ({m.num_heads}) and num_kv_heads "
                f"({m.num_kv_heads}) divisible by {tp}: set num_kv_heads={tp}")
    if cfg.batch_size % dp:
        return f"{dp} data-parallel groups split batch_size={cfg.batch_size}: use a multiple of {dp}"
    return None


# --- the transforms ---------------------------------------------------------------------------

def make_layout(cfg: Config) -> tuple[Callable[[Trainer], Trainer] | None, Layout]:
    """(step transform, layout) of the variant; every rank makes the same mesh. FSDP2 is ZeRO-3
    as the recipe builds it (`apply_data_parallel(..., "zero3")`: each block gathered for its
    forward and again for its backward), and takes this dp group's rows of the batch."""
    dp, tp = layout(cfg)
    lay = Layout(dp, tp, "zero3" if dp > 1 else "none", cfg.device)
    if cfg.variant == "single":
        return None, lay

    def apply(trainer: Trainer) -> Trainer:
        # TP first, FSDP second (torchtitan's order): fully_shard re-shards TP's DTensors along
        # dp (2-D DTensors on the (dp, tp) mesh, each all-gather fetching a TP shard), while
        # parallelize_module cannot split parameters FSDP has already sharded. The optimizer is
        # made after both.
        if lay.tp_enabled:
            apply_tensor_parallel(trainer, lay.tp_mesh)
        if lay.dp_enabled:
            apply_data_parallel(trainer, "zero3", lay.dp_mesh)
        return trainer
    return apply, lay


def with_fault(cfg: Config, apply: Callable[[Trainer], Trainer] | None):
    """fault=corrupt_reduction, on fault_rank: the layout's transform with the fault of each
    technique it applies, as their own experiments inject it: tensor parallel's partial products
    scaled before their sum (`corrupt_row_outputs`, registered before the sharding so that it
    sees them unreduced), FSDP2's reduce-scatter shard after it (zero's `corrupt_reduction`).
    The reference has no transform and keeps none."""
    scale = corrupt_scale(cfg)
    if scale is None or apply is None:
        return apply

    def faulty(trainer: Trainer) -> Trainer:
        if layout(cfg)[1] > 1:
            corrupt_row_outputs(trainer.model, scale)
        apply(trainer)
        corrupt_reduction(trainer.model, scale)  # no FSDP2 units (tp): nothing
        return trainer
    return faulty


def mean_over(loss: torch.Tensor, dp_mesh: DeviceMesh | None) -> float:
    """The global batch's loss: the mean of the dp groups' (equal-sized) means."""
    if dp_mesh is None:
        return loss.item()
    total = loss.detach().clone()
    dist.all_reduce(total, group=dp_mesh.get_group())
    return total.item() / dp_mesh.size()


# --- the experiment ---------------------------------------------------------------------------

def build(cfg: Config) -> Workload:
    apply, lay = make_layout(cfg)
    dp_mesh = lay.dp_mesh
    trainer = build_sharded_step(cfg, with_fault(cfg, apply))
    return Workload(step=functools.partial(train_step, trainer),
                    check=functools.partial(check, trainer, dp_mesh),
                    tokens_per_step=cfg.batch_size * cfg.seq_len,  # the global batch: all ranks together
                    tensors={"param_bytes": trainer.model.parameters,
                             "grad_bytes": functools.partial(grads, trainer),
                             "optimizer_bytes": lambda: optimizer_state(trainer.optimizer)},
                    notes=notes(cfg), count_flops=False, compute_dtype=cfg.dtype)


def check(trainer: Trainer, dp_mesh: DeviceMesh | None) -> dict:
    """One training step: the global loss and every gradient, gathered whole."""
    trainer.drop_grads()
    loss = lm_loss(trainer.model(trainer.inputs), trainer.targets)
    backward(trainer, loss)
    out = {"loss": mean_over(loss, dp_mesh), "grads": full_grads(trainer.model)}
    trainer.update()
    return out


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The global batch's loss and every gradient of one step against the plain model's."""
    loss_diff = abs(outputs["loss"] - reference["loss"])
    return compare_grads(reference, outputs, TOLERANCE, extra={"loss_abs_diff": loss_diff})


def expected(cfg: Config) -> dict[str, float]:
    """The planner's per-rank model states and peak: ZeRO-3 over dp, Megatron's split over tp."""
    dp, tp = layout(cfg)
    plan = planner.training_memory(cfg.model, batch_size=max(1, cfg.batch_size // dp),
                                   seq_len=cfg.seq_len, precision="fp32", optimizer="adamw",
                                   zero_stage=3 if dp > 1 else 0, tp=tp, gpus=dp * tp,
                                   device=cfg.device, fsdp2=True)
    return {"param_bytes": float(plan.param_bytes), "grad_bytes": float(plan.grad_bytes),
            "optimizer_bytes": float(plan.optimizer_bytes), "peak_mem_bytes": float(plan.total_bytes),
            "loss_abs_diff": 0.0, "grad_max_rel_diff": 0.0}


def notes(cfg: Config) -> dict[str, str]:
    dp, tp = layout(cfg)
    where = f"dp={dp} x tp={tp}"
    return {"param_bytes": f"local shards ({where}); predicted: planner ZeRO-3 over dp of stage_params(tp).",
            "grad_bytes": "local gradient shards at rest after the step.",
            "optimizer_bytes": "AdamW's two fp32 moments of the local shards (+4 bytes of step "
                               "counter per tensor, not predicted).",
            "peak_mem_bytes": "predicted: planner.training_memory, ZeRO-3 over dp as FSDP2 "
                              "builds it (fsdp2) and Megatron's split over tp, with what labkit's "
                              "tp makes whole on every rank: the head's logits (gathered: no loss "
                              "parallelism) and the embedding's gradient at its backward (the "
                              "planner's \"embedding\" moment: under FSDP2 beside the gathered "
                              "root unit and its tp-local gradients). Not in it: FSDP2's "
                              "reduce-scatter buffers (a few percent)."}
