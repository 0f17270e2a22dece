"""Starting the ranks of a multi-process run, and telling why one that crashed or hung ended.

- Under torchrun (RANK, WORLD_SIZE and MASTER_ADDR are set) this process is one rank: the same
  command runs on one machine, on several (`--nnodes ... --rdzv-endpoint ...`) or under Slurm.
- Otherwise `spawn` starts `nproc` ranks on this machine with `torch.multiprocessing`, forked
  from a server that imported torch and labkit once (forkserver):
  one rank per visible GPU with NCCL, or CPU ranks with gloo, one thread each. Nothing they open
  listens beyond the machine: they rendezvous through a file store in a private temporary folder
  (a TCPStore would listen on every interface), and gloo's and NCCL's sockets bind to the loopback
  interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) unless the user chose one. Under torchrun the
  user's rendezvous and interface settings stand.

Every rank writes its rows to its own part file after every variant (`<run_id>.rank<r>.json`), so
a rank that dies takes nothing measured with it; at the end rank 0 gathers all rows into one
record (`labkit.harness.launch`). `init_process_group` always has a timeout, and a gloo
`monitored_barrier` before every variant names a rank that did not arrive;
`destroy_process_group` runs on every exit path.
"""
from __future__ import annotations

import dataclasses
import datetime as dt
import os
import re
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from labkit.blocks.distributed import FAULTS, DistConfig, default_nproc, is_distributed, rank, world_size
from labkit.config import ConfigError

GRACE_S = 3.0  # after one rank fails, how long the others get to report their own error


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


STORE_VAR = "LABKIT_RENDEZVOUS_FILE"  # set only in the ranks `spawn` starts


SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


IFF_LOOPBACK = 0x8  # <linux/if.h>: the flag of the loopback interface in /sys/class/net/*/flags


class RunFailed(RuntimeError):
    """A multi-process run ended early; `result` holds every row measured before it did."""

    def __init__(self, message: str, result: Any):
        super().__init__(message)
        self.result = result


class RankAbort(RuntimeError):
    """A rank stops the run: its collectives may be out of step with the other ranks'. `rows`:
    the failing variant's error rows, stored before the rank exits."""

    def __init__(self, message: str, rows: list[dict[str, Any]]):
        super().__init__(message)
        self.rows = rows


def under_torchrun() -> bool:
    return all(v in os.environ for v in TORCHRUN_VARS) and not is_distributed()


def rank_device(device: str, local_rank: int) -> str:
    """Each GPU rank owns the GPU numbered by its local rank; CPU ranks share the CPU."""
    return f"cuda:{local_rank}" if device.startswith("cuda") else "cpu"


def init_rank(device: str, timeout_s: float) -> str:
    """Join the process group the environment describes (the file store `spawn` made, else
    torchrun's env://); returns this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    device = rank_device(device, local_rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    kw: dict[str, Any] = {"device_id": torch.device(device)} if backend == "nccl" else {}
    if os.environ.get(STORE_VAR):
        kw.update(init_method=Path(os.environ[STORE_VAR]).as_uri(),
                  rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, timeout=dt.timedelta(seconds=timeout_s), **kw)
    return device


def check_point(timeout_s: float, monitor: Any) -> None:
    """Every rank arrives here, or rank 0 raises an error naming the ranks that did not."""
    dist.monitored_barrier(group=monitor, timeout=dt.timedelta(seconds=timeout_s))


def maybe_inject_fault(cfg: DistConfig) -> None:
    """`crash`: the chosen rank is killed (as the OOM killer would); `hang`: it stops answering.
    (`corrupt_reduction` acts inside the experiment's reduction: see `corrupt_scale`.)"""
    if cfg.fault not in ("crash", "hang") or rank() != cfg.fault_rank:
        return
    if cfg.fault == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    while True:
        time.sleep(3600)


def check_nproc(device: str, nproc: int) -> None:
    """More GPU ranks than visible GPUs is refused before anything starts."""
    if not device.startswith("cuda"):
        return
    gpus = torch.cuda.device_count()
    if nproc > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
        raise ConfigError(f"nproc={nproc} asks for {nproc} GPU ranks but {gpus} GPU(s) are visible "
                          f"(CUDA_VISIBLE_DEVICES={visible}); use nproc <= {gpus}, or device=cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS): the one flagged
    IFF_LOOPBACK where /sys says, else the first named lo*."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    for name in names:
        try:
            if int(Path(f"/sys/class/net/{name}/flags").read_text(), 16) & IFF_LOOPBACK:
                return name
        except (OSError, ValueError):
            continue
    return next((name for name in names if name.startswith("lo")), "lo")


def local_env(nproc: int, store: str) -> dict[str, str]:
    """The environment of the ranks `spawn` starts: the file store to rendezvous through, and
    gloo's and NCCL's sockets on the loopback interface unless the user set one."""
    env = {"WORLD_SIZE": str(nproc), STORE_VAR: store}
    lo = loopback_interface()
    env.update({var: lo for var in SOCKET_IFNAME_VARS if not os.environ.get(var)})
    return env


# what the fork server imports once, for every rank it forks: torch and labkit, the
# torch.distributed APIs the parallel transforms use (FSDP2, DTensor, tensor parallelism), which
# labkit's process start leaves out (about 1 s a rank on the reference CPU), and TorchDynamo,
# which torch imports on the first call of any function it guards with `_disable_dynamo` (an
# optimizer's step among them): 0.7 s a rank, a quarter of a tiny run's rank
RANK_PRELOAD = ["labkit.harness.experiment", "labkit.blocks.transforms", "torch._dynamo",
                "labkit.harness.rank_server"]


def spawn(fn: Callable[..., None], args: tuple, nproc: int, *, poll: Callable[[], None] | None = None
          ) -> list["RankExit"]:
    """Start `nproc` ranks of `fn(rank, *args)` with torch.multiprocessing; wait for all of them.
    When one fails, the others get GRACE_S to report their own error, then are stopped; no
    process outlives this call. The ranks rendezvous through a file store in a private folder
    (mkdtemp: mode 0700), removed afterwards."""
    folder = tempfile.mkdtemp(prefix="labkit-rendezvous-")
    try:
        return _spawn(fn, args, nproc, local_env(nproc, os.path.join(folder, "store")), poll)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _spawn(fn: Callable[..., None], args: tuple, nproc: int, env: dict[str, str],
           poll: Callable[[], None] | None) -> list["RankExit"]:
    import multiprocessing

    import torch.multiprocessing as mp

    # Each rank is forked from a server that imported torch and labkit once (and never ran an
    # op or touched CUDA), instead of a fresh interpreter importing them again: a launch costs
    # about one import, not one per rank. The server's environment is the one it started with,
    # so each rank gets this process's environment now.
    multiprocessing.set_forkserver_preload(RANK_PRELOAD)
    ctx = mp.start_processes(_entry, args=(fn, {**os.environ, **env}, args), nprocs=nproc,
                             join=False, start_method="forkserver")
    procs = ctx.processes
    failed_at, stopped = None, set()
    try:
        while any(p.exitcode is None for p in procs):
            if poll:
                poll()
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                stopped = {r for r, p in enumerate(procs) if p.exitcode is None}
                break
            time.sleep(0.05)
    finally:
        _stop(procs)
    if poll:
        poll()
    return [RankExit(r, p.exitcode, r in stopped) for r, p in enumerate(procs)]


def _entry(local_rank: int, fn: Callable[..., None], env: dict[str, str], args: tuple) -> None:
    os.environ.clear()
    os.environ.update(env, RANK=str(local_rank), LOCAL_RANK=str(local_rank))
    fn(local_rank, *args)


def _stop(procs: list) -> None:
    """SIGTERM, then SIGKILL what is left after two seconds; reap everything."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 2.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


@dataclass(frozen=True)
class RankExit:
    rank: int
    exitcode: int | None
    stopped: bool  # still running when another rank failed: the launcher stopped it

    @property
    def ok(self) -> bool:
        return self.exitcode == 0


COMM_ERROR = re.compile(r"timed out|timeout|connection (closed|reset)|monitoredbarrier|"
                        r"broken pipe|peer|socket", re.I)


BARRIER_MISS = re.compile(r"[Rr]ank (\d+) failed to pass monitoredBarrier")


def root_cause(exits: list[RankExit], errors: dict[int, str], timeout_s: float) -> str:
    """One line naming the rank that caused the failure and why. A rank killed by a signal, or
    one failing with its own error, comes before the communication errors it causes in others;
    a rank that was still running when the others timed out waiting for it is the one that hung."""
    killed = [e for e in exits if e.exitcode is not None and e.exitcode < 0 and not e.stopped]
    if killed:
        e = killed[0]
        return f"rank {e.rank} was killed by {signal.Signals(-e.exitcode).name}"
    own = {r: m for r, m in errors.items() if not COMM_ERROR.search(m)}
    if own:
        r = min(own)
        return f"rank {r} failed: {own[r]}"
    for r, m in sorted(errors.items()):
        miss = BARRIER_MISS.search(m)
        if miss:
            return (f"rank {miss.group(1)} hung: it did not reach the barrier within "
                    f"{timeout_s:g} s (reported by rank {r})")
    hung = [e.rank for e in exits if e.stopped]
    if hung and errors:
        r = min(errors)
        return (f"rank {', '.join(map(str, hung))} hung: rank {r} timed out waiting for it "
                f"({errors[r]})")
    if errors:
        r = min(errors)
        return f"rank {r} failed: {errors[r]}"
    bad = [e for e in exits if not e.ok and not e.stopped]
    if not bad:
        return "unknown failure"
    return (f"rank {bad[0].rank} exited with code {bad[0].exitcode} before it reported anything "
            "(its stderr says why; a script that starts ranks must do it under "
            "`if __name__ == \"__main__\":`, which the spawn start method needs)")


def resolve_world(cfg: DistConfig, cpu_ranks: int = 2) -> DistConfig:
    """The config with `nproc` filled in: torchrun's world size, the user's, or the default (one
    rank per visible GPU, else the experiment's `cpu_ranks`)."""
    if under_torchrun() or is_distributed():
        world = int(os.environ["WORLD_SIZE"]) if not is_distributed() else world_size()
        if cfg.nproc not in (None, world):
            raise ConfigError(f"nproc={cfg.nproc} but torchrun started {world} ranks; "
                              "leave nproc unset under torchrun")
        return _check_fault(dataclasses.replace(cfg, nproc=world))
    nproc = cfg.nproc or default_nproc(cfg.device, cpu_ranks)
    check_nproc(cfg.device, nproc)
    return _check_fault(dataclasses.replace(cfg, nproc=nproc))


def _check_fault(cfg: DistConfig) -> DistConfig:
    if cfg.fault == "corrupt_reduction" and not cfg.reduction_fault:
        valid = ", ".join(f for f in FAULTS if f != "corrupt_reduction")
        raise ConfigError(f"fault=corrupt_reduction is not implemented by this experiment; "
                          f"valid here: {valid}")
    if cfg.fault != "none" and cfg.fault_rank >= cfg.nproc:
        raise ConfigError(f"fault_rank={cfg.fault_rank} but there are {cfg.nproc} ranks; "
                          f"valid: 0..{cfg.nproc - 1}")
    return cfg
