"""The core (CLI env/list/run, selfcheck --recheck, experiments, results) runs with only torch,
numpy, pandas and nvidia-ml-py: the notebook-side packages are made unimportable in a fresh
interpreter, and the CLI must still work and must not have loaded any of them.

One subprocess for everything (each launch pays for an `import torch`).

How packages are blocked: every finder on `sys.meta_path` is wrapped so that a blocked name is
simply not found; `import tqdm` then raises ModuleNotFoundError, and `importlib.util.find_spec`
returns None, both exactly as when the package is not installed. (A finder that *raises* from
find_spec is not faithful: torch._dynamo.trace_rules probes optional modules such as tqdm with
importlib.util.find_spec, which must return None for a missing one; a raising finder makes every
variant fail with an `error` row that no real environment would produce.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import measured

REPO = Path(__file__).resolve().parents[1]

BLOCKED = ("ipywidgets", "IPython", "plotly", "papermill", "nbconvert", "nbformat", "jupyter",
           "jupyterlab", "anywidget", "tqdm", "ipykernel", "matplotlib")

SCRIPT = textwrap.dedent("""
    import contextlib, importlib.abc, io, json, sys

    BLOCKED = {blocked!r}
    attempted = []

    def is_blocked(name):
        top = name.split(".")[0]
        return top in BLOCKED or top.startswith("jupyter")

    class Hide(importlib.abc.MetaPathFinder):
        # wraps a finder; a blocked name is not found, exactly as if it were not installed

        def __init__(self, inner):
            self.inner = inner

        def find_spec(self, fullname, path=None, target=None):
            if is_blocked(fullname):
                attempted.append(fullname)
                return None
            find = getattr(self.inner, "find_spec", None)
            return find(fullname, path, target) if find else None

        def invalidate_caches(self):
            if hasattr(self.inner, "invalidate_caches"):
                self.inner.invalidate_caches()

    preloaded = sorted(m for m in sys.modules if is_blocked(m))
    sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
    try:
        import tqdm  # noqa: F401
        raise SystemExit("the blocker does not block")
    except ModuleNotFoundError as e:
        assert e.name == "tqdm", e

    from labkit.cli import main

    report = {{"preloaded": preloaded, "codes": [], "outputs": [], "errors": []}}
    for argv in (["env"], ["run", "kv_cache", *{tiny!r}, "--json"], ["list"], {recheck!r}):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        report["codes"].append(code)
        report["outputs"].append(out.getvalue())
        report["errors"].append(err.getvalue())
    report["loaded"] = sorted(m for m in sys.modules if is_blocked(m))
    report["attempted"] = sorted(set(attempted))
    print(json.dumps(report))
    sys.exit(max(report["codes"]))
""")

TINY = ["--device", "cpu", "--preset", "tiny", "--set", "new_tokens=4", "--set", "prompt_len=4",
        "--set", "min_run_time_s=0", "--set", "warmup=0", "--variant", "dynamic"]


@pytest.mark.slow
def test_core_runs_without_notebook_packages(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "LABKIT_RUNS_DIR": str(tmp_path / "runs")}
    reference = REPO / "data" / "reference"  # the H200 selfcheck, evaluated again: no notebook packages
    again = tmp_path / "recheck" / "h200.json"
    recheck = ["selfcheck", "--recheck", str(reference / "h200.json"), "--runs-dir",
               str(reference / "h200-runs"), "--out", str(again)]
    committed_runs = sorted(p.name for p in (reference / "h200-runs").iterdir())
    script = SCRIPT.format(blocked=BLOCKED, tiny=TINY, recheck=recheck)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    report = json.loads(proc.stdout.splitlines()[-1])
    # the recheck's exit code is its record's verdict (1 when a check failed there), not a crash;
    # and it measured nothing: the H200's runs are as committed, and no run was stored here
    rechecked = json.loads(again.read_text())
    failed = any(c["passed"] is False for c in rechecked["checks"])
    assert report["codes"] == [0, 0, 0, int(failed)], (report["errors"], proc.stderr[-4000:])
    assert proc.returncode == int(failed) and rechecked["rechecked"] and rechecked["checks"]
    assert sorted(p.name for p in (reference / "h200-runs").iterdir()) == committed_runs

    assert report["preloaded"] == []  # the blocker was in place before anything was imported
    assert report["loaded"] == []  # none of the notebook-side packages got in

    env_out, run_out, list_out, recheck_out = report["outputs"]
    # the printed table is the record's verdicts: one line per check, its result word on it
    verdict = {True: "pass", False: "FAIL", None: "skipped"}
    rows_printed = [ln for ln in recheck_out.splitlines() if set(ln.split()) & set(verdict.values())]
    assert len(rows_printed) == len(rechecked["checks"])
    for c in rechecked["checks"]:
        (line,) = [ln for ln in rows_printed if f" {c['metric']} " in f" {ln} "
                   and c["experiment"] in ln.split()]
        assert set(line.split()) & set(verdict.values()) == {verdict[c["passed"]]}, line
    assert "cpu" in env_out.lower()
    assert "kv_cache" in list_out and "mixed_precision" in list_out
    rows = [json.loads(line) for line in run_out.splitlines()]
    assert rows
    assert {r["variant"] for r in rows} == {"none", "dynamic"}
    assert all(r["status"] == "ok" for r in measured(rows))

    # LABKIT_RUNS_DIR chose the store: the run is there and nowhere else
    stored = list((tmp_path / "runs").glob("*.json"))
    assert [p.stem for p in stored] == [rows[0]["run_id"]]
    assert not (tmp_path / "runs" / "runs").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recheck", "runs"]
