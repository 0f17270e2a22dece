import collections
import importlib.util

import pytest
import torch

from labkit.config import MODELS
from labkit.report.kernel import defer_iri_grammar

defer_iri_grammar()  # as the report's processes do: the suite's import nbformat (1.3 CPU-s less each)

# Session fixtures measured once for many test files: the tests that read one share a worker.
SHARED = ("report", "shared_runs")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(items):
    """A test that starts ranks or executes notebooks is slow whatever else it does; so is one
    that reads `shared_runs` (every exercise's run, measured once: over a minute).

    The suite runs on two pytest-xdist workers (`-n 2 --dist loadgroup` in pyproject.toml), one
    per core: each test file is one unit of work, so its module fixtures (a launch of ranks) run
    once, and the tests of every file that reads one of the SHARED session fixtures are one unit.
    The longest units go first (the SHARED ones, then the files with the most slow tests), so
    that no worker is left alone with a long one at the end (`--no-loadscope-reorder` keeps this
    order)."""
    group = {}
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if (item.get_closest_marker("multiprocess") or item.get_closest_marker("notebook")
                or "shared_runs" in fixtures):
            item.add_marker(pytest.mark.slow)
        group[item] = next((name for name in SHARED if name in fixtures), item.path.name)
        item.add_marker(pytest.mark.xdist_group(group[item]))
    slow = collections.Counter(group[item] for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: (group[item] not in SHARED, -slow[group[item]]))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)  # before pytest-timeout's wrapper reads the mark
def pytest_runtest_protocol(item, nextitem):
    """A SHARED fixture's tests wait for the whole fixture (every notebook; every exercise's run:
    about 3 minutes here, five times that on a CPU five times slower). They get pytest-timeout's
    limit times this CPU's measured slowdown against the reference CPU's (labkit.measure.pace,
    measured once per worker, only where such a test runs), so that they end on a slow CPU too;
    a hang still ends."""
    group = item.get_closest_marker("xdist_group")
    if group is not None and group.args[0] in SHARED and item.get_closest_marker("timeout") is None:
        try:
            limit = float(item.config.getini("timeout") or 0)
        except ValueError:  # pytest-timeout not installed: no limit to scale
            limit = 0.0
        if limit:
            from labkit.measure.pace import measure_pace

            item.add_marker(pytest.mark.timeout(limit * max(1.0, measure_pace().slowdown)))
    yield


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
FAST = {"min_run_time_s": 0.0, "warmup": 0, "min_repeats": 1}
# Exercises whose evidence is read off the wall clock against a fixed figure: (variant, metric,
# a value the check accepts, one it rejects). Under a CPU quota (a 2-core CPU five times slower,
# emulated) the throttled process measured the GPipe bubble at 0.13 against its 0.2 bound and the
# data time at 44 ms against the stated 100, so their checks are tested on the real run's rows
# with that one figure set on either side of the margin, not on this machine's clock.
WALL_CLOCK = {"pipeline_bubble": ("gpipe", "bubble_fraction_mean", 0.25, 0.1),
              "data_wait": ("baseline", "data_ms", 110.0, 30.0)}
# The tiny preset narrowed (width 256 -> 128, MLP 688 -> 256, vocabulary 4096 -> 512): at 2 layers
# 426,624 parameters against 3,548,416 (planner.num_params), so a step's weights, gradients and
# AdamW states an eighth as large, for the tests whose assertions hold at any shape (bytes against
# formulas, outputs against the reference). A test whose claim is about the preset's own balance
# (where a peak falls, what a split saves, a peak within 1-2% of a plan that leaves a fixed few
# MiB out) adds TINY_SHAPE back.
NARROW = {"hidden_size": 128, "ffn_size": 256, "vocab_size": 512}
TINY_SHAPE = {k: getattr(MODELS["tiny"], k) for k in NARROW}
TINY_TRAIN = {**FAST, "batch_size": 1, "seq_len": 8, "steps": 1, "num_layers": 2, **NARROW}
TINY_DECODE = {**FAST, "prompt_len": 4, "new_tokens": 6, "num_layers": 2, **NARROW}
# Multi-process runs: every launch costs 6-12 s here (each rank imports torch), so a test module
# launches each experiment once (a module-scoped fixture) and asserts on those rows.
TINY_DIST = {**FAST, "timed_steps": 1, "batch_size": 2, "seq_len": 16, "num_layers": 2,
             "timeout_s": 60, **NARROW}


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


def one_row(rows, variant, metric, rank=0):
    """The one row of `variant`'s `metric` on `rank` (a launch's rows)."""
    hits = [r for r in rows if (r["variant"], r["metric"], r["rank"]) == (variant, metric, rank)]
    assert len(hits) == 1, (variant, metric, rank, hits)
    return hits[0]


def launch_fixtures(experiment: str, overrides: dict, sweep, clean: dict):
    """Module-scoped fixtures of one launch of `experiment` over `sweep`: `run` (every row) and
    `rows` (those of the points whose params are `clean`). Bind them at module level:
    `run, rows = launch_fixtures(...)`."""
    from labkit.harness.experiment import run_experiment

    @pytest.fixture(scope="module")
    def run(tmp_path_factory):
        return run_experiment(experiment, preset="tiny", overrides=overrides, sweep=sweep,
                              runs_dir=str(tmp_path_factory.mktemp("runs")), progress=False).rows

    @pytest.fixture(scope="module")
    def rows(run):
        return [r for r in run if all(r["params"][k] == v for k, v in clean.items())]

    return run, rows


def fault_fixtures(experiment: str, overrides: dict):
    """`launch_fixtures` swept over FAULTS, and `corrupted` (fault_rank's gradient reduction
    spoiled): `run, rows, corrupted = fault_fixtures(...)`."""
    run, rows = launch_fixtures(experiment, overrides, FAULTS, {"fault": "none"})

    @pytest.fixture(scope="module")
    def corrupted(run):
        return [r for r in run if r["params"]["fault"] == "corrupt_reduction"]

    return run, rows, corrupted


# Each notebook's own parameters on top of report mode: sizes that finish in seconds, and one
# variant beside the reference where the experiment's own tests run every variant. What they
# leave unset, the report's plan sizes at a budget no notebook fits: the smallest it has, on any CPU.
TEST_BUDGET_S = 1.0
PARAMETERS = {
    "00_environment": {},
    "01_mixed_precision": {"overrides": {**TINY_TRAIN, "batch_size": 2}, "variants": "bf16_weights"},
    "02_kv_cache": {"overrides": TINY_DECODE},
    "03_checkpointing": {"overrides": {**NARROW, **FAST, "batch_size": 1, "seq_len": 8,
                                       "num_layers": 2},
                         "variants": "full"},
    "04_grad_accumulation": {"overrides": {**NARROW, **FAST, "batch_size": 1, "seq_len": 8,
                                           "num_layers": 2},
                                   "sweep": {"micro_batches": [1, 2]}},
    "05_offload": {"overrides": TINY_TRAIN},
    "06_memory_pool": {"overrides": {**NARROW, **FAST, "num_layers": 2, "prompt_len": 8, "new_tokens": 6,
                                           "batch_size": 1}},
    "07_batch_finder": {"overrides": {**FAST, "num_layers": 2, "mode": "dynamic"}, "seq_lens": [16, 32],
                              "cpu_budget_gib": 0.062, "variants": "fp32_ckpt"},
    "08_memory_planner": {"check_overrides": {**TINY_TRAIN, "batch_size": 2}, "device": "cpu",
                          "nproc": 2},  # the measured worked example on 2 ranks, not 4
    "09_collectives": {"overrides": {**FAST, "timed_steps": 1}, "sweep": {"message_bytes": [4096]},
                             "variants": "all_gather", "nproc": 2},
    "10_data_parallel": {"overrides": TINY_DIST, "variants": "ddp", "nproc": 2},
    "11_zero": {"overrides": TINY_DIST, "variants": "zero3", "nproc": 2},
    "12_tensor_parallel": {"overrides": TINY_DIST, "variants": "tp", "nproc": 2},
    "13_pipeline_parallel": {"overrides": TINY_DIST, "sweep": {"micro_batches": [2]},
                                   "variants": "zero_bubble", "nproc": 2},
    "14_hybrid": {"overrides": {**TINY_DIST, "batch_size": 4, "num_layers": 1, "timed_steps": 1},
                        "variants": "fsdp_tp", "nproc": 4},
    "15_load_balance": {"overrides": {**TINY_DIST, "calibration_steps": 1}, "nproc": 2},
    "16_batching": {"overrides": {**NARROW, "num_requests": 6, "max_output_len": 12, "arrival": "closed",
                                        "batch_size": 3, "num_layers": 2}, "variants": "continuous"},
    "17_attention": {"overrides": {**FAST, "batch_size": 1, "hidden_size": 64, "num_heads": 4,
                                         "num_kv_heads": 2}, "sweep": {"seq_len": [64, 128]},
                           "variants": "sdpa"},
    "18_compile": {"overrides": {**FAST, "num_layers": 1, "hidden_size": 32, "num_heads": 2,
                                       "num_kv_heads": 1, "ffn_size": 64, "vocab_size": 64,
                                       "batch_size": 2, "seq_len": 8, "prompt_len": 4,
                                       "decode_steps": 4, "probe_calls": 2, "inductor_cache": True},
                         "variants": "default"},
    "19_fused_kernel": {"overrides": {**FAST, "hidden_size": 96}, "sweep": {"rows": [64]},
                              "variants": "triton"},
    "20_matmul": {"overrides": {**FAST, "size": 128}},
    # the one notebook with its panel shown, as JupyterLab runs it (test_interactive_mode_shows_the_panel)
    "21_memory_access": {"overrides": {**FAST, "size_mib": 1}, "sweep": {"stride": [2, 4]}, "interactive": True},
    "22_profiling": {"overrides": {**TINY_TRAIN, "overhead_repeats": 1, "memory_timeline": False},
                           "variants": "profiler"},
    "23_dataloading": {"overrides": {**NARROW, **FAST, "batch_size": 2, "seq_len": 16, "num_layers": 2,
                                           "steps": 2, "sample_cost_us": 5000.0, "epoch_steps": 50,
                                           "min_run_time_s": 0.1},
                             "variants": "workers"},
    "24_threads": {"overrides": {**FAST, "size": 128, "threads": 2}, "variants": "set_num_threads,omp_env"},
    "25_quiz": {"n": 3, "seed": 0},
    "26_recipe": {"overrides": TINY_DIST, "nproc": 2, "ladder_steps": {"checkpointing": "full"}},
    "27_weight_quant": {"overrides": TINY_DECODE, "variants": "int4"},
    "28_speculative": {"overrides": {**NARROW, **FAST, "num_layers": 2, "prompt_len": 8,
                                     "new_tokens": 16},
                       "variants": "prompt_lookup"},
    "29_sla": {"overrides": {**NARROW, "num_requests": 6, "max_output_len": 8, "num_layers": 2,
                             "search_steps": 2},
               "variants": "continuous", "pareto_batch_sizes": [2], "pareto_variants": "continuous"},
    "30_finetune": {"overrides": TINY_TRAIN, "variants": "qlora", "frontier_cpu_budget_gib": 0.001,
                    "frontier_seq_step": 64, "frontier_overrides": {"batch_size": 1, "num_layers": 1, "vocab_size": 256,
                                                                    "hidden_size": 64, "ffn_size": 128, "max_seq_len": 256}},
    "31_packing": {"overrides": {**NARROW, **FAST, "num_layers": 2, "batch_size": 6, "seq_len": 64},
                   "variants": "packed"},
    "34_moe": {"overrides": {**TINY_DIST, "timed_steps": 1}, "sweep": {"capacity_factor": [1.0, 2.0]},
               "variants": "ep", "nproc": 2},
    "32_fp8": {"overrides": {**NARROW, **FAST, "num_layers": 2, "seq_len": 32},
               "variants": "fp8_tensorwise"},
    "33_context_parallel": {"overrides": {**NARROW, **FAST, "timed_steps": 1, "batch_size": 1,
                                          "seq_len": 64},
                            "nproc": 2},
    "35_grad_compression": {"overrides": {**TINY_DIST, "timed_steps": 1, "steps": 2, "num_layers": 1,
                                          "vocab_size": 512, "hidden_size": 128, "ffn_size": 256},
                            "variants": "int8", "nproc": 2},
    "98_leaderboard": {"metric": "tokens_per_s"},  # reads the runs the others stored in this report
    "99_compare": {"price_per_gpu_hour": 2.0},
}


@pytest.fixture(scope="session")
def report(tmp_path_factory):
    """The whole report, once, at the plan's smallest sizes: every notebook outside
    notebooks/exercises/ (test_notebooks.py reads all of it, test_browser.py one page). On one
    kernel: the other core runs the other worker's tests, and a second kernel would import and
    warm up everything again (95 CPU-s on one kernel against 115 on two, at 90 s against 80)."""
    from labkit.report import run_report

    return run_report(tmp_path_factory.mktemp("report"), preset="tiny", parameters=PARAMETERS,
                      budget_s=TEST_BUDGET_S, jobs=1, progress=False)


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    """Every Run behind the exercises measured once per session, into one folder that the
    exercise tests and notebooks reuse (exercises that share a Run share its rows)."""
    from labkit.study import exercises

    folder = tmp_path_factory.mktemp("exercise-runs")
    for run in exercises.RUNS.values():
        exercises.measure(run, "cpu", str(folder), reuse=False)
    return str(folder)


@pytest.fixture(scope="session")
def notebook_kernel(tmp_path_factory):
    """One warm kernel of one thread for the exercise and lab notebooks (labkit.report.kernel:
    its imports are paid once a session, not once a notebook or a module; the suite's other
    worker has the other core). Their tests share a worker: they all read `shared_runs`."""
    from labkit.report.kernel import WarmKernel

    cwd = tmp_path_factory.mktemp("notebook-kernel")
    with WarmKernel(cwd, cwd / "kernel.log", threads=1) as kernel:
        yield kernel


def execute_notebooks(kernel, jobs):
    """Execute `jobs` ((path, output, parameters) each) in order on `kernel` (`notebook_kernel`);
    returns each notebook's printed text, in order."""
    import nbformat

    for path, out, parameters in jobs:
        kernel.execute(path, out, parameters)
    texts = []
    for _, out, _ in jobs:
        nb = nbformat.read(out, as_version=4)
        texts.append("".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                             for o in c.outputs))
    return texts
