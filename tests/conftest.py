import importlib.util
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(items):
    """A test that starts ranks or executes notebooks is slow whatever else it does; so is one
    that reads `shared_runs` (every exercise's run, measured once: over a minute)."""
    for item in items:
        if (item.get_closest_marker("multiprocess") or item.get_closest_marker("notebook")
                or "shared_runs" in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def needs(*packages: str):
    """A mark that skips a module's tests where one of `packages` is not installed, found
    without importing it: peft or papermill takes 2 s to import, which every collection would
    pay (`-m "not slow"` too), where importorskip at module level imports them."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """Every test stores runs in its own folder and runs torch on one thread (2-core machine)."""
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("LABKIT_QUIZ_PROGRESS", str(tmp_path / "quiz_progress.json"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Sizes that make every experiment finish in well under a second per variant on a 2-core CPU.
FAST = {"min_run_time_s": 0.0, "warmup": 0}
TINY_TRAIN = {**FAST, "batch_size": 1, "seq_len": 8, "steps": 1, "num_layers": 2}
TINY_DECODE = {**FAST, "prompt_len": 4, "new_tokens": 6, "num_layers": 2}
# Multi-process runs: every launch costs 6-12 s here (each rank imports torch), so a test module
# launches each experiment once (a module-scoped fixture) and asserts on those rows.
TINY_DIST = {**FAST, "timed_steps": 2, "batch_size": 2, "seq_len": 16, "num_layers": 2,
             "timeout_s": 60}


def measured(rows):
    """`rows` without the metrics this machine cannot measure while their variant ran (energy
    where no counter can be read: `skipped` with the reason)."""
    from labkit.results import metric_skipped
    return [r for r in rows if not metric_skipped(r)]


def by(rows, variant, metric):
    """The one row of `metric` for `variant` in a run's rows (a failure when absent or repeated)."""
    hits = [r for r in rows if r["variant"] == variant and r["metric"] == metric]
    assert len(hits) == 1, (variant, metric, hits)
    return hits[0]


FAULTS = {"fault": ["none", "corrupt_reduction"]}  # one launch: the clean run and the corrupted one


def fault_fixtures(experiment: str, overrides: dict):
    """Module-scoped fixtures of one launch of `experiment` swept over FAULTS: `run` (every row),
    `rows` (the clean ones) and `corrupted` (fault_rank's gradient reduction spoiled). Bind them
    at module level: `run, rows, corrupted = fault_fixtures(...)`."""
    from labkit.harness.experiment import run_experiment

    @pytest.fixture(scope="module")
    def run(tmp_path_factory):
        return run_experiment(experiment, preset="tiny", overrides=overrides, sweep=FAULTS,
                              runs_dir=str(tmp_path_factory.mktemp("runs")), progress=False).rows

    @pytest.fixture(scope="module")
    def rows(run):
        return [r for r in run if r["params"]["fault"] == "none"]

    @pytest.fixture(scope="module")
    def corrupted(run):
        return [r for r in run if r["params"]["fault"] == "corrupt_reduction"]

    return run, rows, corrupted


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    """Every Run behind the exercises measured once per session, into one folder that the
    exercise tests and notebooks reuse (exercises that share a Run share its rows)."""
    from labkit.study import exercises

    folder = tmp_path_factory.mktemp("exercise-runs")
    for run in exercises.RUNS.values():
        exercises.measure(run, "cpu", str(folder), reuse=False)
    return str(folder)


def execute_notebooks(jobs, cwd, kernels=2):
    """Execute `jobs` ((path, output, parameters) each) on `kernels` warm kernels, one thread
    each (labkit.report.kernel: a kernel's imports are paid once, not once a notebook); returns
    each notebook's printed text, in order."""
    import concurrent.futures

    import nbformat

    from labkit.report.kernel import WarmKernel

    def run(share):
        with WarmKernel(cwd, Path(cwd) / f"kernel-{share}.log") as kernel:
            for path, out, parameters in jobs[share::kernels]:
                kernel.execute(path, out, parameters)

    with concurrent.futures.ThreadPoolExecutor(kernels) as pool:
        list(pool.map(run, range(kernels)))
    texts = []
    for _, out, _ in jobs:
        nb = nbformat.read(out, as_version=4)
        texts.append("".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                             for o in c.outputs))
    return texts
