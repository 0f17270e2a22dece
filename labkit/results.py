"""The results store: one JSON file per run under `runs/` (or `--runs-dir`, or `LABKIT_RUNS_DIR`),
rewritten atomically after every sweep point, so a crash keeps what was measured and many
processes can write at once (each run has its own file; a reader never sees half a file).

A workshop shares one folder (a shared disk: NFS, SMB, a hub's shared volume) between many
participants' processes and machines. Nothing is appended to a common file, so no lock is needed:
each run's file name is its run id, which holds the host name and the process id (unique at one
moment on one host) plus random bits, and each save is a write to a temporary file in the same
folder, then a rename (atomic on a POSIX file system, NFS included). Machines that share nothing
exchange results as a bundle (`export_bundle` / `import_bundle`): a zip of run files plus a
manifest with each file's SHA-256, checked before anything is written."""
from __future__ import annotations

import datetime as dt
import hashlib
import itertools
import json
import math
import numbers
import os
import re
import secrets
import socket
import tempfile
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROW_FIELDS = ("run_id", "timestamp", "experiment", "variant", "params", "metric", "value", "unit",
              "predicted", "status", "message", "rank", "env")
STATUSES = ("ok", "oom", "error", "skipped")
# Variants renamed since runs were stored: (experiment, old name) -> the name now, read so. ZeRO's
# stage 0 is plain DDP, named as in every data-parallel layout
RENAMED = {("zero", "zero0"): "ddp"}


def runs_dir(path: str | os.PathLike | None = None) -> Path:
    """The store's folder: `path`, else `$LABKIT_RUNS_DIR`, else `./runs`."""
    return Path(path or os.environ.get("LABKIT_RUNS_DIR") or "runs")


class RunsDirError(ValueError):
    """A runs folder that cannot be created or written; the message is one line naming it."""


def probe_folder(folder: Path) -> None:
    """Create `folder` (and its parents) and write and remove a file in it; OSError if it fails."""
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(20, "it is a file, not a folder", str(folder))
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".probe-", suffix=".tmp")
    os.close(fd)
    os.unlink(tmp)


def writable_runs_dir(path: str | os.PathLike | None = None) -> Path:
    """`runs_dir(path)`, created and checked by a write, so that a run is refused before it
    measures anything rather than when it stores its first rows (RunsDirError otherwise)."""
    folder = runs_dir(path)
    try:
        probe_folder(folder)
    except OSError as e:
        raise RunsDirError(f"cannot store results in {folder}: {e.strerror or e}; give --runs-dir "
                           "(or $LABKIT_RUNS_DIR) a folder you can write to") from None
    return folder


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def host_tag() -> str:
    """This machine's name in letters and digits only (a run id is also a file name)."""
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:16] or "host"


# The id's last 6 hex digits: a random start per process (hosts with the same name), then counted
# up, so that one process never repeats itself (24 fresh random bits would, by the birthday bound,
# within a few thousand ids in one second).
_RUN_SEQUENCE = itertools.count(secrets.randbits(24))


def new_run_id(experiment: str) -> str:
    """Unique across processes and machines writing to one folder: time, experiment, host, pid
    (one process on one host at a time) and a per-process sequence from a random start."""
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{experiment}-{host_tag()}-{os.getpid()}-{next(_RUN_SEQUENCE) % 2**24:06x}"


UNIT_SUFFIXES = (("_steps", "steps"), ("_ms", "ms"), ("_bytes_per_token", "bytes/token"), ("_bytes", "bytes"),
                 ("_fraction", "fraction"), ("_pct", "%"), ("tflops", "TFLOP/s"), ("gbps", "GB/s"),
                 ("flops", "FLOP"), ("_s", "s"))


def metric_skipped(rows: Any) -> Any:
    """Rows of a metric skipped alone while its variant ran (`joules_per_token` where no energy
    counter can be read): `skipped` with a metric, unlike a skipped variant's one row (metric None).
    `rows`: a DataFrame (a boolean Series back) or one row dict (a bool)."""
    if isinstance(rows, dict):
        return rows.get("status") == "skipped" and rows.get("metric") is not None
    return (rows["status"] == "skipped") & rows["metric"].notna()


def unit_of(metric: str) -> str:
    """The unit carried by a metric's name (one vocabulary everywhere): `tokens_per_s` ->
    tokens/s, `peak_mem_bytes` -> bytes; dimensionless metrics (`loss`) have none."""
    if metric.endswith("_per_s"):
        return metric.removesuffix("_per_s").rsplit("_", 1)[-1] + "/s"
    return next((unit for suffix, unit in UNIT_SUFFIXES if metric.endswith(suffix)), "")


def write_json_atomic(path: Path, record: dict[str, Any] | bytes) -> None:
    """Write to a temporary file in the same folder, then rename it into place. `record`: a dict
    (saved as JSON) or the bytes of a file (an imported run, kept byte for byte)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(record, bytes) else "w") as f:
            if isinstance(record, bytes):
                f.write(record)
            else:
                f.write(json.dumps(record, default=str))  # dumps: C's encoder; dump: Python's
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass
class RunResult:
    """One finished run: its id, its record's file and every row (all ranks')."""

    run_id: str
    path: str
    rows: list[dict[str, Any]]

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows)


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
        records.append({**renamed(record), "path": path})
    return records


def renamed(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with every variant RENAMED since it was stored under its name now: in its rows,
    their params and its config (any other record as it is)."""
    if not any(experiment == record["experiment"] for experiment, _ in RENAMED):
        return record

    def fix(d: Any) -> Any:
        key = (record["experiment"], d.get("variant")) if isinstance(d, dict) else None
        return {**d, "variant": RENAMED[key]} if key in RENAMED else d

    rows = [fix({**r, **({"params": fix(r["params"])} if "params" in r else {})})
            for r in record["rows"]]
    config = {"config": fix(record["config"])} if "config" in record else {}
    return {**record, "rows": rows, **config}


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


def load_runs(directory: str | os.PathLike | None = None, *,
              experiment: str | None = None) -> list[dict[str, Any]]:
    """Every stored run record, oldest first (temporary files are skipped; the part files of a
    multi-process run that was never merged are read as one run). `experiment`: only the files
    whose name (the run id, `new_run_id`) carries that experiment are read, not every record."""
    records, parts = {}, {}
    for record in _read_records(runs_dir(directory), f"*-{experiment}-*.json" if experiment else "*.json"):
        if experiment and record["experiment"] != experiment:
            continue
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


# --- Bundles: results carried between machines that share no folder ---------------------------

BUNDLE_FORMAT = "labkit-results-bundle/1"
MANIFEST = "manifest.json"
RUN_FILE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\.json")  # a plain file name: no folders


class BundleError(ValueError):
    """A file that is not a labkit bundle, or whose run files do not match its manifest."""


def _as_record(data: bytes) -> dict[str, Any] | None:
    """The run record in a file's bytes, or None when they hold none."""
    try:
        record = json.loads(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return None
    ok = isinstance(record, dict) and {"run_id", "timestamp", "experiment", "rows"} <= set(record)
    return record if ok else None


def export_bundle(out: str | os.PathLike, directory: str | os.PathLike | None = None, *,
                  experiment: str | None = None, participant: str | None = None) -> dict[str, Any]:
    """Write the run files of the store (those of `experiment`, of `participant`: None is all)
    into the zip `out` under `runs/`, with `manifest.json`: format, date, host, filters, counts
    and each file's SHA-256. Each file is read once, so what is hashed is what is stored."""
    folder, files = runs_dir(directory), []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        data = path.read_bytes()
        record = _as_record(data)
        if record is None or experiment not in (None, record["experiment"]):
            continue
        if participant not in (None, (record.get("config") or {}).get("participant", "")):
            continue
        files.append({"name": path.name, "sha256": hashlib.sha256(data).hexdigest(),
                      "bytes": len(data), "run_id": record["run_id"], "rows": len(record["rows"]),
                      "data": data})
    manifest = {"format": BUNDLE_FORMAT, "created": now(), "host": socket.gethostname(),
                "filters": {"experiment": experiment, "participant": participant},
                "counts": {"files": len(files), "runs": len({f["run_id"] for f in files}),
                           "rows": sum(f["rows"] for f in files)},
                "files": [{k: v for k, v in f.items() if k != "data"} for f in files]}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(MANIFEST, json.dumps(manifest, indent=1))
        for f in files:
            z.writestr(f"runs/{f['name']}", f["data"])
    os.replace(tmp, out)
    return manifest


def read_bundle(bundle: str | os.PathLike) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The manifest and the run files (name -> bytes) of `bundle`, every check passed: a zip
    (CRCs intact), a labkit manifest, exactly the files it lists, each with its SHA-256 and
    holding a run record. Anything else: one BundleError line."""
    try:
        with zipfile.ZipFile(bundle) as z:
            manifest = json.loads(z.read(MANIFEST))
            members = {n.removeprefix("runs/"): z.read(n) for n in z.namelist() if n != MANIFEST}
    except FileNotFoundError:
        raise BundleError(f"no bundle at {bundle}") from None
    except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError) as e:
        raise BundleError(f"{bundle} is corrupted or not a labkit bundle ({e}); nothing was "
                          "imported") from None
    if not isinstance(manifest, dict) or manifest.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{bundle}: not a labkit results bundle (format {BUNDLE_FORMAT} expected)")
    listed = {e.get("name"): e.get("sha256") for e in manifest.get("files", []) if isinstance(e, dict)}
    for name in sorted(set(listed) | set(members), key=str):
        problem = ("is not in the manifest" if name not in listed else "is missing" if name not in members
                   else "has an unsafe name" if not RUN_FILE_RE.fullmatch(name)
                   else "does not match its checksum"
                   if hashlib.sha256(members[name]).hexdigest() != listed[name]
                   else "holds no run record" if _as_record(members[name]) is None else "")
        if problem:
            raise BundleError(f"{bundle} is corrupted: runs/{name} {problem}; nothing was imported")
    return manifest, members


def _continues(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether `new` is the same run as `old`, further along (exported again after more rows)."""
    if old is None or old["run_id"] != new["run_id"] or len(new["rows"]) < len(old["rows"]):
        return False
    finished_before = old.get("status") == "complete" and new.get("status") != "complete"
    return new["rows"][: len(old["rows"])] == old["rows"] and not finished_before


def import_bundle(bundle: str | os.PathLike,
                  directory: str | os.PathLike | None = None) -> dict[str, Any]:
    """Add a bundle's run files to the store once it has passed every check (read_bundle).
    A file already there with the same bytes is skipped; one that the bundle's copy continues
    (the same run with more rows) is replaced; any other file of the same name is kept, and named
    in `kept`. Each file is written atomically, so importers and writers can run at once. The
    store is created (and checked, RunsDirError) only once the bundle has passed."""
    manifest, files = read_bundle(bundle)
    folder = writable_runs_dir(directory)
    outcome: dict[str, Any] = {"added": 0, "updated": 0, "unchanged": 0, "kept": [],
                               "source": manifest.get("host"), "created": manifest.get("created")}
    for name, data in sorted(files.items()):
        target = folder / name
        old = target.read_bytes() if target.exists() else None
        if old == data:
            outcome["unchanged"] += 1
        elif old is None or _continues(_as_record(old), _as_record(data)):
            write_json_atomic(target, data)
            outcome["added" if old is None else "updated"] += 1
        else:
            outcome["kept"].append(name)
    return outcome


# --- Numbers as people read them: one formatter for the CLI, notebooks, panels and report pages

BINARY_PREFIXES = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
SI_PREFIXES = ("", "k", "M", "G", "T", "P", "E")
RATIO_ENDINGS = ("_ratio", "speedup", "_over_predicted")  # dimensionless "x times" metrics
DIGITS = 4  # significant digits shown


def format_number(x: float, digits: int = DIGITS) -> str:
    """`digits` significant digits, thousands separated, no exponent between 1e-3 and 1e12:
    60.03, 58,752, 0.004213; outside that a short exponent (8.324e-9, 1.2e15); inf and nan
    as such."""
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return f"{x:g}"  # inf, -inf, nan
    if abs(x) < 1e-3 or abs(x) >= 1e12:
        mantissa, exponent = f"{x:.{digits - 1}e}".split("e")
        return f"{float(mantissa):g}e{int(exponent)}"
    text = f"{x:,.{digits}g}"
    return f"{x:,.0f}" if "e" in text else text  # 9999.7 rounds to 1e+04 in g format


def _scaled(x: float, base: int, prefixes: tuple[str, ...], unit: str) -> str:
    """`x` in the largest prefix of `base` that keeps it at or above 1: 1.5 KiB, 3.875 TFLOP."""
    power = 0  # 0.99995 of the next prefix shows as 1 of it, not as 1,024 of this one
    while abs(x) >= 0.99995 * base ** (power + 1) and power < len(prefixes) - 1:
        power += 1
    return f"{format_number(x / base ** power)} {prefixes[power]}{unit}"


def format_value(metric: str | None, value: Any, unit: str | None = None) -> str:
    """One measured or predicted value with its unit, as every table and page shows it: bytes in
    B/KiB/MiB/GiB (powers of 2), FLOPs with SI prefixes (GFLOP, TFLOP), fractions and `_pct` as
    %, ratios as "x", otherwise the metric's unit (`unit_of`, or `unit` when given): 139.4 ms,
    58,752 tokens/s, 5.454 TFLOP/s. None and NaN: ""; text and flags as they are."""
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Real):
        return "" if value is None else str(value)
    value = float(value)
    if value != value:  # NaN
        return ""
    unit = unit or (unit_of(metric) if metric else "")
    if unit == "bytes" or unit.startswith("bytes/"):
        return _scaled(value, 1024, BINARY_PREFIXES, unit.removeprefix("bytes").removeprefix("B"))
    if unit == "FLOP":
        return _scaled(value, 1000, SI_PREFIXES, "FLOP")
    if unit == "fraction":
        return f"{format_number(value * 100)}%"
    if unit == "%":
        return f"{format_number(value)}%"
    if metric and metric.endswith(RATIO_ENDINGS):
        return f"{format_number(value, 3)}x"
    return f"{format_number(value)} {unit}".strip()


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A plain text table: variant, (rank, in multi-process runs), metric, measured, predicted
    (each with its unit, `format_value`), status, note."""
    ranks = any(r.get("rank") not in (None, 0) for r in rows)
    rank_head = f"{'rank':>4} " if ranks else ""
    lines = [f"{'variant':<14} {rank_head}{'metric':<26} {'measured':>18} {'predicted':>18}  "
             f"{'status':<8} note"]
    for r in rows:
        metric = r["metric"] if isinstance(r["metric"], str) else None  # NaN from a DataFrame
        unit = r.get("unit") if isinstance(r.get("unit"), str) else None
        rank = f"{r.get('rank', 0):>4} " if ranks else ""
        lines.append(f"{r['variant']:<14} {rank}{metric or '-':<26} "
                     f"{format_value(metric, r['value'], unit):>18} "
                     f"{format_value(metric, r['predicted'], unit):>18}  {r['status']:<8} "
                     f"{r['message'] if isinstance(r['message'], str) else ''}")
    return "\n".join(lines)
