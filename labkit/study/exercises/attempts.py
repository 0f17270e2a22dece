"""Each graded attempt, stored like a run: one JSON file per attempt in `<runs folder>/attempts/`
(the results store reads only the runs folder's own `*.json`, so attempts never count as runs).
An attempt holds the prediction, the verdict, the measured evidence, the run behind it, the
participant and the team: what the leaderboard's learning view counts."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from labkit.config import check_name
from labkit.results import new_run_id, now, runs_dir, write_json_atomic

FOLDER = "attempts"
# Lab keys renamed since attempts were stored under them (issue 30: the old keys named the cause):
# an attempt stored under an old key counts under the new one, as results.RENAMED does for variants.
RENAMED = {"lab_oom": "lab_stops_at_first_step", "lab_data_loading": "lab_slow_step_c",
           "lab_recompute": "lab_slow_step_a", "lab_healthy": "lab_slow_step_b",
           "lab_fp16_overflow": "lab_fp16_stalls_b", "lab_fp16_underflow": "lab_fp16_stalls_a",
           "lab_padding": "lab_low_throughput", "lab_shape": "lab_slow_matmul",
           "lab_kv_cache": "lab_slow_generation", "lab_pipeline": "lab_slow_pipeline"}
COLUMNS = ("attempt_id", "timestamp", "kind", "exercise", "topic", "level", "correct", "prediction",
           "reference", "measured", "participant", "team", "machine", "device", "run_id")


def who(participant: str | None = None, team: str | None = None) -> dict[str, str]:
    """The participant and team: as given, else $LABKIT_PARTICIPANT / $LABKIT_TEAM (checked)."""
    names = {"participant": participant, "team": team}
    env = {"participant": "LABKIT_PARTICIPANT", "team": "LABKIT_TEAM"}
    return {k: check_name(k, (v if v is not None else os.environ.get(env[k], "")).strip())
            for k, v in names.items()}


def record_attempt(*, kind: str, exercise: str, topic: str, level: int, prediction: Any,
                   reference: Any, correct: bool, measured: dict[str, Any], device: str,
                   run_id: str | None, folder: str | os.PathLike | None = None,
                   participant: str | None = None, team: str | None = None) -> Path:
    """Store one attempt (`kind`: exercise, diagnosis or fix) and return its file."""
    from labkit import hardware
    from labkit.views import machine_name

    attempt_id = new_run_id(f"attempt-{exercise}")
    record = {"attempt_id": attempt_id, "timestamp": now(), "kind": kind, "exercise": exercise,
              "topic": topic, "level": level, "correct": bool(correct), "prediction": prediction,
              "reference": reference, "measured": measured, **who(participant, team),
              "machine": machine_name(hardware.fingerprint(), device), "device": device,
              "run_id": run_id}
    path = runs_dir(folder) / FOLDER / f"{attempt_id}.json"
    write_json_atomic(path, record)
    return path


def load_attempts(directory: str | os.PathLike | None = None):
    """Every stored attempt, oldest first, as a pandas DataFrame with COLUMNS (empty when none),
    its exercise under its key now (RENAMED); a file that is not an attempt is skipped with a
    warning."""
    import json
    import warnings

    import pandas as pd

    records = []
    for path in sorted((runs_dir(directory) / FOLDER).glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            warnings.warn(f"skipping {path}: not an attempt ({e})", stacklevel=2)
            continue
        if isinstance(record, dict) and {"attempt_id", "exercise", "correct"} <= set(record):
            row = {k: record.get(k) for k in COLUMNS}
            records.append({**row, "exercise": RENAMED.get(row["exercise"], row["exercise"])})
    frame = pd.DataFrame(records, columns=list(COLUMNS))
    return frame.sort_values(["timestamp", "attempt_id"], kind="stable").reset_index(drop=True)
