"""`labkit report`: every notebook executed by papermill in report mode, rendered to HTML pages that
open offline, with an index page. The only module that imports papermill and nbconvert.

The report folder holds:

- `<stem>.ipynb`: each executed notebook (kept when it failed: the error is in it);
- `<stem>.html`: each executed notebook rendered by nbconvert (the partial one too);
- `plotly.min.js`: plotly.js, shipped once; every page loads it with a relative `<script>`;
- `index.html` (written by `labkit.report.index`): provenance (device, versions, commit, date),
  every notebook's status, time and page (a failed one with its error's last line), and each
  experiment's headline numbers, measured beside predicted, read from the runs the notebooks
  stored in this report;
- `results.csv` and `summary.md`: those runs' rows as a table and as text;
- `runs/`: the results store (unless `runs_dir` names another);
- `logs/kernel-<pid>.log`: what each kernel (and the ranks it started) wrote to stderr, each
  notebook's part headed by its name.

Report mode gives each notebook `interactive=False` (no widget panel: the default sweep and
static figures) and `preset`, `device`, `runs_dir`, `overrides` where set, each only to notebooks
that have that parameter (papermill's `inspect_notebook`); on a CPU, a few notebooks also get the
lighter sweeps of `CPU_REPORT_PARAMETERS`. Kernels are `python3`, widget state
is not stored, and the kernels' working directory is the report folder (a trace a notebook
writes lands beside its page). Each worker keeps its kernel from one notebook to the next
(`labkit.report.kernel`: the names are reset, the imports kept), so torch, labkit and plotly are
imported once a core slot, not once a notebook.

Offline pages: in a kernel, plotly's renderer stores a figure as `application/vnd.plotly.v1+json`
only, which nbconvert cannot draw; `with_plotly_html` adds a `text/html` twin drawn by
`plotly.io.to_html` without plotly.js, to the copy being rendered (the .ipynb stays small). The
page template (`TEMPLATE`) replaces require.js with the local plotly.min.js (with require.js on
the page plotly.js registers as an AMD module and never defines `Plotly`), and drops MathJax and
mermaid (CDN scripts; no notebook has math or diagrams) and the widget manager (report mode
stores no widget state).

Notebooks run in worker processes, each holding its warm kernel, on `jobs` core slots (default: the
cores this process may use): a notebook takes a slot per rank it starts, at most all of them, so
two multi-rank notebooks never share two cores, and a kernel computes on its slot's share of
the cores (`labkit.report.kernel`); notebooks numbered from `LAST_FROM` on read the
store, so they start once every other notebook has finished. On a CPU each notebook is sized before
it runs to its share of the report's seconds target, from this CPU's measured pace
(`labkit.report.plan`); the index shows each notebook's predicted seconds beside its measured ones.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from labkit import hardware
from labkit.config import ConfigError, usable_threads
from labkit.report.plan import LAST_FROM, REPORT_TARGET_S, number, plan_notebooks, start_order
from labkit.results import now

if TYPE_CHECKING:
    from labkit.techniques import Experiment

NOTEBOOKS_DIR = hardware.REPO_DIR / "notebooks"
# Report mode on a CPU: lighter sweeps than the notebooks' interactive defaults, each still showing
# its technique against its reference, so that every notebook at the tiny preset runs within 10
# minutes on 2 cores (two at a time). A notebook's own `parameters` (run_report's) replace these.
CPU_REPORT_PARAMETERS: dict[str, dict[str, Any]] = {
    # a search per length and variant: the endpoints, in the CLI's tiny budget
    "07_batch_finder": {"seq_lens": [16, 64], "cpu_budget_gib": 0.2},
    "10_data_parallel": {"overrides": {"timed_steps": 3}},  # seven variants, two ranks each
    "13_pipeline_parallel": {"sweep": {"micro_batches": [1, 2, 4]}},
    "17_attention": {"sweep": {"seq_len": [256, 1024]}},  # naive at 1024 is the costly point
    "21_memory_access": {"sweep": {"stride": [2, 16]}},
}
PLOTLY_MIME = "application/vnd.plotly.v1+json"

# nbconvert's lab page without network scripts; a link back to the index on every page.
TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}<script src="plotly.min.js"></script>{%- endblock -%}
{%- block jupyter_widgets -%}{%- endblock -%}
{%- block html_head_js_mathjax -%}{%- endblock -%}
{%- block html_head_js_mermaidjs -%}{%- endblock -%}
{%- block body_header -%}{{ super() }}<p><a href="index.html">labkit report: index</a></p>{%- endblock -%}
"""


@dataclass
class NotebookRun:
    stem: str
    title: str
    status: str = "not run"  # "ok" or "failed"
    seconds: float = 0.0
    error: str = ""  # the error's last line
    note: str = ""  # settings left out, as its experiment does not take them
    predicted_s: float = float("nan")  # the plan's seconds for it on this CPU (nan: not planned)
    sizing: str = ""  # why the plan sized it down
    level: int = 0  # 0: its report parameters; n: its n-th smaller size (labkit.report.plan)
    ranks: int = 1


@dataclass
class Report:
    out: Path
    notebooks: list[NotebookRun] = field(default_factory=list)
    seconds: float = 0.0
    cores: int = 1  # the core slots the notebooks ran on

    @property
    def failed(self) -> list[NotebookRun]:
        return [n for n in self.notebooks if n.status != "ok"]


def find_notebooks(folder: str | Path | None = None) -> dict[str, Path]:
    """The notebooks directly in `folder` by stem, in order (notebooks/exercises/ is not reported)."""
    return {p.stem: p for p in sorted(Path(folder or NOTEBOOKS_DIR).glob("*.ipynb"))}


def choose_notebooks(found: dict[str, Path], only: list[str] | None) -> list[str]:
    """The stems `only` names, as notebook stems (`20_matmul`) or experiment names (`matmul`);
    every notebook when empty. An unknown name: one line naming the valid ones."""
    if not found:
        raise ConfigError(f"no notebooks found at {NOTEBOOKS_DIR}: labkit report runs from a source checkout")
    if not only:
        return list(found)
    by_name = {exp.name: stem for stem, exp in notebook_experiments().items() if stem in found}
    chosen = []
    for name in only:
        stem = name if name in found else by_name.get(name)
        if stem is None:
            raise ConfigError(f"unknown experiment or notebook {name!r}; valid: {', '.join(by_name)} "
                              f"(or a notebook: {', '.join(found)})")
        chosen += [] if stem in chosen else [stem]
    return chosen


def notebook_experiments() -> dict[str, Experiment]:
    """The experiment each experiment notebook belongs to, by notebook stem
    (`labkit.techniques.by_notebook`)."""
    from labkit.techniques import by_notebook

    return by_notebook()


def settings_of(exp: Experiment) -> set[str]:
    """The settings (run and model-shape fields) experiment `exp` takes."""
    from labkit.config import ModelConfig

    return {f.name for cls in (exp.Config, ModelConfig) for f in dataclasses.fields(cls)
            if not f.metadata.get("internal")}  # what only a config.json sets


def experiment_settings(stem: str) -> set[str] | None:
    """The settings the experiment of notebook `stem` takes; None for a notebook that is not one
    experiment's (00_environment, 08_memory_planner, ...)."""
    from labkit.techniques import notebook_names, record

    name = notebook_names().get(stem)
    return None if name is None else settings_of(record(name))


def check_settings(keys: list[str]) -> None:
    """A setting no experiment takes: one line naming the valid ones."""
    from labkit.techniques import records

    valid = set().union(*(settings_of(exp) for exp in records().values()))
    for key in keys:
        if key not in valid:
            raise ConfigError(f"unknown setting {key!r}; valid: {', '.join(sorted(valid))}")


def notebook_parameters(known: dict[str, Any], common: dict[str, Any], own: dict[str, Any],
                        accepted: set[str] | None = None) -> tuple[dict[str, Any], list[str]]:
    """The report-mode parameters a notebook has (`known`, from inspect_notebook): the `common`
    ones that are set, then the notebook's `own`, whose `overrides` go over the common ones. Common
    overrides its experiment does not take (`accepted`) are left out: returned second."""
    params = {k: v for k, v in common.items() if k in known and v is not None and v != {}}
    shared = common.get("overrides", {})
    left_out = [k for k in shared if accepted is not None and k not in accepted]
    overrides = {**{k: v for k, v in shared.items() if k not in left_out}, **own.get("overrides", {})}
    params.update(own)
    if "overrides" in known and overrides:
        params["overrides"] = overrides
    return params, left_out if "overrides" in known else []


def run_report(out: str | Path, *, preset: str | None = None, device: str | None = None,
               overrides: dict[str, Any] | None = None, runs_dir: str | Path | None = None,
               only: list[str] | None = None, parameters: dict[str, dict[str, Any]] | None = None,
               notebooks_dir: str | Path | None = None, jobs: int | None = None,
               budget_s: float | None = REPORT_TARGET_S, dry_run: bool = False,
               progress: bool = True) -> Report:
    """Execute the notebooks (all by default; `only`: stems or experiment names) and write the
    report folder. `parameters`: a notebook's own papermill parameters, by stem. `jobs`: core
    slots (default: the cores this process may use), a notebook taking one per rank. On a CPU
    at the tiny preset each notebook is sized to its share of `budget_s` before it runs (None:
    never); `dry_run` plans and returns without running. A notebook that fails is reported; the
    others still run (see `Report.failed`)."""
    from labkit.measure.pace import handed_down
    from labkit.report.kernel import defer_iri_grammar

    defer_iri_grammar()  # before papermill imports nbformat
    import papermill

    out = Path(out).resolve()
    runs_dir = Path(runs_dir or out / "runs").resolve()
    found = find_notebooks(notebooks_dir)
    stems = choose_notebooks(found, only)
    common = {"interactive": False, "preset": preset, "device": device, "runs_dir": str(runs_dir),
              "overrides": overrides or {}}
    known = {s: papermill.inspect_notebook(str(found[s])) for s in stems}
    report = Report(out, [NotebookRun(s, notebook_title(found[s])) for s in stems])
    own = {**(CPU_REPORT_PARAMETERS if _on_cpu(device) else {}), **(parameters or {})}
    params = {}
    for run in report.notebooks:
        params[run.stem], left_out = notebook_parameters(
            known[run.stem], common, own.get(run.stem, {}), experiment_settings(run.stem))
        run.note = f"not given (its experiment does not take them): {', '.join(left_out)}" if left_out else ""
    cores = report.cores = jobs or (usable_threads() if _on_cpu(device) else 2)  # GPU: 2 share it
    for run in report.notebooks:
        run.ranks = notebook_ranks(run.stem, params[run.stem], known[run.stem], cores)
    if budget_s and _on_cpu(device) and preset in (None, "tiny"):
        size_notebooks(report, params, known, set(common["overrides"]), cores, budget_s, parameters or {})
    if dry_run:
        return report
    out.mkdir(parents=True, exist_ok=True)
    started, t0 = now(), time.perf_counter()
    with handed_down() if _on_cpu(device) else contextlib.nullcontext():
        jobs_done = execute_all({s: found[s] for s in stems}, params, report.notebooks, out,
                                cores, progress)
    for run in report.notebooks:
        run.status, run.error, run.seconds = jobs_done[run.stem]
    report.seconds = time.perf_counter() - t0
    from labkit.report.index import write_outputs

    write_outputs(report, runs_dir, started, {k: v for k, v in common.items() if k != "runs_dir"})
    return report


def describe_report(report: Report, budget_s: float = REPORT_TARGET_S) -> str:
    """The plan as a table (`labkit report --dry-run`): each notebook's ranks, predicted seconds
    here and sizing, then the predicted wall time."""
    from labkit.measure.pace import measure_pace
    from labkit.report.plan import NotebookPlan, describe

    plans = [NotebookPlan(n.stem, n.ranks, predicted_s=n.predicted_s, level=n.level, note=n.sizing)
             for n in report.notebooks]
    return describe(plans, report.cores, measure_pace(), budget_s)


# Notebooks whose work runs on every core in one process (24_threads: its variants ask for
# os.cpu_count() threads): they hold every core slot, so that no notebook runs beside them, which
# would take a core from their threads and spoil the speed-ups they measure
EVERY_CORE = ("24_threads",)


def notebook_ranks(stem: str, params: dict[str, Any], known: dict[str, Any], cores: int) -> int:
    """The core slots a notebook keeps busy: every one for EVERY_CORE, else its `nproc` when
    given, else its experiment's CPU rank count; a notebook without that parameter runs in its
    kernel alone."""
    from labkit.techniques import notebook_names, record

    if stem in EVERY_CORE:
        return cores
    if "nproc" not in known:
        return 1
    if params.get("nproc"):
        return int(params["nproc"])
    from labkit.harness import ladder

    name = notebook_names().get(stem)
    return record(name).cpu_ranks if name else ladder.cpu_ranks()  # 08_memory_planner's ladder


def size_notebooks(report: Report, params: dict[str, dict[str, Any]], known: dict[str, dict],
                   user_set: set[str], cores: int, budget_s: float,
                   by_caller: dict[str, dict[str, Any]]) -> None:
    """Plan every notebook on this CPU's pace (`labkit.report.plan`) and give each one that is
    sized down its smaller parameters, never over a setting its parameters already hold (given
    by hand, by the report's CPU parameters or by the caller) or sweep, nor over a parameter the
    caller gave (`by_caller`, by stem)."""
    from labkit.measure.pace import measure_pace
    from labkit.techniques import notebook_names

    names = notebook_names()
    given = {s: user_set | set(params[s].get("sweep") or {}) | set(params[s].get("overrides") or {})
             | (set(by_caller.get(s, {})) - {"overrides"}) for s in params}
    plans = plan_notebooks(params, {s: names.get(s) for s in params}, known,
                           {r.stem: r.ranks for r in report.notebooks}, given, measure_pace(), cores,
                           budget_s)
    for run, plan in zip(report.notebooks, plans):
        run.predicted_s, run.sizing, run.level = plan.predicted_s, plan.note, plan.level
        params[run.stem].update(plan.settings)


def _on_cpu(device: str | None) -> bool:
    from labkit.config import resolve_device

    return resolve_device(device or "auto") == "cpu"


def execute_all(paths: dict[str, Path], params: dict[str, dict], runs: list[NotebookRun], out: Path,
                cores: int, progress: bool) -> dict[str, tuple[str, str, float]]:
    """Run the notebooks on `cores` core slots, each notebook holding one per rank it starts (at
    most all of them), in the plan's order (`plan.start_order`); returns (status, error,
    seconds) by stem."""
    queue = sorted(runs, key=lambda r: start_order(r.stem, r.ranks, r.predicted_s))
    pending, running, done = [r.stem for r in queue], {}, {}
    need = {r.stem: min(r.ranks, cores) for r in runs}
    threads = max(1, usable_threads() // cores)  # a kernel's own: its slot's share of the cores

    def ready(stem: str) -> bool:
        active = list(running.values())
        if number(stem) >= LAST_FROM and any(number(s) < LAST_FROM for s in pending + active):
            return False
        return not active or sum(need[s] for s in active) + need[stem] <= cores

    with ProcessPoolExecutor(max(1, cores), mp_context=multiprocessing.get_context("spawn"),
                             initializer=warm_worker, initargs=(str(out), threads)) as pool:
        while pending or running:
            while (stem := next(filter(ready, pending), None)):
                pending.remove(stem)  # one at a time: `ready` sees the ones just started
                running[pool.submit(execute_notebook, str(paths[stem]), str(out / f"{stem}.ipynb"),
                                    params[stem], str(out), threads)] = stem
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                stem = running.pop(future)
                try:
                    done[stem] = future.result()
                except Exception as e:  # the worker process died: reported, the others go on
                    done[stem] = ("failed", _last_line(f"{type(e).__name__}: {e}"), 0.0)
                if progress:
                    status, error, seconds = done[stem]
                    print(f"[{len(done)}/{len(paths)}] {stem}: {status} in {seconds:.1f} s"
                          + (f" ({error})" if error else ""), file=sys.stderr)
    return done


def _last_line(text: str) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


_KERNEL = None  # this worker process's kernel (labkit.report.kernel): one per core slot


def worker_kernel(cwd: str, threads: int | None) -> Any:
    """This worker process's kernel, made on first use (`warm_worker` starts it)."""
    import atexit

    from labkit.report.kernel import WarmKernel, pid_log

    global _KERNEL
    if _KERNEL is None:
        _KERNEL = WarmKernel(cwd, pid_log(Path(cwd) / "logs"), threads)
        atexit.register(_KERNEL.shutdown)
    return _KERNEL


def warm_worker(cwd: str, threads: int | None) -> None:
    """A worker process's start: its kernel started and warmed (`WarmKernel.warm`) before its
    first notebook, whose seconds then hold only its own work."""
    from labkit.report.kernel import defer_iri_grammar

    defer_iri_grammar()  # before papermill imports nbformat here
    kernel = worker_kernel(cwd, threads)
    try:
        kernel.warm()
    except Exception:  # the first notebook starts a fresh kernel and reports what fails
        kernel.shutdown()


def execute_notebook(path: str, output: str, parameters: dict[str, Any], cwd: str,
                     threads: int | None = None) -> tuple[str, str, float]:
    """Execute one notebook (in a worker process, in its warm kernel of `threads` threads), then
    render what it holds, finished or not; returns (status, the error's last line, seconds)."""
    import papermill

    kernel = worker_kernel(cwd, threads)
    status, error, t0 = "ok", "", time.perf_counter()
    try:
        kernel.execute(path, output, parameters)
    except papermill.PapermillExecutionError as e:
        status, error = "failed", f"{e.ename}: {_last_line(e.evalue)}"
    except Exception as e:  # a dead or timed-out kernel: reported on the index, the others go on
        status, error = "failed", _last_line(f"{type(e).__name__}: {e}")
    seconds = time.perf_counter() - t0
    if Path(output).exists():
        Path(output).with_suffix(".html").write_text(render_html(Path(output)))
    return status, error, seconds


def with_plotly_html(nb) -> Any:
    """A copy of notebook `nb` in which every plotly figure also has a `text/html` form: a div
    and the `Plotly.newPlot` call, without plotly.js (the page loads it once)."""
    import copy

    import plotly.io as pio

    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            figure = output.get("data", {}).get(PLOTLY_MIME)
            if figure is not None and "text/html" not in output["data"]:
                output["data"]["text/html"] = pio.to_html(figure, include_plotlyjs=False,
                                                          full_html=False, validate=False)
    return nb


def render_html(path: Path) -> str:
    """The executed notebook at `path` as one page that loads only local files."""
    import nbformat

    body, _ = _exporter().from_notebook_node(with_plotly_html(nbformat.read(path, as_version=4)))
    return body


@functools.lru_cache(maxsize=1)
def _exporter() -> Any:
    """One HTML exporter a process: its templates are compiled once, not once a notebook."""
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    exporter.raw_template = TEMPLATE
    return exporter


def notebook_title(path: Path) -> str:
    """The first heading of the notebook's first markdown cell."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    text = next((c.source for c in nb.cells if c.cell_type == "markdown"), path.stem)
    return (text.strip().splitlines() or [path.stem])[0].lstrip("# ").strip()
