"""The GPU reference figures that the exercises and labs a CPU cannot demonstrate cite: measured
on an NVIDIA H200 by `labkit selfcheck` and stored in data/reference/h200.json (its checks) and
data/reference/h200-runs/ (the runs behind them).

Which exercises and labs those are is said by their text: a `cpu` section in KEY.md (what a CPU
cannot show, and that on a CPU the formula is graded), shown at the top of the notebook and by
`describe` / `symptoms` on a machine without a GPU. Its `{h200_...}` placeholders are the figures
here, so no number in that text is typed by hand."""
from __future__ import annotations

import functools
import json
import math
from typing import Any

from labkit import hardware
from labkit.study.exercises.core import show

RECORD = hardware.DATA_DIR / "reference" / "h200.json"
RUNS_DIR = hardware.DATA_DIR / "reference" / "h200-runs"


@functools.cache
def record() -> dict[str, Any]:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def check(experiment: str, metric: str) -> dict[str, Any] | None:
    """The record's check of `experiment` whose metric starts with `metric`, when it measured a
    finite value (a check whose run was left out has none)."""
    for c in record()["checks"]:
        value = c.get("measured")
        if (c.get("experiment") == experiment and c.get("metric", "").startswith(metric)
                and isinstance(value, (int, float)) and math.isfinite(value)):
            return c
    return None


@functools.cache
def run_rows(run_id: str) -> list[dict[str, Any]]:
    """The rows of the record's run `run_id` (read once)."""
    return json.loads((RUNS_DIR / f"{run_id}.json").read_text(encoding="utf-8"))["rows"]


def run_row(run_id: str, metric: str, value: float) -> dict[str, Any]:
    """The row of the record's run `run_id` that measured `value` of `metric` (its sweep point
    and the datasheet figure it was predicted at)."""
    return next(r for r in run_rows(run_id) if r["metric"] == metric and r["value"] == value)


def _against_datasheet(c: dict[str, Any], metric: str, unit: str) -> tuple[dict[str, Any], str]:
    """The run row behind check `c` (its `metric`), and its measured value as a share of the
    datasheet figure it was predicted at."""
    row = run_row(c["run_id"], metric, c["measured"])
    return row, (f"{100 * c['measured'] / row['predicted']:.0f}% of the datasheet's "
                 f"{show(row['predicted'], unit)} (run {c['run_id']})")


def matmul_words() -> str:
    """The H200's best measured bf16 matmul rate, its size, and the dense datasheet peak."""
    c = check("matmul", "bf16 matmul TFLOP/s")
    if c is None:
        return "none: the H200 record holds no matmul run"
    row, versus = _against_datasheet(c, "tflops", "TFLOP/s")
    size = row["params"]["sweep"].get("size")
    return f"{show(c['measured'], 'TFLOP/s')} in bf16 at m = n = k = {size:,}, {versus}"


def copy_words() -> str:
    """The H200's measured device-to-device copy bandwidth against its datasheet's."""
    c = check("memory_access", "device-to-device copy GB/s")
    if c is None:
        return "none: the H200 record holds no copy run"
    _, versus = _against_datasheet(c, "gbps", "GB/s")
    return f"a device-to-device copy at {show(c['measured'], 'GB/s')}, {versus}"


def int4_words() -> str:
    """The H200's int4 decode speed-up over the model dtype, where the record measured one."""
    c = check("weight_quant", "int4 decode tokens/s")
    if c is None:
        return "none: the H200 record's int4 decode run was left out, so there is no GPU figure"
    return f"int4 decode at {show(c['measured'])}x the bf16 tokens/s (run(s) {c['run_id']})"
