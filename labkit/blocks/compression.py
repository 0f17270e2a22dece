"""Compressed gradient reductions for data parallelism: DDP communication hooks that send each
bucket in fewer bytes, and the FSDP2 policy that reduce-scatters in bf16.

- `register_compression(ddp, fmt)`: `fp32` leaves DDP's own all-reduce; `bf16`, `fp16` register
  torch's compress hooks (cast, all-reduce in 16 bits, divide, cast back), `powersgd` torch's
  PowerSGD hook, `int8` `int8_hook`; each wrapped by `Compression`, which records what each
  bucket held and, under a fault, scales this rank's bucket first.
- `int8_hook`: symmetric absmax int8 with one scale per bucket, agreed by an all-reduce(max) so
  every rank quantizes on the same grid, at floor(127 / N) levels so that the int8 all-reduce of
  N ranks cannot overflow; the sum is dequantized and divided by N. Each rank's rounding is at
  most half a step, so the mean's error is at most s/2 an element: `Int8State.bound_sq` adds up
  n_b (s_b / 2)^2 over the buckets, the square of the bound on ||error||.
- `reduce_policy(dtype)`: FSDP2's MixedPrecisionPolicy with fp32 parameters and `dtype` reduction.
- `SentCounter`: a CommCounter that also sees the PowerSGD all-reduces issued from future
  callbacks (on gloo's thread, outside any dispatch mode): `add_unseen`.
- The checks: `replica_spread` (0 when every rank holds the same gradient) and
  `projection_residual` (0 when the gradient sent is a projection of the exact one).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.fsdp import MixedPrecisionPolicy

from labkit.measure.comm import CommCounter, collective
from labkit.planner.compression import bus_bytes, int8_levels

FORMATS = ("fp32", "bf16", "fp16", "int8", "powersgd")
INT8_FAULTS = ("none", "no_average", "own_scale")
# PowerSGD with error feedback or warm start needs >= 2 plain iterations (DDP rebuilds its
# buckets after the first); torch refuses less.
POWERSGD_START_ITER = 2


@dataclass
class Int8State:
    """The int8 hook's group and fault, and what it saw since `reset`: each bucket's scale and
    the square of the bound on the mean's error."""

    process_group: dist.ProcessGroup | None = None
    fault: str = "none"
    scales: dict[int, float] = field(default_factory=dict)
    bound_sq: float = 0.0

    def reset(self) -> None:
        self.scales, self.bound_sq = {}, 0.0


def quantize(grad: torch.Tensor, absmax: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): grad (numel,) fp32 on a grid of step scale = absmax / levels, |q| <= levels."""
    scale = absmax.clamp_min(torch.finfo(torch.float32).tiny) / levels  # (1,): all zeros stay 0
    return torch.round(grad / scale).clamp_(-levels, levels).to(torch.int8), scale


def int8_hook(state: Int8State, bucket):
    """Average the bucket over the ranks in int8 (see the module docstring). Faults, for the
    check to catch: `no_average` (the sum, not the mean), `own_scale` (each rank quantizes and
    dequantizes with its own absmax, unagreed)."""
    group = state.process_group or dist.group.WORLD
    world, grad = group.size(), bucket.buffer()  # (numel,) fp32: this rank's gradient
    absmax = grad.abs().max().reshape(1)
    if state.fault != "own_scale":  # one fp32 per bucket: every rank on the same grid
        dist.all_reduce(absmax, op=dist.ReduceOp.MAX, group=group)
    q, scale = quantize(grad, absmax, int8_levels(world))
    state.scales[bucket.index()] = scale.item()
    state.bound_sq += grad.numel() * (scale.item() / 2) ** 2
    divisor = 1 if state.fault == "no_average" else world

    def dequantize(fut):  # no collective here: it runs on the backend's thread
        return grad.copy_(fut.value()[0].to(grad.dtype).mul_(scale / divisor))

    return dist.all_reduce(q, group=group, async_op=True).get_future().then(dequantize)


# fp32: torch's Python twin of DDP's own all-reduce (registered only to inject a fault)
HOOKS = {"fp32": default_hooks.allreduce_hook, "bf16": default_hooks.bf16_compress_hook,
         "fp16": default_hooks.fp16_compress_hook, "int8": int8_hook,
         "powersgd": powerSGD_hook.powerSGD_hook}


class Compression:
    """A format's hook on a DDP model, wrapped: `buckets` maps each bucket's index to its
    elements (since `reset`); `scale` (fault=corrupt_reduction) multiplies this rank's bucket
    first. The wrapper also keeps DDP from refusing torch's bf16 hook by name on CPU ranks (it
    asks for NCCL >= 2.10; gloo all-reduces bf16)."""

    def __init__(self, fmt: str, state, scale: float | None = None):
        self.fmt, self.state, self.scale = fmt, state, scale
        self.inner = HOOKS[fmt]
        self.buckets: dict[int, int] = {}

    def reset(self) -> None:
        self.buckets = {}
        if isinstance(self.state, Int8State):
            self.state.reset()

    # No annotations: DDP checks a hook's against dist.GradBucket and Future[Tensor] as objects,
    # which `from __future__ import annotations` would turn into strings.
    def hook(self, state, bucket):
        buffer = bucket.buffer()
        self.buckets[bucket.index()] = buffer.numel()
        if self.scale is not None:
            buffer.mul_(self.scale)
        return self.inner(state, bucket)


def register_compression(ddp, fmt: str, *, powersgd_rank: int = 1, int8_fault: str = "none",
                         scale: float | None = None) -> Compression | None:
    """`fmt`'s hook on `ddp` (a DistributedDataParallel), wrapped; None for `fp32` with no
    `scale` (DDP's own all-reduce)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown gradient format {fmt!r}; valid: {', '.join(FORMATS)}")
    if fmt == "fp32" and scale is None:
        return None
    state = None  # torch's fp32 and 16-bit hooks: the default process group
    if fmt == "int8":
        state = Int8State(fault=int8_fault)
    elif fmt == "powersgd":
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=powersgd_rank,
                                            start_powerSGD_iter=POWERSGD_START_ITER)
    wrapped = Compression(fmt, state, scale)
    ddp.register_comm_hook(state, wrapped.hook)
    return wrapped


def reduce_policy(reduce_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2 computing in fp32 (param_dtype None: the parameters' own) and reducing gradients in
    `reduce_dtype`: the reduce-scatter's input cast to it, its output cast back to fp32."""
    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)


class SentCounter(CommCounter):
    """CommCounter that remembers the storage of every tensor it saw sent, so the collectives it
    could not see (issued from a future's callback, on the backend's thread, outside this thread's
    dispatch mode: PowerSGD's P and Q all-reduces) are added once, by `add_unseen`."""

    def __init__(self):
        super().__init__()
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if args and collective(getattr(func, "_overloadpacket", None)):
            first = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
            self.seen.update(t.untyped_storage().data_ptr() for t in first
                             if isinstance(t, torch.Tensor))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def add_unseen(self, name: str, tensors: list[torch.Tensor]) -> None:
        """Count `tensors`, each sent by one `name` collective, unless this counter saw it."""
        n = dist.get_world_size()
        for t in tensors:
            if t.untyped_storage().data_ptr() not in self.seen:
                size = t.numel() * t.element_size()
                self.counts[name] += 1
                self.bytes[name] += size
                self.bus_bytes += bus_bytes(size, n, name)


def powersgd_sent(state) -> list[torch.Tensor]:
    """The P and Q buffers PowerSGD all-reduced for each bucket (one flat tensor each)."""
    return [*state.p_memory_dict.values(), *state.q_memory_dict.values()]


def replica_spread(model: torch.nn.Module) -> float:
    """0 when every rank holds the same averaged gradient (a collective): per tensor its sum, sum
    of squares and an index-weighted sum (float64), their largest max - min over the ranks,
    relative to the largest."""
    sums = []
    for p in model.parameters():
        g = p.grad.double().flatten()
        index = torch.arange(1, g.numel() + 1, dtype=g.dtype, device=g.device)
        sums += [g.sum(), g.square().sum(), (g * index).sum()]
    hi, lo = torch.stack(sums), torch.stack(sums)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return float((hi - lo).abs().max() / hi.abs().max().clamp_min(1e-30))


def projection_residual(exact: dict, sent: dict) -> float:
    """| ||h||^2 + ||g - h||^2 - ||g||^2 | / ||g||^2 summed over the tensors (g `exact`, h `sent`,
    name -> numpy array): 0 when h is an orthogonal projection of g (PowerSGD's P P^T g, and the
    tensors it sends as they are)."""
    def sq(a) -> float:
        return float((a.astype("float64") ** 2).sum())

    total = sum(sq(g) for g in exact.values())
    return abs(sum(sq(sent[k]) + sq(g - sent[k]) for k, g in exact.items()) - total) / total


# --- in a recipe (`labkit.blocks.recipe.compose`) ----------------------------------------------------

RECIPE_FORMATS = ("none", "bf16", "fp16", "int8", "powersgd")
# Relative loss and weight difference from the uncompressed recipe after its steps that still
# counts as a match (the recipe experiment's check). 16 bits: each gradient within (N+1) u of the
# exact one, the tolerance bf16 and fp16 autocast get (transforms.PRECISION_TOLERANCE). int8 and
# PowerSGD move a gradient by up to its bucket's half step and up to its own norm
# (`techniques.grad_compression.grad_tolerance`), and AdamW's first updates, lr x sign(g), differ
# wherever a small gradient became 0 or was projected away. Measured (tiny, 2 blocks, 2 gloo
# ranks, 2 steps; weights, loss): bf16 8.4e-4, 2.9e-5; fp16 3.3e-4, 9.5e-7; int8 0.040, 0.011.
# PowerSGD's first POWERSGD_START_ITER steps are plain all-reduces: 2 steps show nothing (6.8e-7);
# 0.5 is a lossy low-rank gradient's allowance after them, not measured.
RECIPE_TOLERANCE = {"none": 0.0, "bf16": 0.05, "fp16": 0.02, "int8": 0.25, "powersgd": 0.5}


def recipe_clash(fmt: str, mode: str) -> str | None:
    """Why a recipe's `grad_compression` cannot run under data-parallel `mode`, or None."""
    if fmt == "none":
        return None
    if mode == "none":
        return (f"grad_compression={fmt} compresses the gradients' reduction across data-parallel "
                "replicas; this layout has one: run on 2 or more")
    if mode in ("zero2", "zero3") and fmt != "bf16":
        return (f"grad_compression={fmt} is a DDP communication hook; under FSDP2 (zero_stage 2, 3) "
                "only the reduce dtype changes: grad_compression=bf16")
    return None


def bucket_cap_mb(fmt: str, device: str) -> float | None:
    """DDP's bucket size for `fmt`: one bucket for PowerSGD on CPU ranks (its callback-issued
    all-reduces can fall out of order across ranks on gloo with several buckets in flight,
    https://github.com/pytorch/pytorch/issues/58467); None (DDP's own) otherwise."""
    return 2.0**20 if fmt == "powersgd" and not device.startswith("cuda") else None


def apply_grad_compression(trainer, fmt: str, *, powersgd_rank: int = 1):
    """`fmt`'s hook on the step's DDP model (`trainer.net`); `none` leaves DDP's own all-reduce.
    Returns the trainer."""
    if fmt != "none":
        register_compression(trainer.net, fmt, powersgd_rank=powersgd_rank)
    return trainer


def with_reduce_dtype(policy: MixedPrecisionPolicy | None, fmt: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy with the gradients reduced in bf16 when `fmt` is bf16 (the parameters'
    dtype kept: the policy's, or fp32 without one)."""
    if fmt != "bf16":
        return policy
    return MixedPrecisionPolicy(param_dtype=policy.param_dtype if policy else None,
                                reduce_dtype=torch.bfloat16)
