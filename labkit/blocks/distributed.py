"""The rank helpers the multi-process techniques use: `DistConfig` (the settings every one
shares), this rank and the world size, agreeing on a check's verdict, the default rank count, the
bandwidth of the link between ranks (`link_gbps`), and the gradient-reduction fault. Starting the
ranks and telling why a run ended is the harness's (`labkit.harness.ranks`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from labkit import hardware
from labkit.config import RunConfig, knob

FAULTS = ("none", "crash", "hang", "corrupt_reduction")


# corrupt_reduction: fault_rank's part of the gradient reduction counted twice (a missing average,
# a double-counted bucket); each experiment that implements it says where (reduction_fault below).
CORRUPT_SCALE = 2.0


@dataclass(kw_only=True)
class DistConfig(RunConfig):
    """Settings every multi-process experiment shares."""

    nproc: int | None = knob(None, min=1, help="ranks (default: one per visible GPU, else 2 CPU "
                                                   "ranks, 4 for hybrid)")
    timeout_s: float = knob(60.0, min=1.0, help="a collective or barrier waiting longer ends the run")
    timed_steps: int = knob(5, min=1, help="timed steps, the same count on every rank")
    fault: str = knob("none", choices=FAULTS,
                      help="inject a failure: crash (SIGKILL) or hang, to watch the run end "
                           "cleanly; corrupt_reduction (fault_rank's part of the gradient "
                           "reduction counted twice), to watch the check flag it")
    fault_rank: int = knob(1, min=0, help="the rank that fails when `fault` is set")
    reduction_fault: ClassVar[bool] = False  # True where the experiment implements corrupt_reduction


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def corrupt_scale(cfg: DistConfig) -> float | None:
    """The factor this rank multiplies its part of the gradient reduction by under
    fault=corrupt_reduction: CORRUPT_SCALE on fault_rank, None (untouched) elsewhere and otherwise.
    An experiment applies it to its variants, never to its reference, which the check holds them to."""
    if cfg.fault == "corrupt_reduction" and rank() == cfg.fault_rank:
        return CORRUPT_SCALE
    return None


def agree(ok: bool, message: str) -> tuple[bool, str]:
    """Whether every rank's check passed, and the first failing rank's reason: all ranks take the
    same branch afterwards, so none waits in a collective the others skip."""
    votes: list[Any] = [None] * world_size()
    dist.all_gather_object(votes, (ok, message))
    for r, (rank_ok, rank_message) in enumerate(votes):
        if not rank_ok:
            return False, rank_message if r == rank() else f"rank {r}: {rank_message}"
    return True, message


def default_nproc(device: str, cpu_ranks: int = 2) -> int:
    return torch.cuda.device_count() if device.startswith("cuda") else cpu_ranks


def link_gbps(cfg: DistConfig) -> tuple[float | None, str]:
    """The ceiling a collective's busbw is set against, and its source: the GPU's interconnect, or
    on CPU ranks the measured memory-copy bandwidth (gloo over loopback TCP copies every byte
    several times)."""
    if cfg.device.startswith("cuda"):
        spec = hardware.gpu_spec(torch.cuda.get_device_name(cfg.device)) or {}
        gbps = spec.get("interconnect_gbps")
        return gbps, f"{spec.get('interconnect', 'interconnect')} per GPU, one direction (datasheet)"
    return hardware.bandwidth_gbps("cpu"), "this CPU's measured copy bandwidth"


def release_buffers(buffers: tuple[torch.Tensor, ...], keep: tuple[torch.Tensor, ...] = ()) -> None:
    """Free the storage of each of `buffers` (a collective's send and receive buffers, which the
    call has finished with) that none of `keep` (its input and result) shares. gloo's worker
    thread drops its own references to them a moment after the call returns, and one still
    alive later counts in a memory meter: under load the suite measured Ulysses' saved bytes
    16,384 and 32,768 above the prediction (one and two all-to-all buffers), and, under a CPU
    quota, a load-balance rank 513 KiB over its planned peak (the summed gradients' flat buffer
    alive through AdamW's step). A buffer that is `keep`'s own storage stays (Ulysses' send
    buffer at batch 1, the query): the activation meter waits for gloo to let go of it
    (`labkit.measure.memory.let_go_of_collectives`)."""
    kept = {t.untyped_storage().data_ptr() for t in keep}
    for t in buffers:
        if t.untyped_storage().data_ptr() not in kept:
            t.untyped_storage().resize_(0)


def scaled_allreduce_hook(scale: float):
    """DDP's all-reduce (torch's Python twin of it) of this rank's bucket multiplied by `scale`."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(state, bucket):
        bucket.buffer().mul_(scale)
        return default_hooks.allreduce_hook(state, bucket)
    return hook


def corrupt_reduction(model: torch.nn.Module, scale: float) -> None:
    """This rank's part of the gradient reduction multiplied by `scale`: DDP's buckets before the
    all-reduce, or FSDP2's reduce-scatter output (this rank's shard of the averaged gradients)
    after it; a model with neither is left alone (zero, hybrid and recipe inject it so). (FSDP2
    is imported here, not with the module: 0.8 s of every process start on the reference CPU.)"""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        model.register_comm_hook(None, scaled_allreduce_hook(scale))
        return
    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        if not hasattr(unit, "set_all_reduce_hook"):
            raise RuntimeError("fault=corrupt_reduction needs FSDPModule.set_all_reduce_hook, "
                               f"which torch {torch.__version__} does not have")
        unit.set_all_reduce_hook(lambda shard: shard.mul_(scale))
