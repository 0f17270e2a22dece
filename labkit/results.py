"""The results store: one JSON file per run under `runs/` (or `--runs-dir`, or `LABKIT_RUNS_DIR`),
rewritten atomically after every sweep point, so a crash keeps what was measured and many
processes can write at once (each run has its own file; a reader never sees half a file)."""
from __future__ import annotations

import datetime as dt
import json
import os
import secrets
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROW_FIELDS = ("run_id", "timestamp", "experiment", "variant", "params", "metric", "value", "unit",
              "predicted", "status", "message", "rank", "env")
STATUSES = ("ok", "oom", "error", "skipped")


def runs_dir(path: str | os.PathLike | None = None) -> Path:
    """The store's folder: `path`, else `$LABKIT_RUNS_DIR`, else `./runs`."""
    return Path(path or os.environ.get("LABKIT_RUNS_DIR") or "runs")


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def new_run_id(experiment: str) -> str:
    """Unique across processes and machines: time, experiment, pid and random bits."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{experiment}-{os.getpid()}-{secrets.token_hex(3)}"


UNIT_SUFFIXES = (("_steps", "steps"), ("_ms", "ms"), ("_bytes_per_token", "bytes/token"), ("_bytes", "bytes"), ("_fraction", "fraction"), ("_pct", "%"),
                 ("tflops", "TFLOP/s"), ("gbps", "GB/s"), ("flops", "FLOP"), ("_s", "s"))


def unit_of(metric: str) -> str:
    """The unit carried by a metric's name (one vocabulary everywhere): `tokens_per_s` ->
    tokens/s, `peak_mem_bytes` -> bytes; dimensionless metrics (`loss`) have none."""
    if metric.endswith("_per_s"):
        return metric.removesuffix("_per_s").rsplit("_", 1)[-1] + "/s"
    return next((unit for suffix, unit in UNIT_SUFFIXES if metric.endswith(suffix)), "")


def write_json_atomic(path: Path, record: dict[str, Any]) -> None:
    """Write to a temporary file in the same folder, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RunRecord:
    """One run of one experiment; `add()` appends rows and saves the whole record at once."""

    def __init__(self, experiment: str, env: dict[str, Any], config: dict[str, Any],
                 directory: str | os.PathLike | None = None, run_id: str | None = None,
                 part: int | None = None):
        """`part`: one rank's share of a multi-process run, in its own file until merged."""
        self.run_id = run_id or new_run_id(experiment)
        name = self.run_id if part is None else f"{self.run_id}.rank{part}"
        self.path = runs_dir(directory) / f"{name}.json"
        self.record = {"run_id": self.run_id, "experiment": experiment, "timestamp": now(),
                       "status": "running", "env": env, "config": config, "rows": []}
        if part is not None:
            self.record["part"] = part

    @classmethod
    def load(cls, path: Path) -> "RunRecord":
        with open(path) as f:
            data = json.load(f)
        record = cls(data["experiment"], data["env"], data["config"], path.parent,
                     run_id=data["run_id"], part=data.get("part"))
        record.record = data
        return record

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.record["rows"]

    def add(self, rows: list[dict[str, Any]]) -> None:
        self.rows.extend(rows)
        write_json_atomic(self.path, self.record)

    def finish(self, status: str = "complete") -> None:
        self.record["status"] = status
        write_json_atomic(self.path, self.record)

    def full_rows(self) -> list[dict[str, Any]]:
        """Rows with every field of the schema, the run's env included."""
        return [expand_row(r, self.record) for r in self.rows]


def expand_row(row: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    base = {"run_id": record["run_id"], "timestamp": record["timestamp"],
            "experiment": record["experiment"], "env": record.get("env", {})}
    return {k: {**base, **row}.get(k) for k in ROW_FIELDS}


def _read_records(folder: Path, pattern: str) -> list[dict[str, Any]]:
    records = []
    for path in sorted(folder.glob(pattern)) if folder.is_dir() else []:
        try:
            with open(path) as f:
                record = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            warnings.warn(f"skipping {path}: not a labkit run ({e})", stacklevel=3)
            continue
        if not isinstance(record, dict) or not {"run_id", "timestamp", "experiment", "rows"} <= set(record):
            warnings.warn(f"skipping {path}: not a labkit run record", stacklevel=3)
            continue
        records.append({**record, "path": path})
    return records


def load_parts(run_id: str, directory: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The per-rank part files of a multi-process run still in progress (or cut short)."""
    parts = _read_records(runs_dir(directory), f"{run_id}.rank*.json")
    return sorted((p for p in parts if "part" in p), key=lambda p: p["part"])


def merge_parts(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One record from the part files of a run whose ranks never merged them (a torchrun job that
    was stopped): every rank's rows; the first error, else the least finished status."""
    statuses = [p["status"] for p in parts]
    status = next((s for s in statuses if str(s).startswith("error")),
                  "complete" if all(s == "complete" for s in statuses) else "incomplete")
    first = {k: v for k, v in parts[0].items() if k not in ("part", "path")}
    return {**first, "status": status, "rows": [r for p in parts for r in p["rows"]]}


def load_runs(directory: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """Every stored run record, oldest first (temporary files are skipped; the part files of a
    multi-process run that was never merged are read as one run)."""
    records, parts = {}, {}
    for record in _read_records(runs_dir(directory), "*.json"):
        record.pop("path")
        if "part" in record:
            parts.setdefault(record["run_id"], []).append(record)
        else:
            records[record["run_id"]] = record
    for run_id, group in parts.items():
        if run_id not in records:
            records[run_id] = merge_parts(sorted(group, key=lambda p: p["part"]))
    return sorted(records.values(), key=lambda r: (r["timestamp"], r["run_id"]))


def load_results(directory: str | os.PathLike | None = None, *, experiment: str | None = None,
                 run_id: str | None = None, expand_params: bool = False):
    """All stored rows as a tidy pandas DataFrame (one measurement per row, columns ROW_FIELDS).
    `expand_params` adds one column per config field (`batch_size`, `seq_len`, ...)."""
    import pandas as pd

    rows = [expand_row(row, rec) for rec in load_runs(directory)
            if experiment in (None, rec["experiment"]) and run_id in (None, rec["run_id"])
            for row in rec["rows"]]
    frame = pd.DataFrame(rows, columns=list(ROW_FIELDS))
    if expand_params and not frame.empty:
        flat = pd.json_normalize(frame["params"].tolist(), sep=".").set_index(frame.index)
        frame = frame.join(flat[[c for c in flat.columns if c not in frame.columns]])
    return frame


def format_value(metric: str | None, value: Any) -> str:
    if value is None or value != value:  # None or NaN
        return ""
    if metric and metric.endswith("_bytes"):
        return f"{value / 2**20:,.2f} MiB"
    if metric and metric.endswith("_bytes_per_token"):
        return f"{value:,.0f} B"
    if metric == "flops":
        return f"{value / 1e9:,.3f} GFLOP"
    return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A plain text table: variant, (rank, in multi-process runs), metric, measured, predicted,
    status, note."""
    ranks = any(r.get("rank") not in (None, 0) for r in rows)
    rank_head = f"{'rank':>4} " if ranks else ""
    lines = [f"{'variant':<14} {rank_head}{'metric':<26} {'measured':>16} {'predicted':>16}  {'status':<8} note"]
    for r in rows:
        metric = r["metric"] if isinstance(r["metric"], str) else None  # NaN from a DataFrame
        unit = "" if (metric or "").endswith(("_bytes", "flops", "_per_token")) else r["unit"]
        measured = format_value(metric, r["value"])
        rank = f"{r.get('rank', 0):>4} " if ranks else ""
        lines.append(f"{r['variant']:<14} {rank}{metric or '-':<26} {measured + ' ' + unit:>16} "
                     f"{format_value(metric, r['predicted']):>16}  {r['status']:<8} "
                     f"{r['message'] if isinstance(r['message'], str) else ''}")
    return "\n".join(lines)
