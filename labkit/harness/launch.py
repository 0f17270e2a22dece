"""The launcher above the harness: a multi-process run in this process when torchrun started it,
otherwise on `nproc` ranks started here (`labkit.harness.ranks.spawn`); each rank runs the harness's
point loop, which the harness hands down (this module never imports it), writes its rows to its
own part file after every variant, and rank 0 gathers every rank's rows into one record. A run
whose rank crashed or hung ends with every row measured stored, under an error that names the rank
and the cause (`ranks.root_cause`)."""
from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist

from labkit import hardware
from labkit.config import ConfigError
from labkit.blocks.distributed import DistConfig, rank, world_size
from labkit.harness.ranks import (RankExit, RunFailed, check_point, init_rank, maybe_inject_fault,
                                  root_cause, spawn, under_torchrun)
from labkit.results import RunRecord, RunResult, expand_row, load_parts, new_run_id, runs_dir as folder
from labkit.techniques import record as experiment_record


def run(name: str, chosen: list[str], points: list, run_points: Callable, *,
        runs_dir: str | None = None, on_rows: Callable[[list[dict[str, Any]]], None] | None = None):
    """Run a multi-process experiment: in this process when torchrun started it, otherwise on
    `nproc` ranks started here, each running `run_points` (the harness's point loop, handed down
    so that this module never imports the harness). Returns the merged RunResult; raises RunFailed
    (holding every row measured) when a rank crashed or hung."""
    nproc = points[0][1].nproc  # filled in by resolve_world when the points were planned
    if any(cfg.nproc != nproc for _, cfg in points):
        raise ConfigError("nproc cannot be swept: the ranks start once per run; run once per world size")
    if under_torchrun():
        return run_rank(name, chosen, points, None, runs_dir, run_points)
    run_id = new_run_id(name)
    watcher = _PartWatcher(run_id, runs_dir, on_rows)
    exits = spawn(_rank_main, (name, chosen, points, run_id, runs_dir, run_points), nproc, poll=watcher)
    try:
        result = _collect(name, run_id, runs_dir, exits, points[0][1].timeout_s)
    except RunFailed as e:
        watcher.flush(e.result.rows)
        raise
    watcher.flush(result.rows)
    return result


def _rank_main(local_rank: int, name: str, chosen: list[str], points: list, run_id: str,
               runs_dir: str | None, run_points: Callable) -> None:
    import sys

    torch.set_num_threads(points[0][1].num_threads)
    try:
        run_rank(name, chosen, points, run_id, runs_dir, run_points)
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


def run_rank(name: str, chosen: list[str], points: list, run_id: str | None, runs_dir: str | None,
             run_points: Callable):
    """This rank's share of the run: join the group, measure every variant in step with the other
    ranks (`run_points`), store rows in this rank's part file, gather all rows to rank 0."""

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
            run_points(experiment_record(name), chosen, points, record, before_variant=before_variant)
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
