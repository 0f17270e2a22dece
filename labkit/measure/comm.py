"""Counting a block's collectives: how many of each and their bytes (`CommCounter`), seen where
they are dispatched: DTensor's functional collectives, the c10d ones that FSDP2 and DDP call, and
the all-to-all and point-to-point calls (send, recv) that ring attention, Ulysses and expert
parallelism make.
A dispatch mode and nothing more (CommDebugMode's module tracker fails inside FSDP2's and
checkpointing's hooks)."""
from __future__ import annotations

import collections

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
EXCHANGES = ("all_to_all", "send", "recv")  # counted, and reported, only where a block makes them


def collective(packet) -> str | None:
    """The op's name in COLLECTIVES or EXCHANGES for a functional or c10d communication op, else None."""
    namespace = getattr(packet, "_qualified_op_name", "").split("::")[0]
    if namespace not in ("_c10d_functional", "c10d_functional", "c10d"):
        return None
    name = (packet.__name__.replace("allreduce", "all_reduce").replace("allgather", "all_gather")
            .replace("alltoall", "all_to_all"))
    return next((c for c in COLLECTIVES + EXCHANGES if c in name), None)


def _bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_bytes(v) for v in value)
    return 0


class CommCounter(TorchDispatchMode):
    """Each collective's count and bytes: S as nccl-tests defines it (the all-reduce's buffer, the
    all-gather's output, the reduce-scatter's input, the all-to-all's input: the largest of the
    op's first two arguments and its output), and the bytes each rank moves on its busiest link with
    a ring (x 2(n-1)/n for all-reduce, (n-1)/n otherwise). A send counts its tensors' bytes, all on
    the link; a recv counts what it received (`bytes["recv"]`) and adds nothing to the link or to
    `comm_bytes`, which the sender counted."""

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
            self.bus_bytes += size * _link_share(name, n)
        return out

    def metrics(self) -> dict[str, float]:
        out = {f"{c}_count": float(self.counts[c]) for c in COLLECTIVES}
        out.update({f"{c}_count": float(self.counts[c]) for c in EXCHANGES if self.counts[c]})
        sent = sum(b for c, b in self.bytes.items() if c != "recv")
        return {**out, "comm_bytes": float(sent), "comm_bus_bytes": self.bus_bytes}


def _link_share(name: str, n: int) -> float:
    """The share of an op's S that one rank moves on its busiest link."""
    if name in ("send", "recv"):
        return 1.0 if name == "send" else 0.0
    return (2 if name == "all_reduce" else 1) * (n - 1) / n
