"""Mechanism tests for the command line (labkit.cli): exit codes, what goes to stdout and stderr,
the schema of the rows, and the one-line refusal of bad input.

Everything runs in-process through `labkit.cli.main([...])` (a subprocess costs an `import
torch`), except one test that checks the real `python -m labkit` entry point. Experiments are
kept tiny with overrides and always write into a tmp folder.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from labkit.techniques import EXPERIMENTS, kv_cache
import torch

from labkit import cli
from labkit.cli import main
from labkit.config import usable_threads
from labkit.measure.memory import CPU_ALLOCATOR_OOM
from labkit.results import ROW_FIELDS
from labkit.workload import SkipVariant

from conftest import measured

REPO = Path(__file__).resolve().parents[1]
CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU-only behaviour")

KV_TINY = ["--device", "cpu", "--preset", "tiny", "--set", "new_tokens=4", "--set", "prompt_len=4",
           "--set", "min_run_time_s=0", "--set", "warmup=0"]
MP_TINY = ["--device", "cpu", "--preset", "tiny", "--set", "seq_len=8", "--set", "batch_size=1",
           "--set", "steps=1", "--set", "min_run_time_s=0", "--set", "warmup=0"]


def call(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr). An exception escaping main is a failure: the
    CLI promises one error line and an exit code, never a traceback."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own exits (e.g. --help)
            rc = e.code
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"main({argv}) raised {type(e).__name__}: {e}; stderr={err.getvalue()!r}")
    return rc, out.getvalue(), err.getvalue()


def _reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def strict_json(line: str):
    """json.loads that refuses NaN and Infinity (Python's json accepts them; JSON does not)."""
    return json.loads(line, parse_constant=_reject_constant)


def json_lines(out: str) -> list[dict]:
    lines = out.splitlines()
    assert lines, "no output"
    return [json.loads(line) for line in lines]  # every line, so stdout holds nothing else


# ---- list and env ---------------------------------------------------------------------------

def test_list_names_experiments_and_variants():
    rc, out, err = call(["list"])
    assert rc == 0 and err == ""
    lines = out.splitlines()
    mp = next(line for line in lines if line.startswith("mixed_precision"))
    kv = next(line for line in lines if line.startswith("kv_cache"))
    for variant in ("fp32 (reference)", "tf32", "fp16", "bf16", "bf16_weights"):
        assert variant in mp
    for variant in ("none (reference)", "dynamic"):
        assert variant in kv


def test_list_json():
    rc, out, err = call(["list", "--json"])
    assert rc == 0 and err == ""
    entries = {e["experiment"]: e for e in json_lines(out)}
    assert set(entries) == set(EXPERIMENTS)
    assert entries["kv_cache"]["reference"] == "none"
    assert entries["kv_cache"]["variants"] == ["none", "dynamic", "static", "paged", "quantized"]
    assert entries["mixed_precision"]["reference"] == "fp32"
    assert entries["mixed_precision"]["variants"] == ["fp32", "tf32", "fp16", "bf16", "bf16_weights"]
    assert all(e["summary"] for e in entries.values())


def test_env_human():
    rc, out, err = call(["env"])
    assert rc == 0
    assert "cpu" in out.lower()


def test_env_json_is_one_object():
    rc, out, _ = call(["env", "--json"])
    assert rc == 0
    (info,) = json_lines(out)
    assert isinstance(info, dict)
    assert {"fingerprint", "ceilings"} <= set(info)
    assert isinstance(info["fingerprint"], dict) and isinstance(info["ceilings"], dict)
    assert "cpu" in json.dumps(info).lower()


# ---- run ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def kv_run(tmp_path_factory):
    """One tiny kv_cache run with --json, shared by the tests that read its rows and store."""
    runs = tmp_path_factory.mktemp("kv-runs")
    rc, out, err = call(["run", "kv_cache", *KV_TINY, "--runs-dir", str(runs), "--json"])
    return {"rc": rc, "out": out, "err": err, "runs": runs}


@pytest.mark.slow
def test_run_json_stdout_is_only_rows_of_the_schema(kv_run):
    assert kv_run["rc"] == 0, kv_run["err"]
    rows = [strict_json(line) for line in kv_run["out"].splitlines()]
    assert rows
    for row in rows:
        assert list(row) == list(ROW_FIELDS)
    assert {r["experiment"] for r in rows} == {"kv_cache"}
    assert len({r["run_id"] for r in rows}) == 1
    assert {r["status"] for r in measured(rows)} == {"ok"}
    variants = [r["variant"] for r in rows]
    assert set(variants) == set(kv_cache.VARIANTS)
    assert variants == sorted(variants, key=lambda v: v != "none")  # reference first


@pytest.mark.slow
def test_run_json_measures_what_the_napkin_math_predicts(kv_run):
    rows = json_lines(kv_run["out"])
    by = {(r["variant"], r["metric"]): r for r in rows}
    for variant in ("none", "dynamic"):
        assert by[(variant, "token_agreement")]["value"] == 1.0
    per_token = by[("dynamic", "kv_bytes_per_token")]
    assert per_token["predicted"] is not None
    assert per_token["value"] == per_token["predicted"]
    kv = by[("dynamic", "kv_bytes")]
    assert kv["value"] == kv["predicted"]
    assert ("none", "kv_bytes") not in by  # no cache, no cache bytes
    for r in rows:
        assert r["params"]["variant"] == r["variant"]
        assert r["params"]["new_tokens"] == 4 and r["params"]["prompt_len"] == 4
        assert r["params"]["device"] == "cpu" and r["params"]["preset"] == "tiny"


@pytest.mark.slow
def test_run_is_stored_in_the_runs_dir(kv_run):
    rows = json_lines(kv_run["out"])
    run_id = rows[0]["run_id"]
    path = kv_run["runs"] / f"{run_id}.json"
    assert path.is_file()
    record = json.loads(path.read_text())
    assert record["status"] == "complete"
    assert len(record["rows"]) == len(rows)
    assert [p.name for p in kv_run["runs"].iterdir()] == [path.name]  # no temporary files


@pytest.mark.slow
def test_results_lists_a_stored_run(kv_run):
    rows = json_lines(kv_run["out"])
    run_id, runs = rows[0]["run_id"], str(kv_run["runs"])

    rc, out, err = call(["results", "--runs-dir", runs])
    assert rc == 0 and err == ""
    assert f"== {run_id}" in out
    assert out.count("== ") == 1
    assert "variant" in out and "metric" in out and "kv_bytes_per_token" in out

    rc, out, err = call(["results", "--runs-dir", runs, "--json"])
    assert rc == 0 and err == ""
    stored = json_lines(out)
    assert len(stored) == len(rows)
    assert {r["run_id"] for r in stored} == {run_id}
    assert [(r["variant"], r["metric"], r["value"]) for r in stored] == \
        [(r["variant"], r["metric"], r["value"]) for r in rows]

    rc, out, _ = call(["results", "--runs-dir", runs, "--run-id", run_id, "--json"])
    assert rc == 0 and len(json_lines(out)) == len(rows)
    rc, out, _ = call(["results", "--runs-dir", runs, "--experiment", "mixed_precision"])
    assert rc == 0 and out.strip() == "no stored results"
    rc, out, _ = call(["results", "--runs-dir", str(kv_run["runs"] / "absent")])
    assert rc == 0 and out.strip() == "no stored results"


@pytest.mark.slow
def test_results_json_is_strict_json(kv_run):
    rc, out, _ = call(["results", "--runs-dir", str(kv_run["runs"]), "--json"])
    assert rc == 0
    for line in out.splitlines():
        strict_json(line)


@pytest.mark.slow
def test_run_human_output_has_a_table_and_the_stored_path(tmp_path):
    runs = tmp_path / "runs"
    rc, out, err = call(["run", "mixed_precision", *MP_TINY, "--variant", "fp32",
                         "--runs-dir", str(runs)])
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:5] == ["variant", "metric", "measured", "predicted", "status"]
    assert any(line.startswith("fp32") and "param_bytes" in line for line in lines)
    assert not any(line.startswith(("tf32", "fp16", "bf16")) for line in lines)
    stored = [line for line in lines if line.startswith("stored as ")]
    assert len(stored) == 1
    path = Path(stored[0].removeprefix("stored as "))
    assert path.parent == runs and path.is_file()
    assert json.loads(path.read_text())["experiment"] == "mixed_precision"


@pytest.mark.slow
def test_sweep_gives_rows_for_every_point_reference_first(tmp_path):
    rc, out, err = call(["run", "kv_cache", *KV_TINY, "--sweep", "batch_size=1,2",
                         "--variant", "dynamic", "--runs-dir", str(tmp_path), "--json"])
    assert rc == 0, err
    rows = json_lines(out)
    assert all(r["status"] == "ok" for r in measured(rows))
    points = [r["params"]["sweep"]["batch_size"] for r in rows]  # typed, as resolved
    assert set(points) == {1, 2}
    assert points == sorted(points)  # the first point's rows all come before the second's
    for point in (1, 2):
        mine = [r for r, p in zip(rows, points) if p == point]
        assert all(r["params"]["batch_size"] == point for r in mine)
        variants = [r["variant"] for r in mine]
        assert variants[0] == "none"
        assert set(variants) == {"none", "dynamic"}
        assert variants == sorted(variants, key=lambda v: v != "none")
        by = {(r["variant"], r["metric"]): r["value"] for r in mine}
        assert by[("dynamic", "token_agreement")] == 1.0
    assert len(list(tmp_path.glob("*.json"))) == 1  # one run for the whole sweep


# ---- bad input ------------------------------------------------------------------------------

BAD_INPUT = [
    ("unknown-experiment", ["run", "nope"], ["'nope'", "mixed_precision", "kv_cache"]),
    ("unknown-variant", ["run", "kv_cache", "--variant", "bogus"], ["'bogus'", "none", "dynamic"]),
    ("unknown-variant-comma", ["run", "kv_cache", "--variant", "dynamic,bogus"], ["'bogus'", "none"]),
    ("unknown-set-key", ["run", "kv_cache", "--set", "foo=1"],
     ["'foo'", "batch_size", "prompt_len", "new_tokens", "dtype"]),
    ("wrong-type", ["run", "kv_cache", "--set", "batch_size=abc"], ["batch_size", "abc", "int"]),
    ("zero", ["run", "kv_cache", "--set", "batch_size=0"], ["batch_size", ">= 1"]),
    ("negative", ["run", "kv_cache", "--set", "batch_size=-3"], ["batch_size", ">= 1"]),
    ("seq-len-past-context", ["run", "mixed_precision", "--preset", "tiny", "--set", "seq_len=999999"],
     ["seq_len", "context", "2048"]),
    ("generation-past-context", ["run", "kv_cache", "--preset", "tiny", "--set", "prompt_len=2000",
                                 "--set", "new_tokens=100"], ["prompt_len", "new_tokens", "context"]),
    ("unknown-dtype", ["run", "kv_cache", "--set", "dtype=float64"],
     ["float64", "float32", "bfloat16", "float16"]),
    ("unknown-device", ["run", "kv_cache", "--device", "tpu"], ["'tpu'", "cpu"]),
    pytest.param("absent-device", ["run", "kv_cache", "--device", "cuda"],
                 ["'cuda'", "not present", "available: cpu"], marks=CPU_ONLY, id="absent-device"),
    ("unknown-preset", ["run", "kv_cache", "--preset", "nope"], ["'nope'", "tiny", "small"]),
    ("set-without-equals", ["run", "kv_cache", "--set", "foo"], ["'foo'", "key=value"]),
    ("set-without-key", ["run", "kv_cache", "--set", "=3"], ["'=3'", "key=value"]),
    ("sweep-without-equals", ["run", "kv_cache", "--sweep", "batch_size"], ["batch_size", "key=value"]),
    ("sweep-empty", ["run", "kv_cache", "--sweep", "batch_size="], ["batch_size", "no values"]),
    ("sweep-only-commas", ["run", "kv_cache", "--sweep", "batch_size=,"], ["batch_size", "no values"]),
    ("sweep-bad-value", ["run", "kv_cache", "--sweep", "batch_size=1,abc"], ["batch_size", "abc"]),
    ("sweep-unknown-key", ["run", "kv_cache", "--sweep", "foo=1,2"], ["'foo'", "batch_size"]),
    ("unknown-subcommand", ["frobnicate"], ["frobnicate", "run", "env"]),
    ("no-subcommand", [], ["command"]),
    ("missing-name", ["run"], ["name"]),
    ("unknown-option", ["list", "--bogus"], ["--bogus"]),
    ("mixed-precision-dtype", ["run", "mixed_precision", "--set", "dtype=bfloat16"],
     ["dtype", "float32", "bf16"]),
    pytest.param("int-double-minus", ["run", "kv_cache", *KV_TINY, "--set", "batch_size=--3"],
                 ["batch_size"], id="int-double-minus"),
    pytest.param("int-superscript", ["run", "kv_cache", *KV_TINY, "--set", "batch_size=\u00b2"],
                 ["batch_size"], id="int-superscript"),
    pytest.param("float-nan-budget", ["run", "kv_cache", *KV_TINY, "--variant", "none", "--set",
                                      "memory_budget_gib=nan"], ["memory_budget_gib"],
                 id="float-nan-budget"),
    pytest.param("variant-set", ["run", "kv_cache", "--set", "variant=dynamic"], ["--variant", "none"],
                 id="variant-set"),
    pytest.param("float-nan-model", ["run", "kv_cache", *KV_TINY, "--variant", "none", "--set",
                                     "rope_theta=nan"], ["rope_theta"],
                 id="float-nan-model"),
    # torch given far more threads than exist crashed the process (a segmentation fault)
    ("num-threads-past-the-machine", ["run", "kv_cache", "--set", "num_threads=100000"],
     ["num_threads=100000", f"valid: 1..{usable_threads()}"]),
    ("num-threads-zero", ["run", "kv_cache", "--set", "num_threads=0"], ["num_threads=0", ">= 1"]),
    ("threads-experiment-past-the-machine", ["run", "threads", "--set", "threads=100000"],
     ["threads=100000", "valid: 0"]),
    ("timeout-zero", ["run", "data_parallel", "--set", "timeout_s=0"], ["timeout_s=0", ">= 1"]),
    ("plan-seq-len-zero", ["plan", "--seq-len", "0"], ["seq_len=0"]),
    ("prompt-past-context", ["run", "kv_cache", "--set", "prompt_len=100000000"],
     ["prompt_len + new_tokens = 100000128", "context (2048)"]),
    ("report-jobs-zero", ["report", "--jobs", "0"], ["--jobs=0", "1 or more"]),
    ("train-reference-steps-zero", ["train-reference", "--steps", "0"], ["--steps 0", "at least 1"]),
]


def _case(case):
    return case if hasattr(case, "marks") else pytest.param(*case, id=case[0])


@pytest.mark.parametrize("name, argv, mentions", [_case(c) for c in BAD_INPUT])
def test_bad_input_is_one_error_line_and_exit_2(name, argv, mentions, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default output folder (report's lab-report/) would land here
    runs = tmp_path / "runs"
    if argv and argv[0] == "run":
        argv = [*argv, "--runs-dir", str(runs)]
    rc, out, err = call(argv)
    assert rc == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("labkit: error: ")
    for text in mentions:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"
    assert not runs.exists() or list(runs.iterdir()) == []  # refused before anything was stored


@pytest.mark.slow
def test_python_m_labkit_refuses_bad_input_without_a_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "LABKIT_RUNS_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "labkit", "run", "nope"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("labkit: error: unknown experiment 'nope'")
    assert list(tmp_path.iterdir()) == []


# ---- paths that cannot be written, interrupts, exit codes ------------------------------------

def one_line_error(rc: int, out: str, err: str, *mentions: str) -> None:
    assert rc == 2 and out == "" and "Traceback" not in err, (rc, out, err)
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("labkit: error: "), err
    for text in mentions:
        assert text in lines[0], f"{text!r} not in {lines[0]!r}"


def unwritable(kind: str, tmp_path: Path, monkeypatch) -> Path:
    """A folder that cannot be written: under /proc (it cannot be created), a path that is a
    file, or a read-only folder (as root, who may write anyway, the OS's refusal is simulated)."""
    if kind == "proc":
        return Path("/proc/labkit-absent/runs")
    if kind == "file":
        (tmp_path / "a-file").write_text("x")
        return tmp_path / "a-file"
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if os.access(folder, os.W_OK):
        import tempfile

        real = tempfile.mkstemp

        def mkstemp(*args, dir=None, **kwargs):
            if dir is not None and Path(dir) == folder:
                raise PermissionError(13, "Permission denied", str(folder))
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    return folder


def forbid(monkeypatch, target, name: str, calls: list) -> None:
    monkeypatch.setattr(target, name, lambda *a, **k: calls.append(name))


@pytest.mark.parametrize("kind", ["proc", "file", "read-only"])
def test_a_runs_folder_that_cannot_be_written_is_refused_before_anything_runs(kind, tmp_path,
                                                                              monkeypatch):
    from labkit import report
    from labkit.views import roofline
    from labkit.harness import selfcheck

    calls: list = []
    forbid(monkeypatch, kv_cache, "build", calls)
    forbid(monkeypatch, report, "run_report", calls)
    forbid(monkeypatch, selfcheck, "selfcheck", calls)
    forbid(monkeypatch, roofline, "calibrate", calls)
    from labkit.results import export_bundle

    bundle = tmp_path / "bundle.zip"  # a sound bundle: the store is the only thing wrong
    export_bundle(bundle, tmp_path / "empty-store")
    folder = str(unwritable(kind, tmp_path, monkeypatch))
    for argv in (["run", "kv_cache", *KV_TINY], ["report", "--out", str(tmp_path / "report")],
                 ["selfcheck", "--device", "cpu"], ["calibrate", "--device", "cpu"],
                 ["results", "import", str(bundle)]):
        one_line_error(*call([*argv, "--runs-dir", folder]), "cannot store results in", folder)
    monkeypatch.setenv("LABKIT_RUNS_DIR", folder)
    one_line_error(*call(["run", "kv_cache", *KV_TINY]), folder)
    assert calls == []


@pytest.mark.parametrize("kind", ["proc", "file", "read-only"])
def test_an_output_path_that_cannot_be_written_is_refused_before_anything_runs(kind, tmp_path,
                                                                               monkeypatch):
    from labkit import report
    from labkit.harness import experiment
    from labkit.blocks import reference
    from labkit.harness import selfcheck

    calls: list = []
    for target, name in ((selfcheck, "selfcheck"), (report, "run_report"), (reference,
                         "train_reference"), (experiment, "profile_experiment")):
        forbid(monkeypatch, target, name, calls)
    folder = unwritable(kind, tmp_path, monkeypatch)
    file = str(folder / "out.json")
    for argv, option in ((["selfcheck", "--device", "cpu", "--out", file], "--out"),
                         (["results", "export", "--out", file], "--out"),
                         (["profile", "kv_cache", "--trace", file], "--trace"),
                         (["train-reference", "--quick", "--out", str(folder)], "--out"),
                         (["report", "--out", str(folder)], "--out")):
        one_line_error(*call(argv), option, str(folder))  # runs: conftest's $LABKIT_RUNS_DIR
    one_line_error(*call(["profile", "kv_cache", "--trace", str(tmp_path)]), "is a folder")
    assert calls == []


def test_an_os_error_is_one_line_and_ctrl_c_exits_130(monkeypatch):
    def disk_full(args):
        raise OSError(28, "No space left on device", "/data/runs/x.json")

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "env", disk_full)
    one_line_error(*call(["env"]), "No space left on device", "/data/runs/x.json")
    monkeypatch.setitem(cli.COMMANDS, "env", interrupted)
    rc, out, err = call(["env"])
    assert rc == 130 and out == "" and err == "labkit: interrupted; rows measured so far are stored\n"


CPU_OOM = RuntimeError(f"[enforce fail at alloc_cpu.cpp:127] err == 0. {CPU_ALLOCATOR_OOM}: you "
                       "tried to allocate 800000000000 bytes. Error code 12 (Cannot allocate memory)")


@pytest.mark.parametrize("failing, raised, code, status", [
    ("none", RuntimeError("boom"), 1, "error"),  # the reference failed: no verdict is possible
    ("none", CPU_OOM, 0, "oom"),
    ("none", SkipVariant("not here"), 0, "skipped"),
    ("dynamic", RuntimeError("boom"), 0, "error"),  # a variant's error is a result
])
@pytest.mark.slow
def test_run_exits_1_only_when_the_reference_row_is_an_error(failing, raised, code, status,
                                                            tmp_path, monkeypatch):
    real_build = kv_cache.build

    def build(cfg):
        if cfg.variant == failing:
            raise raised
        return real_build(cfg)

    monkeypatch.setattr(kv_cache, "build", build)
    rc, out, err = call(["run", "kv_cache", *KV_TINY, "--variant", "dynamic", "--json",
                         "--runs-dir", str(tmp_path)])
    rows = json_lines(out)
    assert rc == code, err
    assert [r["status"] for r in rows if r["variant"] == failing] == [status]
    if code:
        (line,) = err.splitlines()
        assert line.startswith("labkit: error: the reference (none) failed") and "boom" in line
    else:
        assert "error" not in err


def test_calibrate_stores_ceilings_the_roofline_then_prefers(tmp_path, monkeypatch):
    """Only the wiring: the scan itself is tested in test_roofline.py (a 256 MiB copy is slow)."""
    from labkit.views import roofline

    seen = {}

    def fake(device, runs_dir, *, sizes=None):
        seen.update(device=device, runs_dir=runs_dir, sizes=sizes)
        return roofline.RooflineCeilings("cpu", "test cpu", {"float32": 0.5}, 10.0,
                                         {"float32": "measured: test", "bandwidth": "measured: test"})

    monkeypatch.setattr(roofline, "calibrate", fake)
    rc, out, _ = call(["calibrate", "--device", "cpu", "--runs-dir", str(tmp_path), "--sizes", "128,256"])
    assert rc == 0 and seen == {"device": "cpu", "runs_dir": str(tmp_path), "sizes": [128, 256]}
    assert "float32: 0.5 TFLOP/s, ridge 50 FLOP/B [measured: test]" in out
    rc, _, err = call(["calibrate", "--sizes", "big"])
    assert rc == 2 and err.count("\n") == 1 and "give integers" in err


@pytest.mark.slow
def test_profile_any_experiment_prints_findings_operators_and_writes_a_trace(tmp_path):
    trace = tmp_path / "trace.json"
    rc, out, _ = call(["profile", "kv_cache", *KV_TINY, "--variant", "static", "--trace", str(trace)])
    assert rc == 0 and "top operator: aten::" in out and "aten::mm" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "aten::mm" for e in events)
    rc, _, err = call(["profile", "kv_cache", "--variant", "nope"])
    assert rc == 2 and "valid: none, dynamic, static, paged, quantized" in err
    rc, _, err = call(["profile", "data_parallel", "--device", "cpu"])
    assert rc == 2 and "nsys profile" in err and "--variant" not in err


def test_lab_command_serves_the_notebooks_on_localhost_with_its_token_out_of_the_command_line():
    """The command `labkit lab` starts (a real JupyterLab from it answers with the token and
    refuses a request without it: test_browser.py, on the server its panel test uses)."""
    from labkit.cli import lab_command

    cmd, env = lab_command(8890, "sesame")
    assert "--ip=127.0.0.1" in cmd and any(c.endswith("/notebooks") for c in cmd)
    assert "sesame" not in " ".join(cmd) and env["JUPYTER_TOKEN"] == "sesame"
    rc, out, _ = call(["lab", "--dry-run", "--port", "8890"])
    assert rc == 0 and "http://127.0.0.1:8890/lab?token=" in out and "--ip=127.0.0.1" in out
    rc, _, err = call(["lab", "--dry-run", "--port", "0"])
    assert rc == 2 and "valid: 1..65535" in err
