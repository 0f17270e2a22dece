"""Compressed gradients: data parallelism that sends each step's gradients in fewer bytes.

Every variant trains the same seeded decoder on the same global batch (batch_size sequences a
rank) for `steps` AdamW steps. `fp32` (the reference): DDP's own all-reduce. `bf16`, `fp16`,
`int8`, `powersgd`: DDP with a communication hook (`labkit.blocks.compression`);
`fsdp2_fp32_reduce`, `fsdp2_bf16_reduce`: FSDP2 (ZeRO-2), fp32 compute, the reduce-scatter in
fp32 or bf16. Checked against fp32 at the first (compressed) step, same weights and data: the
gradient within the format's bound (`grad_tolerance`), every DDP rank's the same, PowerSGD's a
projection of fp32's; the loss after `steps` steps within that bound times fp32's progress.
Measured: the bytes each rank hands to the gradient reduction in a step (CommCounter) against
`planner.compression`, and their ratio to fp32's.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit import planner
from labkit.blocks import compression
from labkit.blocks.distributed import DistConfig, corrupt_reduction, corrupt_scale, world_size
from labkit.blocks.model import build_model
from labkit.blocks.sharded import full_tensor
from labkit.blocks.training import Trainer, global_relative_difference, gradient_difference
from labkit.blocks.transforms import apply_data_parallel
from labkit.config import MODELS, ConfigError, check_choice, knob
from labkit.planner import compression as formulas
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("fp32", "bf16", "fp16", "int8", "powersgd", "fsdp2_fp32_reduce", "fsdp2_bf16_reduce")
REFERENCE = "fp32"
# 7 variants on 2 gloo ranks within seconds: every step all-reduces every gradient, so 2 blocks
# and a 1024-token vocabulary (the embedding and head would be most of the bytes at 4096); what
# it measures is counted, not timed: one timed step
SIZES = {"tiny": {"batch_size": 2, "seq_len": 32, "num_layers": 2, "vocab_size": 1024,
                  "timed_steps": 1}}
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"num_layers": 1}, {"num_layers": 1, "steps": 2})

FORMAT = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16", "int8": "int8", "powersgd": "powersgd",
          "fsdp2_fp32_reduce": "fp32", "fsdp2_bf16_reduce": "bf16"}
FSDP2 = {"fsdp2_fp32_reduce": torch.float32, "fsdp2_bf16_reduce": torch.bfloat16}
# fp32 reductions sum in another order (FSDP2's reduce-scatter, gloo's ring): a few ulps (1.2e-7).
FP32_TOLERANCE = 1e-5
# PowerSGD's first compressed gradient is the projection of the mean onto P's orthonormal columns:
# ||g_hat - g||^2 + ||g_hat||^2 = ||g||^2, up to fp32 rounding of the orthogonalisation.
PROJECTION_TOLERANCE = 1e-4


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="how the gradients are sent")
    steps: int = knob(3, min=1, help="training steps checked (the loss after them vs fp32's)")
    bucket_cap_mb: float = knob(1.0, min=0.01, help="DDP bucket size, MiB: int8 keeps one scale per bucket")
    powersgd_rank: int = knob(1, min=1, max=8, help="PowerSGD's rank r: (n + m) r elements per n x m gradient")
    int8_fault: str = knob("none", choices=compression.INT8_FAULTS,
                           help="a bug in the int8 hook, for the check to catch: no_average "
                                "(the sum sent back), own_scale (no agreed scale)")
    reduction_fault = True  # fault=corrupt_reduction scales fault_rank's part before the reduction


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"grad_compression trains in float32 (got {cfg.dtype}); the gradient "
                          "format is the variant: valid: float32")
    if cfg.variant == "int8":
        formulas.int8_levels(cfg.nproc or 2)  # a ConfigError past 127 ranks


def skip_reason(cfg: Config) -> str | None:
    if cfg.int8_fault != "none" and cfg.variant not in (REFERENCE, "int8"):
        return f"int8_fault={cfg.int8_fault} is a bug in the int8 hook: only int8 (and fp32, its reference) run"
    return None


def is_fsdp2(variant: str) -> bool:
    return variant in FSDP2


def bucket_cap_mb(cfg: Config) -> float:
    return compression.bucket_cap_mb(cfg.variant, cfg.device) or cfg.bucket_cap_mb


def warmup_passes(variant: str) -> int:
    """Synced backward passes before the check, no update: DDP rebuilds its buckets after the
    first; PowerSGD compresses from its POWERSGD_START_ITER-th."""
    if is_fsdp2(variant):
        return 0
    return compression.POWERSGD_START_ITER if variant == "powersgd" else 1


def reference_ignores(cfg: Config) -> tuple[str, ...]:
    """fp32 DDP (no hook but the sum) has no PowerSGD rank and no int8 hook for int8_fault."""
    return ("powersgd_rank", "int8_fault")


def build_step(cfg: Config) -> tuple[Trainer, compression.Compression | None]:
    """The plain step on the global batch, made data parallel (this rank's slice; DDP with the
    variant's hook, or FSDP2 ZeRO-2 with its reduce dtype), the fault added, then AdamW."""
    trainer = Trainer(cfg, batch_size=cfg.batch_size * world_size(), optimizer=False)
    scale = corrupt_scale(cfg) if cfg.variant != REFERENCE else None
    comp = None
    if is_fsdp2(cfg.variant):
        apply_data_parallel(trainer, "zero2", mp_policy=compression.reduce_policy(FSDP2[cfg.variant]))
        if scale is not None:
            corrupt_reduction(trainer.model, scale)
    else:
        apply_data_parallel(trainer, "ddp", bucket_cap_mb=bucket_cap_mb(cfg))
        comp = compression.register_compression(trainer.net, FORMAT[cfg.variant],
                                                powersgd_rank=cfg.powersgd_rank,
                                                int8_fault=cfg.int8_fault, scale=scale)
    trainer.measure_norm = False  # no gradient norm: on DTensors it adds collectives
    trainer.build_optimizer()
    return trainer, comp


def global_mean(value: float, device: str) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)  # NCCL reduces device tensors
    dist.all_reduce(t)
    return t.item() / world_size()


def warm_up(trainer: Trainer, cfg: Config) -> float:
    """The warm-up passes (grads dropped); for the reference, one more without sync: the mean
    over the ranks of their own gradients' norms (what a 16-bit reduction's error scales with)."""
    for _ in range(warmup_passes(cfg.variant)):
        trainer.accumulate()
        trainer.drop_grads()
    if cfg.variant != REFERENCE:
        return math.nan
    trainer.accumulate(sync=False)
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in trainer.model.parameters()))
    trainer.drop_grads()
    return global_mean(norm, cfg.device)


def counted_step(trainer: Trainer, comp) -> tuple[float, dict[str, float]]:
    """The first checked step's forward and backward, every collective in it counted (with
    PowerSGD's P and Q, issued where CommCounter cannot see them)."""
    if comp is not None:
        comp.reset()
    with compression.SentCounter() as sent:
        loss = trainer.accumulate()
    if comp is not None and comp.fmt == "powersgd":
        sent.add_unseen("all_reduce", compression.powersgd_sent(comp.state))
    out = sent.metrics()
    reductions = ("all_reduce", "reduce_scatter")  # not FSDP2's all-gather of the weights
    out.update(grad_comm_bytes=float(sum(sent.bytes[c] for c in reductions)),
               grad_bus_bytes=sum(formulas.bus_bytes(sent.bytes[c], world_size(), c) for c in reductions))
    if comp is not None:
        out["num_buckets"] = float(len(comp.buckets))
    return loss, out


def check(trainer: Trainer, comp, cfg: Config) -> dict:
    """Warm-up, the counted step (its averaged gradients, host copies), its update, `steps` - 1
    more, then the loss after them (one more forward): losses are the global batch's."""
    local_norm = warm_up(trainer, cfg)
    loss, sent = counted_step(trainer, comp)
    grads = {n: full_tensor(p.grad, cfg.device).cpu().numpy().copy()
             for n, p in trainer.model.named_parameters()}
    out = {"sent": sent, "grads": grads, "local_norm": local_norm,
           "spread": math.nan if is_fsdp2(cfg.variant) else compression.replica_spread(trainer.model),
           "int8_bound_sq": comp.state.bound_sq if comp is not None and comp.fmt == "int8" else 0.0}
    losses = [global_mean(loss, cfg.device)]
    trainer.update()
    losses += [global_mean(trainer.step(), cfg.device) for _ in range(cfg.steps - 1)]
    with torch.no_grad():
        out["loss"] = global_mean(trainer.forward().item(), cfg.device)
    return {**out, "losses": losses}


def build(cfg: Config) -> Workload:
    trainer, comp = build_step(cfg)
    return Workload(step=trainer.step, check=functools.partial(check, trainer, comp, cfg),
                    tokens_per_step=cfg.batch_size * cfg.seq_len,  # this rank's
                    tensors={"param_bytes": lambda: list(trainer.model.parameters()),
                             "optimizer_bytes": trainer.optimizer_tensors},
                    notes=notes(cfg), count_flops=False, compute_dtype=cfg.dtype)


# --- the check ---------------------------------------------------------------------------------------

def grad_tolerance(cfg: Config, reference: dict, outputs: dict) -> float:
    """The normwise relative error ||g - g_fp32|| / ||g_fp32|| the variant's format allows:
    - fp32: FP32_TOLERANCE;
    - bf16, fp16: (N + 1) u (`planner.compression.rounding_tolerance`) of the mean of the ranks'
      own gradient norms (each element's error is relative to the ranks' parts, which may cancel in
      the mean); fp16 adds (N + 1) half-spacings 2^-25 an element, for what falls below 2^-14;
    - int8: the hook's own bound, sqrt(sum over buckets of n_b (s_b / 2)^2): each rank's rounding
      is at most half a step s_b, so is the mean's;
    - powersgd: 1: a projection moves the gradient by at most its own norm."""
    fmt, n = FORMAT[cfg.variant], world_size()
    if fmt == "fp32":
        return FP32_TOLERANCE
    if fmt == "powersgd":
        return 1.0 + FP32_TOLERANCE
    norm = math.sqrt(sum(float((g.astype("float64") ** 2).sum()) for g in reference["grads"].values()))
    if fmt == "int8":
        return math.sqrt(outputs["int8_bound_sq"]) / norm + FP32_TOLERANCE
    tol = formulas.rounding_tolerance(fmt, n) * reference["local_norm"] / norm
    if fmt == "fp16":
        numel = sum(g.size for g in reference["grads"].values())
        tol += (n + 1) * formulas.FP16_SUBNORMAL_HALF_SPACING * math.sqrt(numel) / norm
    return tol + FP32_TOLERANCE


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The first checked step's averaged gradient and the loss after `steps` steps against fp32's
    (the loss within the gradient's tolerance times fp32's progress, L_0 - L_steps); every DDP
    rank's gradient the same; PowerSGD's a projection. The bytes sent, and their ratio to fp32's."""
    grad_rel = global_relative_difference(reference["grads"], outputs["grads"])
    _, per_tensor = gradient_difference(reference["grads"], outputs["grads"])
    tol = grad_tolerance(cfg, reference, outputs)
    progress = reference["losses"][0] - reference["loss"]
    delta = outputs["loss"] - reference["loss"]
    loss_tol = tol * abs(progress) + FP32_TOLERANCE * abs(reference["loss"])
    checked = {"gradient": (grad_rel, tol), "loss after the steps": (abs(delta), loss_tol)}
    metrics = {"loss": outputs["loss"], "loss_delta": delta, "loss_tolerance": loss_tol,
               "grad_rel_diff": grad_rel, "grad_tolerance": tol, "grad_max_rel_diff": per_tensor}
    if not is_fsdp2(cfg.variant):
        checked["ranks' gradients"] = (outputs["spread"], 0.0)
        metrics["replica_spread"] = outputs["spread"]
    if cfg.variant == "powersgd":
        residual = compression.projection_residual(reference["grads"], outputs["grads"])
        checked["projection"], metrics["projection_residual"] = (residual, PROJECTION_TOLERANCE), residual
    sent = outputs["sent"]
    metrics.update(sent, compression_ratio=reference["sent"]["grad_comm_bytes"] / sent["grad_comm_bytes"])
    failed = {name: pair for name, pair in checked.items() if not pair[0] <= pair[1]}  # nan fails
    message = ", ".join(f"{name} {value:.3g} (<= {limit:.3g})" for name, (value, limit) in failed.items())
    return Comparison(metrics, not failed, message)


# --- the napkin math ---------------------------------------------------------------------------------

def grad_shapes(cfg: Config) -> list[tuple[int, ...]]:
    """Every parameter's shape, in registration order (a model on `meta`: nothing allocated)."""
    return [tuple(p.shape) for p in build_model(cfg.model, device="meta").parameters()]


def predicted_buckets(cfg: Config) -> list[int]:
    return formulas.ddp_buckets([math.prod(s) for s in grad_shapes(cfg)], bucket_cap_mb(cfg) * 2**20)


def expected(cfg: Config) -> dict[str, float]:
    """Per rank and step: S of the gradient reduction (`planner.compression`), its bus bytes,
    the collectives, FSDP2's all-gather of the weights, and the ratio to fp32's 4Ψ."""
    n, shapes, fmt = cfg.nproc or 2, grad_shapes(cfg), FORMAT[cfg.variant]
    psi = sum(math.prod(s) for s in shapes)
    counts = dict.fromkeys(("all_reduce_count", "all_gather_count", "reduce_scatter_count"), 0.0)
    gather = 0
    if is_fsdp2(cfg.variant):  # ZeRO-2: each unit (the blocks, the root) gathered once a step
        grad = formulas.grad_reduce_bytes(psi, fmt)
        gather = planner.fsdp2_all_gather_bytes(psi, zero_stage=2,
                                                root_params=planner.root_unit_params(cfg.model))
        units = cfg.model.num_layers + 1
        counts.update(all_gather_count=units, reduce_scatter_count=units)
        grad_bus = formulas.bus_bytes(grad, n, "reduce_scatter")
    else:
        buckets = predicted_buckets(cfg)
        calls = {"int8": 2, "powersgd": 3}.get(fmt, 1)  # scale + payload; uncompressed, P, Q
        grad = (formulas.int8_reduce_bytes(buckets) if fmt == "int8" else
                formulas.powersgd_bytes(shapes, cfg.powersgd_rank) if fmt == "powersgd" else
                formulas.grad_reduce_bytes(psi, fmt))
        counts.update(all_reduce_count=calls * len(buckets), num_buckets=len(buckets))
        grad_bus = formulas.bus_bytes(grad, n, "all_reduce")
    return {**{k: float(v) for k, v in counts.items()}, "grad_comm_bytes": float(grad),
            "grad_bus_bytes": grad_bus, "comm_bytes": float(grad + gather),
            "comm_bus_bytes": grad_bus + formulas.bus_bytes(gather, n, "all_gather"),
            "compression_ratio": formulas.compression_ratio(4 * psi, grad),
            **model_states(cfg, psi, len(shapes))}


def model_states(cfg: Config, psi: int, num_tensors: int) -> dict[str, float]:
    """The weights and AdamW's moments this rank keeps (whole under DDP, 1/N under FSDP2, every
    dimension even here) plus a 4-byte step counter per tensor; the planner's peak for the plain
    DDP step and FSDP2's ZeRO-2 (the hooks' buffers, alive while their reduction is in flight,
    are not predicted)."""
    n, stage = cfg.nproc or 2, 2 if is_fsdp2(cfg.variant) else 0
    param, _, moments = planner.zero_model_state_bytes(psi, stage=3 if stage else 0, dp=n,
                                                        precision="fp32", optimizer="adamw")
    out = {"param_bytes": float(param), "optimizer_bytes": float(moments + 4 * num_tensors)}
    if cfg.variant in (REFERENCE, *FSDP2):
        plan = planner.training_memory(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                       precision="fp32", optimizer="adamw", zero_stage=stage,
                                       gpus=n, device=cfg.device, fsdp2=True)
        out["peak_mem_bytes"] = float(plan.total_bytes)
    return out


SENT = {"fp32": "4 bytes per parameter", "bf16": "2 bytes per parameter",
        "fp16": "2 bytes per parameter",
        "int8": "per bucket: its int8 all-reduce, 1 byte an element, and the all-reduce(max) of "
                "its fp32 scale, 4 bytes",
        "powersgd": "(n + m) r fp32 numbers per compressed n x m matrix, the rest as it is; P's and "
                    "Q's all-reduces, issued from future callbacks on gloo's thread where "
                    "CommCounter cannot see them, are added from PowerSGD's buffers"}


def notes(cfg: Config) -> dict[str, str]:
    n, fmt = cfg.nproc or 2, FORMAT[cfg.variant]
    out = {"grad_comm_bytes": "S (nccl-tests) of the all-reduces and reduce-scatters of one step on "
                              f"this rank, counted by CommCounter; predicted: {SENT[fmt]}.",
           "grad_bus_bytes": f"through each rank's link with a ring: 2(N-1)/N = {2 * (n - 1) / n:.2f} "
                             "x S for an all-reduce, (N-1)/N for a reduce-scatter.",
           "compression_ratio": "fp32's grad_comm_bytes / this variant's (both measured).",
           "grad_rel_diff": "||g - g_fp32|| / ||g_fp32|| at the first checked step (same weights and "
                            "data): the lossy delta, held within grad_tolerance.",
           "loss_delta": "the loss after `steps` steps minus fp32's, held within grad_tolerance x "
                         "fp32's progress (its first loss minus its last)."}
    if fmt == "int8":
        out["grad_tolerance"] = (f"sqrt(sum of n_b (s_b/2)^2) / ||g_fp32||: half a step of each bucket's "
                                 f"grid, {formulas.int8_levels(n)} = floor(127/{n}) levels a rank.")
    if is_fsdp2(cfg.variant):
        out["comm_bytes"] = "with FSDP2's all-gather of the fp32 weights, which no reduce dtype changes."
    return out


def scale_table(model: str, *, world: int = 8, powersgd_rank: int = 4, link_gbps: float = 50.0):
    """A published shape's gradient bytes per rank and step, per format (`planner.compression`):
    S, the ring all-reduce's bus bytes, the ratio to fp32 and the seconds at `link_gbps` GB/s."""
    import pandas as pd

    m = MODELS[check_choice("model", model, tuple(MODELS))]
    sent = formulas.format_bytes(m, powersgd_rank=powersgd_rank)
    bus = {fmt: formulas.bus_bytes(s, world) for fmt, s in sent.items()}
    return pd.DataFrame({"grad_comm_bytes": sent, "grad_bus_bytes": bus,
                         "compression_ratio": {f: formulas.compression_ratio(sent["fp32"], s)
                                               for f, s in sent.items()},
                         "link_ms": {f: b / (link_gbps * 1e9) * 1e3 for f, b in bus.items()}})
