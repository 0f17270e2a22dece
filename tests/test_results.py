"""Mechanism tests for labkit.results: units, the atomic store, concurrent writers, loading.

This module must not import torch (directly or through labkit.cli / labkit.harness.experiment): its
concurrency test spawns processes that import this file, and they should start in a fraction of
a second. Everything here uses only labkit.results (pandas is imported lazily by load_results).
"""
from __future__ import annotations

import json
import math
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from labkit import results
from labkit.results import ROW_FIELDS, RunRecord, load_results, load_runs, unit_of, write_json_atomic

N_PROCS, N_RUNS, N_ROWS = 4, 10, 5
# Each record carries this much env text, so that one save takes several write() calls: a
# non-atomic save would leave a window in which a reader sees a truncated file.
ENV_PADDING = "x" * 64 * 1024


def _row(metric: str, value: float, **params) -> dict:
    return {"variant": "v", "params": params, "metric": metric, "value": value,
            "unit": unit_of(metric), "predicted": None, "status": "ok", "message": "", "rank": 0}


def _tmp_files(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp")) + sorted(folder.glob("*.tmp"))


# ---- workers for the spawned processes (module level, so "spawn" can import them) ----------

def _writer(directory: str, worker: int, n_runs: int, n_rows: int, barrier) -> None:
    """Write `n_runs` runs of `n_rows` rows each, one `add` per row, then finish each run."""
    barrier.wait(timeout=60)  # every writer starts at the same moment
    for run in range(n_runs):
        rec = RunRecord(f"exp{worker % 2}", env={"worker": worker, "padding": ENV_PADDING},
                        config={"run": run},
                        directory=directory)
        for i in range(n_rows):
            rec.add([_row("step_ms", float(i), worker=worker, run=run, row=i)])
        rec.finish()


def _crashing_writer(directory: str, run_id: str) -> None:
    """Add three rows, then die without finish() or any cleanup."""
    rec = RunRecord("crashy", env={}, config={}, directory=directory, run_id=run_id)
    for i in range(3):
        rec.add([_row("step_ms", float(i), row=i)])
    os._exit(3)


# ---- unit_of --------------------------------------------------------------------------------

@pytest.mark.parametrize("metric, unit", [
    ("step_ms", "ms"),
    ("step_iqr_ms", "ms"),
    ("peak_mem_bytes", "bytes"),
    ("kv_bytes", "bytes"),
    ("tokens_per_s", "tokens/s"),
    ("requests_per_s", "requests/s"),
    ("tflops", "TFLOP/s"),
    ("flops", "FLOP"),
    ("loss", ""),
    ("loss_delta", ""),
    ("token_agreement", ""),
    ("grad_norm", ""),
    ("peak_flops_pct", "%"),
    ("kv_bytes_per_token", "bytes/token"),
])
def test_unit_of(metric, unit):
    assert unit_of(metric) == unit


# ---- RunRecord and the atomic write ---------------------------------------------------------

def test_run_record_file_holds_every_row_after_each_add(tmp_path):
    rec = RunRecord("exp", env={"host": "h"}, config={"batch_size": 2}, directory=tmp_path)
    assert rec.path == tmp_path / f"{rec.run_id}.json"
    added = []
    for i in range(4):
        batch = [_row("step_ms", float(i)), _row("peak_mem_bytes", float(100 + i))]
        rec.add(batch)
        added.extend(batch)
        on_disk = json.loads(rec.path.read_text())
        assert on_disk["rows"] == added  # what a crash right now would keep
        assert on_disk["status"] == "running"
        assert on_disk["run_id"] == rec.run_id and on_disk["experiment"] == "exp"
        assert on_disk["env"] == {"host": "h"} and on_disk["config"] == {"batch_size": 2}
        assert _tmp_files(tmp_path) == []
    rec.finish()
    assert json.loads(rec.path.read_text())["status"] == "complete"
    rec.finish("interrupted")
    assert json.loads(rec.path.read_text())["status"] == "interrupted"
    assert [p.name for p in tmp_path.iterdir()] == [rec.path.name]  # one file, no temporaries

    full = rec.full_rows()
    assert len(full) == 8
    assert all(list(r) == list(ROW_FIELDS) for r in full)
    assert {r["run_id"] for r in full} == {rec.run_id}
    assert all(r["env"] == {"host": "h"} and r["experiment"] == "exp" for r in full)


def test_a_crash_after_add_loses_nothing(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_crashing_writer, args=(str(tmp_path), "crash-run"))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 3
    (record,) = load_runs(tmp_path)
    assert record["run_id"] == "crash-run"
    assert record["status"] == "running"  # never finished ...
    assert [r["value"] for r in record["rows"]] == [0.0, 1.0, 2.0]  # ... but every row is kept
    assert _tmp_files(tmp_path) == []


def test_write_json_atomic_keeps_old_file_when_the_write_fails(tmp_path, monkeypatch):
    path = tmp_path / "run.json"
    write_json_atomic(path, {"rows": [1, 2, 3]})
    before = path.read_bytes()

    def fail(fd):  # the new text is written, not yet on disk
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(results.os, "fsync", fail)
    with pytest.raises(RuntimeError, match="disk on fire"):
        write_json_atomic(path, {"rows": list(range(1000))})
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert json.loads(before) == {"rows": [1, 2, 3]}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # the temporary file is gone


def test_write_json_atomic_creates_missing_folders(tmp_path):
    path = tmp_path / "a" / "b" / "run.json"
    write_json_atomic(path, {"x": 1})
    assert json.loads(path.read_text()) == {"x": 1}
    assert _tmp_files(path.parent) == []


# ---- concurrency ----------------------------------------------------------------------------

@pytest.mark.slow
def test_concurrent_writers_lose_nothing_and_readers_never_see_half_a_file(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(N_PROCS + 1)  # the writers and this process (the reader)
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), w, N_RUNS, N_ROWS, barrier))
             for w in range(N_PROCS)]
    for p in procs:
        p.start()
    try:
        assert load_results(tmp_path).empty  # imports pandas now, not while the writers run
        barrier.wait(timeout=60)
        loads, seen_rows, errors = 0, [], []
        deadline = time.monotonic() + 120
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            try:  # must never hit a partial file; mostly the cheap loader, so it loads often
                if loads % 5 == 4:
                    frame = load_results(tmp_path)
                    assert list(frame.columns) == list(ROW_FIELDS)
                    n = len(frame)
                else:
                    n = sum(len(r["rows"]) for r in load_runs(tmp_path))
            except Exception as e:  # noqa: BLE001 - any failure of a reader is the bug
                errors.append(repr(e))
                continue
            loads += 1
            seen_rows.append(n)
    finally:
        for p in procs:
            p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * N_PROCS
    assert errors == []
    assert loads >= 1, "the reader never overlapped the writers"
    print(f"reader loads while writing: {loads}")
    assert all(n <= N_PROCS * N_RUNS * N_ROWS for n in seen_rows)

    frame = load_results(tmp_path)
    assert len(frame) == N_PROCS * N_RUNS * N_ROWS
    runs = load_runs(tmp_path)
    assert len(runs) == N_PROCS * N_RUNS
    assert len({r["run_id"] for r in runs}) == N_PROCS * N_RUNS
    assert frame["run_id"].nunique() == N_PROCS * N_RUNS
    assert all(r["status"] == "complete" and len(r["rows"]) == N_ROWS for r in runs)
    # every (worker, run, row) written exactly once
    keys = sorted((p["worker"], p["run"], p["row"]) for p in frame["params"])
    assert keys == [(w, r, i) for w in range(N_PROCS) for r in range(N_RUNS) for i in range(N_ROWS)]
    assert _tmp_files(tmp_path) == []


# ---- loading --------------------------------------------------------------------------------

def test_load_results_filters_and_expands_params(tmp_path):
    a = RunRecord("kv_cache", env={}, config={}, directory=tmp_path, run_id="run-a")
    a.add([_row("step_ms", 1.0, batch_size=1, seq_len=8, sweep={"batch_size": 1}),
           _row("step_ms", 2.0, batch_size=2, seq_len=8, sweep={"batch_size": 2})])
    a.finish()
    b = RunRecord("mixed_precision", env={}, config={}, directory=tmp_path, run_id="run-b")
    b.add([_row("loss", 8.0, batch_size=4, seq_len=16, sweep={})])
    b.finish()
    c = RunRecord("kv_cache", env={}, config={}, directory=tmp_path, run_id="run-c")
    c.add([_row("step_ms", 3.0, batch_size=8, seq_len=8, sweep={})])

    everything = load_results(tmp_path)
    assert list(everything.columns) == list(ROW_FIELDS)
    assert len(everything) == 4
    assert "batch_size" not in everything.columns  # only with expand_params

    kv = load_results(tmp_path, experiment="kv_cache")
    assert sorted(kv["run_id"]) == ["run-a", "run-a", "run-c"]
    assert set(kv["experiment"]) == {"kv_cache"}

    only_a = load_results(tmp_path, run_id="run-a", expand_params=True)
    assert list(only_a["value"]) == [1.0, 2.0]
    assert list(only_a["batch_size"]) == [1, 2]
    assert list(only_a["seq_len"]) == [8, 8]
    assert list(only_a["sweep.batch_size"]) == [1, 2]
    assert list(only_a.columns[: len(ROW_FIELDS)]) == list(ROW_FIELDS)

    both = load_results(tmp_path, experiment="kv_cache", run_id="run-c", expand_params=True)
    assert list(both["batch_size"]) == [8]
    assert load_results(tmp_path, experiment="mixed_precision", run_id="run-a").empty
    assert load_results(tmp_path, experiment="nope").empty
    empty = load_results(tmp_path / "absent", expand_params=True)
    assert empty.empty and list(empty.columns) == list(ROW_FIELDS)


def test_a_variant_renamed_since_its_run_was_stored_is_read_under_its_name_now(tmp_path):
    old = RunRecord("zero", env={}, config={"variant": "zero0"}, directory=tmp_path, run_id="run-z")
    old.add([{**_row("grad_bytes", 4.0, variant="zero0"), "variant": "zero0"},
             {**_row("grad_bytes", 1.0, variant="zero3"), "variant": "zero3"}])
    other = RunRecord("hybrid", env={}, config={}, directory=tmp_path, run_id="run-h")
    other.add([{**_row("loss", 1.0), "variant": "zero0"}])  # the name is another experiment's own
    frame = load_results(tmp_path)
    assert sorted(zip(frame["experiment"], frame["variant"])) == [
        ("hybrid", "zero0"), ("zero", "ddp"), ("zero", "zero3")]
    run = next(r for r in load_runs(tmp_path) if r["run_id"] == "run-z")
    assert [r["variant"] for r in run["rows"]] == ["ddp", "zero3"]
    assert [r["params"]["variant"] for r in run["rows"]] == ["ddp", "zero3"]
    assert run["config"]["variant"] == "ddp"
    hybrid = next(r for r in load_runs(tmp_path) if r["run_id"] == "run-h")
    assert [r["variant"] for r in hybrid["rows"]] == ["zero0"]


def test_runs_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LABKIT_RUNS_DIR", raising=False)
    assert results.runs_dir() == Path("runs")
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "from-env"))
    assert results.runs_dir() == tmp_path / "from-env"
    assert results.runs_dir(tmp_path / "explicit") == tmp_path / "explicit"
    assert results.runs_dir(str(tmp_path / "explicit")) == tmp_path / "explicit"
    monkeypatch.setenv("LABKIT_RUNS_DIR", "")  # empty means unset
    assert results.runs_dir() == Path("runs")

    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "from-env"))
    rec = RunRecord("exp", env={}, config={})
    rec.add([_row("step_ms", 1.0)])
    assert rec.path.parent == tmp_path / "from-env" and rec.path.exists()
    assert not (tmp_path / "runs").exists()


def test_foreign_files_in_the_store_are_skipped_with_a_warning(tmp_path):
    from labkit.results import RunRecord, load_results

    RunRecord("exp", {}, {}, directory=tmp_path).add([{"variant": "v", "metric": "m", "value": 1.0}])
    (tmp_path / "notes.json").write_text("{not json")
    (tmp_path / "other.json").write_text('{"hello": 1}')
    with pytest.warns(UserWarning, match="skipping"):
        frame = load_results(tmp_path)
    assert len(frame) == 1 and frame["metric"][0] == "m"


# ---- format_value / format_rows: the one formatter of the CLI, notebooks and report pages ----

@pytest.mark.parametrize("metric, value, shown", [
    ("peak_mem_bytes", 0, "0 B"),
    ("peak_mem_bytes", 512, "512 B"),
    ("peak_mem_bytes", 1536, "1.5 KiB"),
    ("peak_mem_bytes", 170 * 2**20, "170 MiB"),
    ("peak_mem_bytes", 11463735296, "10.68 GiB"),
    ("peak_mem_bytes", 2**20 - 1, "1 MiB"),  # rounds up to the next prefix, not "1,024 KiB"
    ("headroom_bytes", -1.5 * 2**30, "-1.5 GiB"),
    ("kv_bytes_per_token", 4096, "4 KiB/token"),
    ("flops", 3874938159104, "3.875 TFLOP"),
    ("flops", 20.9e9, "20.9 GFLOP"),
    ("tflops", 5.454282523659679, "5.454 TFLOP/s"),
    ("gbps", 4297.373891730766, "4,297 GB/s"),
    ("step_ms", 139.43341064453125, "139.4 ms"),
    ("step_ms", 0.8956947, "0.8957 ms"),
    ("tokens_per_s", 60.02888, "60.03 tokens/s"),
    ("tokens_per_s", 58752.05922405873, "58,752 tokens/s"),
    ("requests_per_s", 9999.7, "10,000 requests/s"),
    ("bubble_fraction", 0.25, "25%"),
    ("peak_flops_pct", 8.140720184566685, "8.141%"),
    ("speedup", 3.2977, "3.3x"),
    ("measured_over_predicted", 1.0321676, "1.03x"),
    ("loss", 10.464613914489746, "10.46"),
    ("grad_max_abs_diff", 8.32369551062584e-09, "8.324e-9"),
    ("loss_delta", -0.0001234, "-1.234e-4"),
    (None, 1e20, "1e20"),
    ("max_batch_size", 32.0, "32"),
])
def test_format_value_gives_the_unit_and_four_significant_digits(metric, value, shown):
    assert results.format_value(metric, value) == shown


@pytest.mark.parametrize("value, shown", [(None, ""), (float("nan"), ""), ("n/a", "n/a"), (True, "True")])
def test_format_value_leaves_missing_values_blank_and_text_as_it_is(value, shown):
    assert results.format_value("step_ms", value) == shown


def test_format_number_names_infinities_and_nan():
    assert results.format_number(math.inf) == "inf" and results.format_number(-math.inf) == "-inf"
    assert results.format_number(math.nan) == "nan" and results.format_value("step_ms", math.inf) == "inf ms"


def test_format_value_takes_a_rows_own_unit_over_the_metric_name():
    assert results.format_value("comm", 3 * 2**30, "bytes") == "3 GiB"
    assert results.format_value("size", 2.5, "MiB") == "2.5 MiB"


def test_format_rows_prints_each_value_once_with_its_unit():
    rows = [_row("tokens_per_s", 60.02888) | {"predicted": 58752.0},
            _row("peak_mem_bytes", 170 * 2**20)]
    text = results.format_rows(rows)
    assert "60.03 tokens/s" in text and "58,752 tokens/s" in text and "170 MiB" in text
    assert "e+0" not in text and "tokens/s tokens/s" not in text and " bytes" not in text


def test_load_runs_of_one_experiment_reads_its_files_alone(tmp_path, monkeypatch):
    for experiment in ("zero", "zero_bubble", "recipe"):
        run_id = results.new_run_id(experiment)
        write_json_atomic(tmp_path / f"{run_id}.json", {"run_id": run_id, "timestamp": "t",
                                                        "experiment": experiment, "rows": []})
    read = []
    original = json.load
    monkeypatch.setattr(json, "load", lambda f: read.append(Path(f.name).name) or original(f))
    assert [r["experiment"] for r in load_runs(tmp_path, experiment="zero")] == ["zero"]
    assert len(read) == 1 and "-zero-" in read[0]
    assert sorted(r["experiment"] for r in load_runs(tmp_path)) == ["recipe", "zero", "zero_bubble"]
