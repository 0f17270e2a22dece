"""One Jupyter kernel that executes notebook after notebook, so that Python, torch, labkit and
plotly are imported once and not once a notebook (a fresh kernel costs about 2.6 s on the
reference CPU before the first cell, five times that on a CPU five times slower; a report runs
33 notebooks, the exercises 58).

Between two notebooks the kernel forgets the first one's names (`%reset -f` keeping `__spec__`,
which multiprocessing reads; then a garbage collection that leaves what survives it out of later
ones, `freeze_survivors`; and on a GPU the caching allocator's blocks are handed back, since two
kernels share the card) and goes back to `cwd`; imported modules stay, as they would in a
person's session. A kernel that died or timed out is replaced by a fresh one for the next
notebook. The kernel's stderr (and that of the ranks it starts) goes to `log`, each notebook's
part headed by its name.

A kernel computes on its own core slot: `threads` intra-op threads (`OMP_NUM_THREADS`) and as
many Inductor compile workers, unless the environment sets them. Two kernels of two threads each
on two cores oversubscribe them, and an OpenMP barrier then spins waiting for a descheduled
thread: beside 18_compile, 30_finetune's memory search took 8.6 s instead of 3.0 s.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

# jsonschema imports rfc3987_syntax for its `iri` format checks, and that module builds about 35
# Earley parsers as it loads: 1.3 CPU-s on the reference CPU (python-jsonschema/jsonschema#1428),
# paid by every process that imports nbformat (papermill, nbconvert and plotly's figure output
# do), for a format that no notebook's schema uses.
IRI_MODULE = "rfc3987_syntax"


def defer_iri_grammar() -> None:
    """Put a stand-in for rfc3987_syntax where imports find it, whose attributes load the real
    module on first use: `is_valid_syntax` (what jsonschema takes) is a function that does, so an
    `iri` check still gives the real module's answer. Nothing where it is loaded or missing."""
    if IRI_MODULE in sys.modules or importlib.util.find_spec(IRI_MODULE) is None:
        return
    stand_in = types.ModuleType(IRI_MODULE)

    def load() -> Any:  # the real module, which takes the stand-in's place on the first call
        if sys.modules.get(IRI_MODULE) is stand_in:
            del sys.modules[IRI_MODULE]
        return importlib.import_module(IRI_MODULE)

    def attribute(name: str) -> Any:
        if name.startswith("__"):  # what the import system asks of any module (__path__, ...)
            raise AttributeError(name)
        return getattr(load(), name)

    def is_valid_syntax(*args: Any, **kwargs: Any) -> Any:
        return load().is_valid_syntax(*args, **kwargs)

    stand_in.__getattr__, stand_in.is_valid_syntax = attribute, is_valid_syntax  # type: ignore[attr-defined]
    sys.modules[IRI_MODULE] = stand_in


def _manager() -> Any:
    """A kernel manager whose every new client first closes the one before it: nbclient asks for
    a client per notebook and leaves its sockets open when it does not own the kernel."""
    from jupyter_client.manager import AsyncKernelManager

    class OneClientAtATime(AsyncKernelManager):
        last = None

        def client(self, **kwargs: Any) -> Any:
            if self.last is not None:
                self.last.stop_channels()
            self.last = super().client(**kwargs)
            return self.last

    return OneClientAtATime(kernel_name="python3")


# the kernel's threads: torch's intra-op threads, and Inductor's compile workers
THREAD_ENV = ("OMP_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS")
# Run in a kernel as it starts, before anything imports nbformat
STARTUP = "from labkit.report.kernel import defer_iri_grammar; defer_iri_grammar()"
# What every notebook's first cells import (torch, labkit's harness, the panel and the plots):
# imported by `warm`, before the first notebook, which would otherwise hold their seconds
WARM_IMPORTS = "import labkit.harness.experiment, labkit.ui.widgets, labkit.views.plots"
WARM_TIMEOUT_S = 600  # those imports take seconds; on a slow CPU beside other work, a minute
RESET = """
def _labkit_reset(spec=__spec__):  # what %reset -f does, keeping __spec__ for multiprocessing
    import os, sys
    from labkit.measure.memory import freeze_survivors
    get_ipython().reset(new_session=False)
    get_ipython().user_ns["__spec__"] = spec
    freeze_survivors()  # what is left (modules, the kernel) lives on: later collections skip it
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()  # the GPU memory the last notebook cached, for the other kernel
    os.chdir({cwd!r})
_labkit_reset()
"""


class WarmKernel:
    """A python3 kernel started on first use, in `cwd`, writing its stderr to `log`, computing on
    `threads` threads (None: torch's default, all the cores)."""

    def __init__(self, cwd: str | Path, log: str | Path, threads: int | None = None):
        self.cwd, self.log, self.threads = str(cwd), Path(log), threads
        self.km: Any = None

    def execute(self, path: str | Path, output: str | Path, parameters: dict[str, Any],
                **papermill_kwargs: Any) -> None:
        """Execute the notebook at `path` with `parameters` into `output` (papermill: its errors
        are papermill's), in this kernel after forgetting the last notebook's names."""
        import papermill

        self._ready(Path(path).stem)
        try:  # the output written once, at the end, failed or not (papermill's finally), not after every cell
            papermill.execute_notebook(str(path), str(output), parameters=parameters,
                                       kernel_name="python3", km=self.km, progress_bar=False,
                                       store_widget_state=False, request_save_on_cell_execute=False,
                                       **papermill_kwargs)
        except papermill.PapermillExecutionError:
            raise  # a cell raised: the kernel itself is fine
        except BaseException:
            self.shutdown()  # dead, hung or interrupted: the next notebook gets a fresh kernel
            raise

    def warm(self) -> None:
        """Start the kernel and make its imports (WARM_IMPORTS) now, so that they are the
        report's seconds and not its first notebook's."""
        self._ready("(start)")
        self._run(WARM_IMPORTS, timeout=WARM_TIMEOUT_S, what="warmed")

    def _ready(self, stem: str) -> None:
        from jupyter_core.utils import run_sync

        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as f:
            f.write(f"--- {stem}\n")
            if self.km is None or not run_sync(self.km.is_alive)():
                self.km = _manager()
                run_sync(self.km.start_kernel)(cwd=self.cwd, stderr=f, env=self._env())
                self._run(STARTUP, what="started")
                return
        self._run(RESET.format(cwd=self.cwd))

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.threads:
            for name in THREAD_ENV:
                env.setdefault(name, str(self.threads))
        return env

    def _run(self, code: str, timeout: float = 60, what: str = "reset") -> None:
        """Run `code` in the kernel and wait for it (an error in it is an error here)."""
        from jupyter_core.utils import run_sync

        client = self.km.client()
        client.start_channels()
        reply = run_sync(client.execute_interactive)(code, store_history=False, timeout=timeout,
                                                     output_hook=lambda msg: None)
        if reply["content"]["status"] != "ok":
            raise RuntimeError(f"the kernel could not be {what}: {reply['content'].get('evalue')}")

    def shutdown(self) -> None:
        from jupyter_core.utils import run_sync

        if self.km is not None:
            try:
                if self.km.last is not None:
                    self.km.last.stop_channels()
                run_sync(self.km.shutdown_kernel)(now=True)
            finally:
                self.km = None

    def __enter__(self) -> WarmKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def pid_log(folder: str | Path) -> Path:
    """This process's kernel log in `folder`: `kernel-<pid>.log`."""
    return Path(folder) / f"kernel-{os.getpid()}.log"
