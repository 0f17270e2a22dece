"""Data parallelism with DistributedDataParallel: n ranks, each a slice of one global batch, their
gradients averaged by all-reduce, against one process training on the whole batch.

The global batch is n x k x b sequences (n ranks, k = `micro_batches`, b = `batch_size`).
- `single` (the reference): every rank computes the one-process step on all n*k*b sequences,
  locally, with no collective.
- `ddp`: rank r takes its k*b sequences in one forward; DDP all-reduces the gradients bucket by
  bucket (`bucket_cap_mb`) while the backward is still running. The mean of the ranks' mean
  gradients is the global batch's mean gradient: the same loss and gradients up to fp32 rounding.
- `accumulate`: k micro-batches of b per rank, every backward all-reduced (k x the bytes).
- `accumulate_no_sync`: the same, inside `DDP.no_sync()` but for the last micro-batch: the local
  sum is all-reduced once. Same gradients, 1/k of the bytes.
- `fp16_compress`, `bf16_compress`: torch's comm hooks cast each bucket to 16 bits before the
  all-reduce: half the bytes, gradients rounded to 11 (fp16) or 8 (bf16) significant bits.
- `powersgd`: rank-r PowerSGD (Vogels et al., 2019, https://arxiv.org/abs/1905.13727) sends each
  (n, m) gradient as P (n, r) and Q (m, r) with error feedback; lossy, so its gradient and loss
  deltas are reported, not checked.

Every DDP variant runs a comm hook from `torch.distributed.algorithms.ddp_comm_hooks` (`ddp` and
the accumulations torch's `allreduce_hook`, the Python twin of DDP's built-in all-reduce) wrapped
to count the bytes each bucket hands to the all-reduce: `comm_bytes` per step per rank. Under
`fault=corrupt_reduction` the same wrapper scales fault_rank's bucket before the all-reduce, and
the check must fail (but for the unchecked `powersgd`).
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from labkit import hardware, planner
from labkit.config import ConfigError, knob
from labkit.blocks import compression
from labkit.blocks.distributed import DistConfig, corrupt_scale, link_gbps, world_size
from labkit.measure.clock import clock, lined_up
from labkit.blocks.model import build_model
from labkit.blocks.training import Trainer, compare_grads
from labkit.blocks.transforms import apply_accumulation, apply_data_parallel
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("single", "ddp", "accumulate", "accumulate_no_sync", "fp16_compress", "bf16_compress",
            "powersgd")
REFERENCE = "single"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"timed_steps": 3, "seq_len": 32}, {"timed_steps": 2, "seq_len": 32, "num_layers": 2},
             {"timed_steps": 2, "seq_len": 32, "num_layers": 1})

HOOKS = {"ddp": default_hooks.allreduce_hook, "accumulate": default_hooks.allreduce_hook,
         "accumulate_no_sync": default_hooks.allreduce_hook,
         "fp16_compress": default_hooks.fp16_compress_hook,
         "bf16_compress": default_hooks.bf16_compress_hook, "powersgd": powerSGD_hook.powerSGD_hook}
WIRE_BYTES = {"fp16_compress": 2, "bf16_compress": 2}  # bytes per gradient element sent; else fp32
# Normwise relative gradient difference allowed (||g - g_ref|| / ||g_ref|| per parameter): fp32
# sums in another order for the lossless variants. The 16-bit ones round each element to 2^-11
# (fp16) or 2^-8 (bf16) relative, and fp16 flushes gradients under ~6e-8 to zero (measured on the
# tiny model: 1.6e-3 and 2.8e-3); 5e-2 lets that pass and still fails a broken hook (a missing
# average is 1.0). PowerSGD is not checked (None): its deltas are the result.
TOLERANCE = {"fp16_compress": 5e-2, "bf16_compress": 5e-2, "powersgd": None}
FP32_TOLERANCE = 1e-5
# PowerSGD with error feedback needs >= 2 plain iterations (DDP rebuilds its buckets after the
# first); check() runs them as untimed backward passes so its first step is already compressed.
POWERSGD_START_ITER = 2


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="single process, DDP, accumulation, comm hook")
    bucket_cap_mb: float = knob(25.0, min=0.01, help="DDP gradient bucket size, MiB")
    micro_batches: int = knob(2, min=1, help="k: micro-batches of batch_size per rank and step")
    powersgd_rank: int = knob(1, min=1, help="PowerSGD matrix approximation rank r")
    steps: int = knob(3, min=1, help="training steps in the check (loss after them vs the reference)")
    reduction_fault = True  # CommLog scales fault_rank's buckets


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"data_parallel trains in float32 (got {cfg.dtype}); gradient "
                          "compression is its own variant (fp16_compress, bf16_compress, powersgd)")


def is_ddp(variant: str) -> bool:
    return variant != REFERENCE


def bucket_cap_mb(cfg: Config) -> float:
    """The bucket size DDP gets: the knob's, but one bucket for PowerSGD on gloo ranks, whose
    callbacks' all-reduces can otherwise fall out of order ("Received data size doesn't match
    expected size"; `compression.bucket_cap_mb`)."""
    return compression.bucket_cap_mb(cfg.variant, cfg.device) or cfg.bucket_cap_mb


def pieces_per_rank(cfg: Config) -> int:
    return cfg.micro_batches if cfg.variant.startswith("accumulate") else 1


class CommLog:
    """Wraps a comm hook: the bytes each bucket hands to the all-reduce, and which buckets; with
    a `scale` (fault=corrupt_reduction) this rank's bucket is multiplied by it first."""

    def __init__(self, inner, wire_bytes: int, scale: float | None = None):
        self.inner, self.wire_bytes, self.scale = inner, wire_bytes, scale
        self.bytes, self.buckets = 0, set()

    def reset(self) -> None:
        self.bytes, self.buckets = 0, set()

    # No annotations: DDP compares them with dist.GradBucket and Future[Tensor] as objects, which
    # the strings of `from __future__ import annotations` are not.
    def hook(self, state, bucket):
        # PowerSGD counts the elements it sends (P, Q and the tensors it leaves uncompressed) in
        # its state once compressing; before that, and for the other hooks, the whole bucket goes.
        compressing = isinstance(state, powerSGD_hook.PowerSGDState) and \
            state.iter >= state.start_powerSGD_iter
        before = state.total_numel_after_compression if compressing else 0
        if self.scale is not None:
            bucket.buffer().mul_(self.scale)
        future = self.inner(state, bucket)
        numel = state.total_numel_after_compression - before if compressing else bucket.buffer().numel()
        self.bytes += numel * self.wire_bytes
        self.buckets.add(bucket.index())
        return future


def build_step(cfg: Config) -> tuple[Trainer, CommLog | None]:
    """The plain step on the global batch of n*k*b sequences (the same on every rank); for the
    DDP variants, this rank's k*b of them through DDP (`apply_data_parallel`: `bucket_cap_mb`,
    the gradients in their own tensors, not bucket views) with the variant's comm hook wrapped in
    a CommLog; k micro-batches of b when accumulating. Then the optimizer."""
    n, k, b = world_size(), cfg.micro_batches, cfg.batch_size
    trainer = Trainer(cfg, batch_size=n * k * b, optimizer=False)
    log = None
    if is_ddp(cfg.variant):
        apply_data_parallel(trainer, "ddp", bucket_cap_mb=bucket_cap_mb(cfg),
                            gradient_as_bucket_view=False)
        log = attach_comm_log(trainer.net, cfg)
    pieces = pieces_per_rank(cfg)  # k micro-batches of b, or one piece
    if pieces > 1:
        apply_accumulation(trainer, [len(trainer.inputs) // pieces] * pieces)
    # `accumulate` all-reduces in every micro-batch's backward; no gradient norm (nothing
    # beyond DDP's communication)
    trainer.sync_each_micro_batch, trainer.measure_norm = cfg.variant == "accumulate", False
    trainer.build_optimizer()
    return trainer, log


def attach_comm_log(net: torch.nn.Module, cfg: Config) -> CommLog:
    """The variant's comm hook (PowerSGD with its state), counted (and faulted) by a CommLog."""
    log = CommLog(HOOKS[cfg.variant], WIRE_BYTES.get(cfg.variant, 4), corrupt_scale(cfg))
    state = None  # the default process group
    if cfg.variant == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=cfg.powersgd_rank,
                                            start_powerSGD_iter=POWERSGD_START_ITER)
    net.register_comm_hook(state, log.hook)
    return log


def train_step(trainer: Trainer, log: CommLog | None) -> float:
    if log:
        log.reset()
    return trainer.step()


def check(trainer: Trainer) -> dict:
    """`steps` steps; every step's global loss, and the first step's averaged gradients."""
    cfg = trainer.cfg
    for _ in range(POWERSGD_START_ITER if cfg.variant == "powersgd" else 0):
        trainer.accumulate()
        trainer.drop_grads()
    losses, grads = [], None
    for _ in range(cfg.steps):
        losses.append(global_mean(trainer.accumulate(), cfg))
        if grads is None:  # host copies, outside the memory meter (see training.py)
            grads = {n: p.grad.detach().cpu().numpy().copy()
                     for n, p in trainer.model.named_parameters()}
        trainer.update()
    return {"losses": losses, "grads": grads}


def side_by_side(trainer: Trainer, repeats: int) -> dict[str, float]:
    """The same step with the gradients synchronised and under no_sync, alternately, ranks lined
    up by a barrier before each: the difference is the communication the backward did not hide
    (the all-reduce, the bucket copies, waiting for the slowest rank)."""
    device, full, synced, local = trainer.cfg.device, [], [], []
    for _ in range(repeats):
        t0 = lined_up(device)
        trainer.accumulate(sync=True)
        t1 = clock(device)
        trainer.update()
        full.append(clock(device) - t0)
        synced.append(t1 - t0)
        t2 = lined_up(device)
        trainer.accumulate(sync=False)
        local.append(clock(device) - t2)
        trainer.drop_grads()  # no update: the ranks' weights stay equal
    return comm_times(synced, local, full)


def report(trainer: Trainer, log: CommLog | None) -> dict[str, float]:
    if log is None:  # `single`: no collective at all
        return {"comm_bytes": 0.0, "comm_ms": 0.0, "comm_fraction": 0.0}
    out = {"comm_bytes": float(log.bytes), "num_buckets": float(len(log.buckets))}
    return {**out, **side_by_side(trainer, trainer.cfg.timed_steps)}


def comm_times(synced: list[float], local: list[float], full: list[float]) -> dict[str, float]:
    """Seconds per repeat -> the side-by-side rows (ms): `comm_ms` = fwd_bwd_ms (synced) -
    fwd_bwd_no_sync_ms, `comm_fraction` = comm_ms / synced_step_ms (the synced forward, backward
    and update: each repeat's synced part is within it, so the fraction stays below 1)."""
    ms = {"fwd_bwd_ms": statistics.median(synced) * 1e3,
          "fwd_bwd_no_sync_ms": statistics.median(local) * 1e3,
          "synced_step_ms": statistics.median(full) * 1e3}
    comm = ms["fwd_bwd_ms"] - ms["fwd_bwd_no_sync_ms"]
    return {**ms, "comm_ms": comm, "comm_fraction": comm / ms["synced_step_ms"]}


def global_mean(local_loss: float, cfg: Config) -> float:
    """The global batch's mean loss: the mean of the ranks' means (equal slices)."""
    if not is_ddp(cfg.variant):
        return local_loss
    t = torch.tensor([local_loss], dtype=torch.float64, device=cfg.device)
    dist.all_reduce(t)
    return t.item() / world_size()


def build(cfg: Config) -> Workload:
    trainer, log = build_step(cfg)
    sequences = cfg.batch_size * cfg.micro_batches * (1 if is_ddp(cfg.variant) else world_size())
    return Workload(
        step=functools.partial(train_step, trainer, log), check=functools.partial(check, trainer),
        tokens_per_step=sequences * cfg.seq_len,
        tensors={"param_bytes": trainer.model.parameters, "optimizer_bytes": trainer.optimizer_tensors},
        report=functools.partial(report, trainer, log), notes=notes(cfg), count_flops=False,
        compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The first step's gradients and loss (same weights, same global batch) against one
    process's; the loss after `steps` steps is reported beside the reference's."""
    losses, ref_losses = outputs["losses"], reference["losses"]
    loss_rel = abs(losses[0] - ref_losses[0]) / abs(ref_losses[0])  # the first step's
    tol = TOLERANCE.get(cfg.variant, FP32_TOLERANCE)
    checked = compare_grads(reference, outputs, float("inf") if tol is None else tol,
                            extra={"loss_rel_diff": loss_rel},
                            reported={"loss": losses[-1], "loss_delta": losses[-1] - ref_losses[-1]})
    if tol is None:
        return Comparison(checked.metrics, True, f"{cfg.variant} is lossy: its gradient and loss "
                                                 "deltas are reported, not checked.")
    return checked


def grad_shapes(cfg: Config) -> list[torch.Size]:
    """Every parameter's shape, in registration order (a model on `meta`: nothing allocated)."""
    return [p.shape for p in build_model(cfg.model, device="meta").parameters()]


def predicted_comm_numel(cfg: Config, shapes: list[torch.Size]) -> int:
    """Gradient elements each rank hands to all-reduce per step. PowerSGD sends an (n, m) gradient
    as (n + m) r elements when that is under half of n m (torch's min_compression_rate 2), else
    as it is; before compressing, and for every other hook, the whole gradient goes."""
    total = sum(s.numel() for s in shapes)
    if cfg.variant == REFERENCE:
        return 0
    if cfg.variant == "accumulate":
        return cfg.micro_batches * total  # every micro-batch's backward syncs
    if cfg.variant != "powersgd":
        return total
    out = 0
    for s in shapes:
        n, m = s[0], s.numel() // s[0]
        r = min(n, m, cfg.powersgd_rank)
        out += (n + m) * r if 2 * (n + m) * r < n * m else n * m
    return out


def predicted_buckets(cfg: Config, shapes: list[torch.Size]) -> int:
    """DDP's buckets after its first iteration rebuilds them: gradients in the order they become
    ready (about the reverse of registration), a bucket closed once it reaches bucket_cap_mb."""
    cap, buckets, size = bucket_cap_mb(cfg) * 2**20, 0, 0
    for s in reversed(shapes):
        size += s.numel() * 4
        if size >= cap:
            buckets, size = buckets + 1, 0
    return buckets + (size > 0)


def piece_size(cfg: Config) -> int:
    """Sequences in one forward: all n*k*b for `single`, k*b per rank, b when accumulating."""
    n, k, b = cfg.nproc or 2, cfg.micro_batches, cfg.batch_size
    return n * k * b if cfg.variant == REFERENCE else k * b // pieces_per_rank(cfg)


def expected(cfg: Config) -> dict[str, float]:
    shapes, n = grad_shapes(cfg), cfg.nproc or 2
    pieces = 1 if cfg.variant == REFERENCE else pieces_per_rank(cfg)
    plan = planner.training_memory(cfg.model, batch_size=piece_size(cfg), seq_len=cfg.seq_len,
                                   precision="fp32", optimizer="adamw", device=cfg.device,
                                   accumulation_steps=pieces)
    comm_bytes = predicted_comm_numel(cfg, shapes) * WIRE_BYTES.get(cfg.variant, 4)
    buckets = sum(s.numel() for s in shapes) * 4 if is_ddp(cfg.variant) else 0  # fp32, flat
    out = {"peak_mem_bytes": plan.total_bytes + buckets, "param_bytes": plan.param_bytes,
           "optimizer_bytes": plan.optimizer_bytes, "comm_bytes": float(comm_bytes)}
    if is_ddp(cfg.variant):
        out["num_buckets"] = float(predicted_buckets(cfg, shapes))
    out.update(predicted_times(cfg, pieces, comm_bytes * 2 * (n - 1) / n))
    return out


def predicted_times(cfg: Config, pieces: int, ring_bytes: float) -> dict[str, float]:
    """The step at the device's peak FLOP/s plus the ring all-reduce at the link's bandwidth,
    not overlapped (so comm_fraction is an upper bound; DDP hides part of it in the backward)."""
    flops = pieces * planner.train_step_flops(cfg.model, batch=piece_size(cfg), seq_len=cfg.seq_len,
                                              attention=cfg.attention)
    peak = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads).get(cfg.dtype)
    gbps, _ = link_gbps(cfg)
    if not peak or not gbps:
        return {}
    compute_ms, comm_ms = flops / (peak * 1e12) * 1e3, ring_bytes / (gbps * 1e9) * 1e3
    return {"step_ms": compute_ms + comm_ms, "comm_ms": comm_ms,
            "comm_fraction": comm_ms / (compute_ms + comm_ms)}


def notes(cfg: Config) -> dict[str, str]:
    n, k, b = cfg.nproc or 2, cfg.micro_batches, cfg.batch_size
    out = {
        "comm_bytes": (f"measured: the bytes each bucket hands to the all-reduce in one step on "
                       f"this rank (the hook's input, {WIRE_BYTES.get(cfg.variant, 4)} bytes an "
                       "element; PowerSGD's own count of P, Q and uncompressed elements). A ring "
                       f"all-reduce moves 2(n-1)/n = {2 * (n - 1) / n:.2f} x that through each "
                       "rank's link."),
        "comm_fraction": ("measured: comm_ms / synced_step_ms, where comm_ms = fwd_bwd_ms "
                          "(gradients synced) - fwd_bwd_no_sync_ms, medians of the two run "
                          "alternately after timing: the communication the backward did not "
                          "hide, waiting for the slowest rank included. Predicted: no overlap "
                          "at the peak FLOP/s and link bandwidth."),
        "peak_mem_bytes": (f"predicted: the planner's step at {piece_size(cfg)} sequences per "
                           "forward, plus for DDP its buckets (one more fp32 gradient copy per "
                           "rank), added here; PowerSGD's error feedback keeps one more, not added."),
        "tokens_per_s": (f"this rank's tokens: {n * k * b} sequences for single (each rank does "
                         f"all), {k * b} for the DDP variants (n x that together)."),
    }
    if bucket_cap_mb(cfg) != cfg.bucket_cap_mb:
        out["num_buckets"] = ("one bucket: PowerSGD's callback-issued all-reduces can fall out of "
                              "order across ranks on gloo with several buckets in flight.")
    if cfg.variant == "powersgd":
        out["grad_max_rel_diff"] = (f"the first compressed step (rank {cfg.powersgd_rank}, random "
                                    "warm-start Q) against the exact averaged gradient.")
    return out
