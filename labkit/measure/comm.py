"""Counting a block's collectives: how many of each and their bytes (`CommCounter`), seen where
they are dispatched: DTensor's functional collectives and the c10d ones that FSDP2 and DDP call.
A dispatch mode and nothing more (CommDebugMode's module tracker fails inside FSDP2's and
checkpointing's hooks)."""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def collective(packet) -> str | None:
    """all_reduce, all_gather or reduce_scatter for a functional or c10d collective op, else None."""
    namespace = getattr(packet, "_qualified_op_name", "").split("::")[0]
    if namespace not in ("_c10d_functional", "c10d_functional", "c10d"):
        return None
    name = packet.__name__.replace("allreduce", "all_reduce").replace("allgather", "all_gather")
    return next((c for c in COLLECTIVES if c in name), None)


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


class CommCounter(TorchDispatchMode):
    """Each collective's count and bytes: S as nccl-tests defines it (the all-reduce's buffer, the
    all-gather's output, the reduce-scatter's input: the largest of the op's first two arguments
    and its output), and the bytes each rank moves on its busiest link with a ring (x 2(n-1)/n
    for all-reduce, (n-1)/n otherwise)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.bus_bytes = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor first desugars into collectives on its local tensors
        out = func(*args, **(kwargs or {}))
        name = collective(getattr(func, "_overloadpacket", None))
        if name is not None:
            n = dist.get_world_size() if dist.is_initialized() else 1
            size = max(_bytes(args[0]) if args else 0, _bytes(args[1]) if len(args) > 1 else 0, _bytes(out))
            self.counts[name] += 1
            self.bytes[name] += size
            self.bus_bytes += size * (2 if name == "all_reduce" else 1) * (n - 1) / n
        return out

    def metrics(self) -> dict[str, float]:
        out = {f"{c}_count": float(self.counts[c]) for c in COLLECTIVES}
        return {**out, "comm_bytes": float(sum(self.bytes.values())), "comm_bus_bytes": self.bus_bytes}
