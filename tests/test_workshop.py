"""Workshop mechanisms: names on runs, a shared results folder many processes write at once,
bundles for machines that share nothing, and the container recipe (the leaderboard's
choices: tests/test_leaderboard.py).

The concurrent writers are plain subprocesses that import only `labkit.results` (no torch), so
they start in a fraction of a second and all write at the same moment (a start file releases them).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time
import tomllib
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from conftest import FAST
from labkit.cli import main
from labkit.config import ConfigError, RunConfig, resolve
from labkit.results import (BundleError, RunRecord, export_bundle, import_bundle, load_results,
                            load_runs, new_run_id, unit_of)

REPO = Path(__file__).resolve().parents[1]
N_PROCS, N_RUNS, N_ROWS = 4, 10, 5

WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from labkit.results import RunRecord

    folder, go = sys.argv[1], Path(sys.argv[5])
    worker, n_runs, n_rows = map(int, sys.argv[2:5])
    while not go.exists():  # every writer starts at the same moment
        time.sleep(0.005)
    name = f"p{worker}"
    for run in range(n_runs):
        rec = RunRecord(f"exp{worker % 2}", env={"hostname": name, "padding": "x" * 65536},
                        config={"participant": name, "team": f"t{worker % 2}"}, directory=folder)
        for i in range(n_rows):  # one atomic save per row, as the harness does per sweep point
            rec.add([{"variant": "v", "metric": "step_ms", "value": float(i), "unit": "ms",
                      "status": "ok", "rank": 0,
                      "params": {"participant": name, "team": f"t{worker % 2}", "run": run, "row": i}}])
        rec.finish()
""")


def _row(metric: str, value: float, **params) -> dict:
    return {"variant": "v", "params": params, "metric": metric, "value": value,
            "unit": unit_of(metric), "predicted": None, "status": "ok", "message": "", "rank": 0}


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    """A results table in a canonical order, every cell comparable (dicts as JSON text)."""
    text = frame.map(lambda v: json.dumps(v, sort_keys=True) if isinstance(v, dict) else v)
    return text.sort_values(["run_id", "metric", "params"]).reset_index(drop=True)


def _store(folder: Path, run_id: str, experiment: str = "kv_cache", participant: str = "ana",
           values: tuple = (1.0, 2.0), finish: bool = True) -> RunRecord:
    rec = RunRecord(experiment, env={}, config={"participant": participant}, directory=folder,
                    run_id=run_id)
    for v in values:
        rec.add([_row("tokens_per_s", v, participant=participant)])
    if finish:
        rec.finish()
    return rec


# ---- a shared folder, many writers ----------------------------------------------------------

@pytest.mark.slow
def test_many_processes_write_one_shared_folder_then_a_bundle_carries_the_same_table(tmp_path):
    shared, go = tmp_path / "shared", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(shared), str(w), str(N_RUNS),
                               str(N_ROWS), str(go)], env=env, stderr=subprocess.PIPE, text=True)
             for w in range(N_PROCS)]
    time.sleep(0.5)  # let them import
    go.touch()
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()

    frame = load_results(shared)
    assert len(frame) == N_PROCS * N_RUNS * N_ROWS  # no row lost ...
    keys = sorted((p["participant"], p["run"], p["row"]) for p in frame["params"])
    assert keys == sorted((f"p{w}", r, i) for w in range(N_PROCS) for r in range(N_RUNS)
                          for i in range(N_ROWS))  # ... none duplicated
    runs = load_runs(shared)
    assert len({r["run_id"] for r in runs}) == N_PROCS * N_RUNS
    assert all(r["status"] == "complete" and len(r["rows"]) == N_ROWS for r in runs)
    assert sorted(p.name for p in shared.iterdir()) == sorted(f"{r['run_id']}.json" for r in runs)

    bundle = tmp_path / "room.zip"
    manifest = export_bundle(bundle, shared)
    assert manifest["counts"] == {"files": N_PROCS * N_RUNS, "runs": N_PROCS * N_RUNS,
                                  "rows": N_PROCS * N_RUNS * N_ROWS}
    with zipfile.ZipFile(bundle) as z:
        for entry in manifest["files"]:  # the checksum is of the stored bytes, which are the file's
            data = z.read(f"runs/{entry['name']}")
            assert hashlib.sha256(data).hexdigest() == entry["sha256"]
            assert data == (shared / entry["name"]).read_bytes()
    empty = tmp_path / "elsewhere"
    assert import_bundle(bundle, empty)["added"] == N_PROCS * N_RUNS
    pd.testing.assert_frame_equal(_sorted(load_results(empty)), _sorted(frame))


def test_run_ids_hold_the_host_and_pid_and_never_repeat(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-box.local")
    ids = {new_run_id("kv_cache") for _ in range(2000)}  # same host, pid and second
    assert len(ids) == 2000
    assert all(re.fullmatch(rf"\d{{8}}T\d{{6}}-kv_cache-gpuboxlocal-{os.getpid()}-[0-9a-f]{{6}}", i)
               for i in ids)


# ---- export and import ----------------------------------------------------------------------

def test_export_filters_and_import_skips_what_is_there(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _store(src, "r-ana-kv", "kv_cache", "ana")
    _store(src, "r-ben-kv", "kv_cache", "ben")
    _store(src, "r-ana-mp", "mixed_precision", "ana")
    (src / "notes.json").write_text("{not a run")  # foreign files are not exported

    only = export_bundle(tmp_path / "a.zip", src, experiment="kv_cache", participant="ana")
    assert [f["run_id"] for f in only["files"]] == ["r-ana-kv"]
    assert only["filters"] == {"experiment": "kv_cache", "participant": "ana"}
    assert export_bundle(tmp_path / "k.zip", src, experiment="kv_cache")["counts"]["runs"] == 2

    everything = tmp_path / "all.zip"
    assert export_bundle(everything, src)["counts"] == {"files": 3, "runs": 3, "rows": 6}
    assert import_bundle(tmp_path / "a.zip", dst)["added"] == 1
    again = import_bundle(everything, dst)  # the kv run of ana is already there, byte for byte
    assert (again["added"], again["unchanged"], again["updated"], again["kept"]) == (2, 1, 0, [])
    assert import_bundle(everything, dst)["unchanged"] == 3
    with pytest.warns(UserWarning, match="notes.json"):  # the foreign file stays behind
        pd.testing.assert_frame_equal(_sorted(load_results(dst)), _sorted(load_results(src)))


def test_import_replaces_a_run_only_with_its_continuation(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    rec = _store(src, "r-1", values=(1.0,), finish=False)  # exported while still running
    export_bundle(tmp_path / "early.zip", src)
    import_bundle(tmp_path / "early.zip", dst)
    rec.add([_row("tokens_per_s", 2.0)])
    rec.finish()
    export_bundle(tmp_path / "late.zip", src)
    assert import_bundle(tmp_path / "late.zip", dst)["updated"] == 1
    assert len(load_runs(dst)[0]["rows"]) == 2
    assert import_bundle(tmp_path / "early.zip", dst)["kept"] == ["r-1.json"]  # never go back
    assert load_runs(dst)[0]["status"] == "complete"

    _store(tmp_path / "other", "r-1", values=(9.0,))  # another run under the same name: kept
    export_bundle(tmp_path / "other.zip", tmp_path / "other")
    assert import_bundle(tmp_path / "other.zip", dst)["kept"] == ["r-1.json"]
    assert [r["value"] for r in load_runs(dst)[0]["rows"]] == [1.0, 2.0]


def _rezip(src: Path, out: Path, edit) -> Path:
    """A copy of bundle `src` whose members pass through `edit(name, data) -> {name: data}`."""
    with zipfile.ZipFile(src) as z, zipfile.ZipFile(out, "w") as w:
        for name in z.namelist():
            for new_name, data in edit(name, z.read(name)).items():
                w.writestr(new_name, data)
    return out


def _tamper(name: str, data: bytes) -> dict:
    return {name: data.replace(b"1.0", b"7.0") if name.startswith("runs/") else data}


def _unsafe_name(name: str, data: bytes) -> dict:
    if name != "manifest.json":
        return {"runs/../escape.json": data}
    manifest = json.loads(data)
    manifest["files"][0]["name"] = "../escape.json"
    return {name: json.dumps(manifest)}


@pytest.mark.parametrize("damage, says", [
    ("flip", "corrupted"),  # a byte flipped in transit: the zip's CRC
    ("tamper", "does not match its checksum"),  # a run edited, the zip rebuilt
    ("extra", "is not in the manifest"),
    ("missing", "is missing"),
    ("unsafe", "unsafe name"),
    ("not_zip", "corrupted or not a labkit bundle"),
])
def test_a_corrupted_bundle_is_refused_with_one_line_and_exit_2(tmp_path, capsys, damage, says):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _store(src, "r-1")
    good = tmp_path / "good.zip"
    export_bundle(good, src)
    bad = tmp_path / "bad.zip"
    if damage == "flip":
        data = bytearray(good.read_bytes())
        data[len(data) // 3] ^= 0xFF  # inside the compressed run file
        bad.write_bytes(bytes(data))
    elif damage == "tamper":
        _rezip(good, bad, _tamper)
    elif damage == "extra":
        _rezip(good, bad, lambda n, d: {n: d, **({"runs/x.json": d} if n != "manifest.json" else {})})
    elif damage == "missing":
        _rezip(good, bad, lambda n, d: {n: d} if n == "manifest.json" else {})
    elif damage == "unsafe":
        _rezip(good, bad, _unsafe_name)
    else:
        bad.write_text("not a zip")
    with pytest.raises(BundleError, match=says):
        import_bundle(bad, dst)
    assert main(["results", "import", str(bad), "--runs-dir", str(dst)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("labkit: error: ") and says in err
    assert not dst.exists() and not (tmp_path / "escape.json").exists()  # nothing written


def test_the_results_command_exports_and_imports(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _store(src, "r-ana", participant="ana")
    _store(src, "r-ben", participant="ben")
    bundle = tmp_path / "ana.zip"
    assert main(["results", "export", "--out", str(bundle), "--runs-dir", str(src),
                 "--participant", "ana"]) == 0
    assert "exported 1 runs (2 rows, 1 files)" in capsys.readouterr().out
    assert main(["results", "import", str(bundle), "--runs-dir", str(dst)]) == 0
    assert "1 added, 0 updated, 0 already there" in capsys.readouterr().out
    assert main(["results", "--runs-dir", str(dst)]) == 0  # showing still works
    assert "== r-ana" in capsys.readouterr().out
    assert main(["results", "export"]) == 2  # no --out: one line
    assert "--out" in capsys.readouterr().err


# ---- names on runs --------------------------------------------------------------------------

def test_participant_and_team_come_from_settings_or_the_environment_and_are_checked(monkeypatch):
    monkeypatch.delenv("LABKIT_PARTICIPANT", raising=False)
    monkeypatch.delenv("LABKIT_TEAM", raising=False)
    cfg = resolve(RunConfig, "tiny", {"device": "cpu"})
    assert (cfg.participant, cfg.team) == ("", "")
    monkeypatch.setenv("LABKIT_PARTICIPANT", "Ana María")
    monkeypatch.setenv("LABKIT_TEAM", "red-1")
    cfg = resolve(RunConfig, "tiny", {"device": "cpu"})
    assert cfg.params()["participant"] == "Ana María" and cfg.params()["team"] == "red-1"
    assert resolve(RunConfig, "tiny", {"device": "cpu", "team": "blue"}).team == "blue"
    for bad in ("x" * 41, "a/b", "tab\there", "<script>"):
        with pytest.raises(ConfigError, match=r"^participant=.* is not a valid name; valid: up to 40"):
            resolve(RunConfig, "tiny", {"device": "cpu", "participant": bad})
    monkeypatch.setenv("LABKIT_TEAM", "bad;team")  # the environment is checked the same way
    with pytest.raises(ConfigError, match="team='bad;team'"):
        resolve(RunConfig, "tiny", {"device": "cpu"})


def test_names_are_stored_in_the_run_and_every_row(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_TEAM", "red")
    args = ["run", "matmul", "--device", "cpu", "--preset", "tiny", "--set", "size=128",
            "--set", "participant=ana", "--runs-dir", str(tmp_path), "--json",
            *[f"--set={k}={v}" for k, v in FAST.items()]]
    assert main(args) == 0
    (record,) = load_runs(tmp_path)
    assert record["config"]["participant"] == "ana" and record["config"]["team"] == "red"
    frame = load_results(tmp_path)
    assert len(frame) > 1 and all(p["participant"] == "ana" and p["team"] == "red"
                                  for p in frame["params"])
    capsys.readouterr()
    assert main([*args[:-1], "--set", "participant=a/b"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


@pytest.mark.slow
def test_the_panel_has_name_fields_filled_from_the_environment(monkeypatch):
    pytest.importorskip("ipywidgets")
    from labkit.ui.widgets import Panel

    monkeypatch.setenv("LABKIT_PARTICIPANT", "ana")
    panel = Panel("matmul", preset="tiny", device="cpu")
    assert panel.controls["participant"].value == "ana" and panel.controls["team"].value == ""
    panel.controls["team"].value = "red"
    assert panel.overrides()["participant"] == "ana" and panel.overrides()["team"] == "red"


# ---- the container recipe -------------------------------------------------------------------

def _requirement_name(req: str) -> str:
    return re.split(r"[<>=!~ \[;]", req.strip(), maxsplit=1)[0].lower()


def test_the_dockerfile_installs_the_package_set_of_pyproject():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    docker = (REPO / "Dockerfile").read_text()
    lines = re.sub(r"\\\n", " ", docker).splitlines()  # join continued lines
    assert re.search(r"^FROM nvidia/cuda:\S+", docker, re.M)
    installs = [line for line in lines if line.startswith("RUN") and re.search(r"\bpip3? install\b", line)]
    packages, project = [], False
    for line in installs:
        words = line.split("pip3 install" if "pip3 install" in line else "pip install", 1)[1].split()
        words = [w.strip("\"'") for w in words]
        skip = {i + 1 for i, w in enumerate(words) if w in ("--index-url", "--extra-index-url")}
        targets = [w for i, w in enumerate(words) if not w.startswith("-") and i not in skip]
        project |= "." in targets
        packages += [t for t in targets if t != "."]
    assert project, "the Dockerfile must install this project (pip install . or -e .)"
    by_name = {_requirement_name(d): d for d in deps}
    for req in packages:  # nothing beyond pyproject's set, and at the same requirement
        assert _requirement_name(req) in by_name, f"{req} is not a pyproject dependency"
        assert req.replace(" ", "") == by_name[_requirement_name(req)].replace(" ", ""), req
    assert "COPY pyproject.toml" in docker and "EXPOSE 8888" in docker
    cmd = next(line for line in lines if line.startswith("CMD"))
    assert "--ip=0.0.0.0" in cmd and "jupyterlab" in cmd
    assert not re.search(r"token\s*=\s*['\"]{2}|password\s*=\s*['\"]{2}|disable_check_xsrf", docker)
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {".git", "runs"} <= set(ignored)
    readme = (REPO / "README.md").read_text()
    assert "--gpus all" in readme and "Where it has been built and run" in readme
