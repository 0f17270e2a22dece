"""Multi-process experiments on torch.distributed: start the ranks, run the harness in each, gather
every rank's rows into one run, and end a run whose rank crashed or hung with an error that names
the rank and the cause.

- Under torchrun (RANK, WORLD_SIZE and MASTER_ADDR are set) this process is one rank: the same
  command runs on one machine, on several (`--nnodes ... --rdzv-endpoint ...`) or under Slurm.
- Otherwise `spawn` starts `nproc` ranks on this machine with `torch.multiprocessing` (spawn):
  one rank per visible GPU with NCCL, or CPU ranks with gloo, one thread each. Nothing they open
  listens beyond the machine: they rendezvous through a file store in a private temporary folder
  (a TCPStore would listen on every interface), and gloo's and NCCL's sockets bind to the loopback
  interface (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) unless the user chose one. Under torchrun the
  user's rendezvous and interface settings stand.

Every rank writes its rows to its own part file after every variant (`<run_id>.rank<r>.json`), so
a rank that dies takes nothing measured with it; at the end rank 0 gathers all rows into one
record. `init_process_group` always has a timeout, and a gloo `monitored_barrier` before every
variant names a rank that did not arrive; `destroy_process_group` runs on every exit path.
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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch
import torch.distributed as dist

from labkit.config import ConfigError, RunConfig, knob

FAULTS = ("none", "crash", "hang", "corrupt_reduction")
# corrupt_reduction: fault_rank's part of the gradient reduction counted twice (a missing average,
# a double-counted bucket); each experiment that implements it says where (reduction_fault below).
CORRUPT_SCALE = 2.0
GRACE_S = 3.0  # after one rank fails, how long the others get to report their own error
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
STORE_VAR = "LABKIT_RENDEZVOUS_FILE"  # set only in the ranks `spawn` starts
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
IFF_LOOPBACK = 0x8  # <linux/if.h>: the flag of the loopback interface in /sys/class/net/*/flags


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


# --- inside a rank ----------------------------------------------------------------------------

def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


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


def corrupt_scale(cfg: DistConfig) -> float | None:
    """The factor this rank multiplies its part of the gradient reduction by under
    fault=corrupt_reduction: CORRUPT_SCALE on fault_rank, None (untouched) elsewhere and otherwise.
    An experiment applies it to its variants, never to its reference, which the check holds them to."""
    if cfg.fault == "corrupt_reduction" and rank() == cfg.fault_rank:
        return CORRUPT_SCALE
    return None


def clock(device: str) -> float:
    """Seconds, after the device has finished what was queued (CUDA runs asynchronously)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    return time.perf_counter()


def lined_up(device: str) -> float:
    """The ranks meet at a barrier; the clock right after it."""
    dist.barrier()
    return clock(device)


def fixed_repeats_timer(step: Callable[[], object], *, warmup: int, repeats: int,
                        device: str) -> tuple[float, ...]:
    """Seconds per step, the same number of steps on every rank (an adaptive count would let the
    ranks' collectives fall out of step); ranks line up at a barrier before each timed step."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = lined_up(device)
        step()
        times.append(clock(device) - start)
    return tuple(times)


def agree(ok: bool, message: str) -> tuple[bool, str]:
    """Whether every rank's check passed, and the first failing rank's reason: all ranks take the
    same branch afterwards, so none waits in a collective the others skip."""
    votes: list[Any] = [None] * world_size()
    dist.all_gather_object(votes, (ok, message))
    for r, (rank_ok, rank_message) in enumerate(votes):
        if not rank_ok:
            return False, rank_message if r == rank() else f"rank {r}: {rank_message}"
    return True, message


# --- the launcher -----------------------------------------------------------------------------

def default_nproc(device: str, cpu_ranks: int = 2) -> int:
    return torch.cuda.device_count() if device.startswith("cuda") else cpu_ranks


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
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_entry, args=(fn, env, args), nprocs=nproc, join=False,
                             start_method="spawn")
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


# --- one run across ranks ---------------------------------------------------------------------

def run(name: str, chosen: list[str], points: list, *, runs_dir: str | None = None,
        on_rows: Callable[[list[dict[str, Any]]], None] | None = None):
    """Run a multi-process experiment: in this process when torchrun started it, otherwise on
    `nproc` ranks started here. Returns the merged RunResult; raises RunFailed (holding every row
    measured) when a rank crashed or hung."""
    from labkit.results import new_run_id

    nproc = points[0][1].nproc  # filled in by resolve_world when the points were planned
    if any(cfg.nproc != nproc for _, cfg in points):
        raise ConfigError("nproc cannot be swept: the ranks start once per run; run once per world size")
    if under_torchrun():
        return run_rank(name, chosen, points, None, runs_dir)
    run_id = new_run_id(name)
    watcher = _PartWatcher(run_id, runs_dir, on_rows)
    exits = spawn(_rank_main, (name, chosen, points, run_id, runs_dir), nproc, poll=watcher)
    try:
        result = _collect(name, run_id, runs_dir, exits, points[0][1].timeout_s)
    except RunFailed as e:
        watcher.flush(e.result.rows)
        raise
    watcher.flush(result.rows)
    return result


def _rank_main(local_rank: int, name: str, chosen: list[str], points: list, run_id: str,
               runs_dir: str | None) -> None:
    import sys

    torch.set_num_threads(points[0][1].num_threads)
    try:
        run_rank(name, chosen, points, run_id, runs_dir)
    except Exception as e:  # recorded in this rank's part file; one line here, no traceback
        print(f"labkit rank {local_rank}: {_one_line(e)}", file=sys.stderr)
        sys.exit(1)
    leave()


def leave(code: int = 0) -> None:
    """End a rank whose results are stored and whose group is destroyed, without the
    interpreter's teardown, where a C++ thread left joinable by the communication library can
    abort the process ("terminate called without an active exception"; seen here about once in
    a hundred runs) and turn a complete run into a failed one."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:500]


def run_rank(name: str, chosen: list[str], points: list, run_id: str | None, runs_dir: str | None):
    """This rank's share of the run: join the group, measure every variant in step with the other
    ranks, store rows in this rank's part file, gather all rows to rank 0."""
    from labkit import hardware
    from labkit.experiment import RunResult, run_points
    from labkit.results import RunRecord, new_run_id
    from labkit.techniques import get_experiment

    cfg0 = points[0][1]
    device = init_rank(cfg0.device, cfg0.timeout_s)
    try:
        ids = [run_id or new_run_id(name)]
        dist.broadcast_object_list(ids, src=0)  # under torchrun rank 0 names the run
        points = [(p, dataclasses.replace(cfg, device=device)) for p, cfg in points]
        monitor = dist.new_group(backend="gloo") if device.startswith("cuda") else None
        record = RunRecord(name, hardware.fingerprint(), cfg0.params(), runs_dir, run_id=ids[0],
                           part=rank())
        first_point = [True]

        def before_variant(index: int, cfg: DistConfig) -> None:
            if index == 1 and first_point[0]:  # after the reference, so its rows are kept
                first_point[0] = False
                maybe_inject_fault(cfg)
            check_point(cfg.timeout_s, monitor)

        try:
            run_points(get_experiment(name), chosen, points, record, before_variant=before_variant)
        except BaseException as e:
            record.finish(f"error: {_one_line(e)}")
            raise
        record.finish("complete")
        merged = _gather(record)
        return RunResult(ids[0], str(merged.path if merged else record.path),
                         merged.full_rows() if merged else record.full_rows())
    finally:
        dist.destroy_process_group()


def _gather(record):
    """All ranks' rows into one record written by rank 0; each rank then drops its part file."""
    from labkit.results import RunRecord

    every: list[Any] = [None] * world_size()
    dist.all_gather_object(every, record.rows)
    merged = None
    if rank() == 0:
        merged = RunRecord(record.record["experiment"], record.record["env"],
                           record.record["config"], record.path.parent, run_id=record.run_id)
        merged.rows.extend(row for rows in every for row in rows)
        merged.finish("complete")
    dist.barrier()
    record.path.unlink(missing_ok=True)
    return merged


class _PartWatcher:
    """Reads the ranks' part files while they run, handing new rows to `on_rows` (live plots)."""

    def __init__(self, run_id: str, runs_dir: str | None, on_rows: Callable | None):
        self.run_id, self.runs_dir, self.on_rows = run_id, runs_dir, on_rows
        self.seen: dict[int, int] = {}
        self.last = 0.0

    def __call__(self) -> None:
        from labkit.results import expand_row, load_parts

        if self.on_rows is None or time.monotonic() - self.last < 0.5:
            return
        self.last = time.monotonic()
        for part in load_parts(self.run_id, self.runs_dir):
            self._emit(part["part"], [expand_row(r, part) for r in part["rows"]])

    def flush(self, rows: list[dict[str, Any]]) -> None:
        """The rows the polls missed (the ranks may finish, and drop their parts, between two)."""
        for r in sorted({row["rank"] for row in rows}) if self.on_rows else ():
            self._emit(r, [row for row in rows if row["rank"] == r])

    def _emit(self, rank: int, rows: list[dict[str, Any]]) -> None:
        new = rows[self.seen.get(rank, 0):]
        if new:
            self.seen[rank] = len(rows)
            self.on_rows(new)


def _collect(name: str, run_id: str, runs_dir: str | None, exits: list[RankExit], timeout_s: float):
    """The finished run: rank 0's merged record, or, when a rank failed, every part's rows merged
    under an error status that names the rank and the cause."""
    from labkit.experiment import RunResult
    from labkit.results import RunRecord, load_parts, runs_dir as folder

    path = folder(runs_dir) / f"{run_id}.json"
    parts = load_parts(run_id, runs_dir)
    if path.exists():  # rank 0 gathered every rank's rows: the run is complete
        for p in parts:  # a rank that stopped between the gather and dropping its part
            p["path"].unlink(missing_ok=True)
        record = RunRecord.load(path)
        late = [e for e in exits if not e.ok]
        if late:  # a rank that failed on its way out, after everything was stored
            warnings.warn(f"rank {late[0].rank} exited with code {late[0].exitcode} after the "
                          "run completed; every row is stored", stacklevel=3)
        return RunResult(run_id, str(path), record.full_rows())
    errors = {p["part"]: p["status"].removeprefix("error: ") for p in parts
              if str(p["status"]).startswith("error")}
    cause = root_cause(exits, errors, timeout_s)
    first = parts[0] if parts else {"env": {}, "config": {}}
    record = RunRecord(name, first["env"], first["config"], runs_dir, run_id=run_id)
    record.rows.extend(row for p in parts for row in p["rows"])
    record.finish(f"error: {cause}")
    for p in parts:
        p["path"].unlink(missing_ok=True)
    result = RunResult(run_id, str(record.path), record.full_rows())
    raise RunFailed(f"the run ended early: {cause}. {len(result.rows)} rows measured before "
                    f"that are stored in {record.path}", result)
