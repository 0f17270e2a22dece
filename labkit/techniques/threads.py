"""Threads: the knobs that decide how many CPU threads torch's operators use.

A CPU operator (a matmul, an elementwise add, a whole forward pass) is split across torch's
intra-op threads (an OpenMP pool in the x86 wheels; MKL's GEMM has its own thread count, which
torch keeps equal). Four knobs set that count, and they act at different times:
- `one_thread` (the reference): `torch.set_num_threads(1)`; what the lab's timings use, since
  two threads on two shared cores stall at random (OpenMP barriers waiting on a descheduled vCPU).
- `set_num_threads`: `torch.set_num_threads(n)` in this process; it can change at any time.
- `omp_env`: `OMP_NUM_THREADS=n`, read once when the process starts: measured in a fresh process.
- `mkl_env`: `MKL_NUM_THREADS=n` in a fresh process. torch reads it too, and it wins over
  `OMP_NUM_THREADS` (`at::intraop_default_num_threads`), so it sets every operator's count, not
  only MKL's; without MKL (`torch.backends.mkl.is_available()` False) only torch reads it.
- `interop`: `torch.set_num_interop_threads(n)` in a fresh process (it can be set once, before any
  inter-op work), with one intra-op thread. The inter-op pool runs `torch.jit.fork` tasks and
  TorchScript graphs, never eager operators, so the prediction is no speed-up at all.
Each variant reports the thread count torch says it has while the work runs (`num_threads_seen`:
the proof that the knob took effect), its output against the one-thread reference (the same
values: a GEMM split over threads gives the same sums), and `speedup`: the same work timed on one
thread in the same process right after, over its time at n. Predicted: min(n, physical cores) for
compute-bound work (`matmul`, `forward`), and for a memory-bound op (`elementwise`) the ratio of
the copy bandwidth measured at n threads to one thread (about 1 once one core saturates memory).
`serial_fraction` is Amdahl's f from the measured speed-up S: S = 1 / (f + (1 - f) / n).
Fresh processes get CUDA_VISIBLE_DEVICES="" (the work is on the CPU); where this machine has GPUs
a `num_gpus_seen` row shows the child saw none.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from labkit import hardware
from labkit.config import ConfigError, ModelConfig, RunConfig, knob
from labkit.blocks.model import build_model
# The timing of a knob read at process start must happen in that process: this module times
# its fresh processes itself, on the one clock, with the harness's Timing (see `child_main`).
from labkit.measure.clock import timed_calls
from labkit.measure.timer import Timing, cpu_threads, time_step
from labkit.workload import Comparison, Workload

VARIANTS = ("one_thread", "set_num_threads", "omp_env", "mkl_env", "interop")
REFERENCE = "one_thread"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"size": 512}, {"size": 256, "mib": 16.0})

WORKS = ("matmul", "elementwise", "forward")
ENV_VARIANTS = {"omp_env": "OMP_NUM_THREADS", "mkl_env": "MKL_NUM_THREADS"}
FRESH = ("omp_env", "mkl_env", "interop")  # measured in a fresh process
# Stripped from a fresh process's environment, so that only the variant's knob sets its threads.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# Shown in the note: what is set here (TORCH_NUM_THREADS is not read by torch; listed to say so).
KNOBS_SHOWN = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY",
               "OMP_PROC_BIND", "KMP_AFFINITY", "KMP_BLOCKTIME", "OPENBLAS_NUM_THREADS",
               "TORCH_NUM_THREADS")
RESULT_MARK = "LABKIT_THREADS_RESULT "
CHILD_TIMEOUT_S = 600
MAX_CALLS = 1000
RTOL = 1e-5  # of the output's largest magnitude: a different split may round a sum differently
_REPO = Path(__file__).resolve().parents[2]


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="how the thread count is set")
    work: str = knob("matmul", choices=WORKS, help="the CPU work timed")
    threads: int = knob(0, min=0, help="threads the variants ask for (0: os.cpu_count())")
    size: int = knob(1024, min=8, help="matmul: square matrix side")
    mib: float = knob(64.0, min=0.01, help="elementwise: MiB per operand (x + y -> out)")


def validate(cfg: Config) -> None:
    limit = 2 * (os.cpu_count() or 1)
    if cfg.threads > limit:
        raise ConfigError(f"threads={cfg.threads} is too many; valid: 0 (os.cpu_count()) or 1..{limit}")
    if cfg.num_threads != 1:
        raise ConfigError(f"threads sets its own thread counts: use threads=N, not num_threads="
                          f"{cfg.num_threads}; valid num_threads: 1")
    if cfg.dtype != "float32":
        raise ConfigError(f"threads runs float32 work; valid dtype: float32 (got {cfg.dtype})")


def skip_reason(cfg: Config) -> str | None:
    if cfg.device != "cpu":
        return f"threads times CPU-side work; run it with device=cpu (got {cfg.device})"
    return None


def requested(cfg: Config) -> int:
    return cfg.threads or os.cpu_count() or 1


def intra_threads(cfg: Config) -> int:
    """The intra-op threads the variant runs on (interop: one, its knob is the other pool)."""
    return 1 if cfg.variant in ("one_thread", "interop") else requested(cfg)


def physical_cores() -> int:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo; os.cpu_count() if unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.cpu_count() or 1
    cores, phys = set(), "0"
    for line in text.splitlines():
        key, _, value = (s.strip() for s in line.partition(":"))
        if key == "physical id":
            phys = value
        elif key == "core id":
            cores.add((phys, value))
    return len(cores) or os.cpu_count() or 1


# --- the work: the same seeded inputs in every process ------------------------------------------

def make_work(cfg: Config) -> Callable[[], torch.Tensor]:
    gen = torch.Generator().manual_seed(cfg.seed)
    if cfg.work == "matmul":
        a, b = (torch.randn(cfg.size, cfg.size, generator=gen) for _ in range(2))
        return lambda: torch.mm(a, b)  # (size, size)
    if cfg.work == "elementwise":
        n = elements(cfg)
        x, y, out = torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.empty(n)
        return lambda: torch.add(x, y, alpha=0.5, out=out)  # reads 2n, writes n floats
    model = build_model(cfg.model, seed=cfg.seed).eval()
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.seq_len), generator=gen)

    def forward() -> torch.Tensor:
        with torch.inference_mode():
            return model(tokens)  # (B, T, vocab) logits
    return forward


def elements(cfg: Config) -> int:
    return int(cfg.mib * 2**20) // 4


def per_step(cfg: Config) -> dict[str, float]:
    """The amounts one call moves or computes, as `Workload.per_second` takes them."""
    if cfg.work == "matmul":
        return {"tflops": 2 * cfg.size**3 / 1e12}
    if cfg.work == "elementwise":
        return {"gbps": 3 * elements(cfg) * 4 / 1e9}
    return {"tokens_per_s": float(cfg.batch_size * cfg.seq_len)}


def time_calls(fn: Callable[[], Any], warmup: int, min_run_time_s: float, min_repeats: int) -> Timing:
    """Each call timed on its own, touching no thread setting (the knob under test stays as set);
    CPU work only (skip_reason refuses another device)."""
    times = timed_calls(fn, device="cpu", warmup=warmup, min_run_time_s=min_run_time_s,
                        min_repeats=min_repeats, max_calls=MAX_CALLS)
    return Timing(times, warmup)


# --- fresh processes --------------------------------------------------------------------------------

def child_env(cfg: Config) -> dict[str, str]:
    """This environment without the thread knobs, plus the variant's knob; no GPU visible."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO), env.get("PYTHONPATH")) if p)
    if cfg.variant in ENV_VARIANTS:
        env[ENV_VARIANTS[cfg.variant]] = str(requested(cfg))
    return env


def run_child(cfg: Config) -> tuple[dict[str, Any], torch.Tensor]:
    """Measure `cfg` in a fresh Python process; its report and its output."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"params": cfg.params(), "threads": requested(cfg), "out": str(Path(tmp) / "out.pt")}
        done = subprocess.run([sys.executable, "-c", "from labkit.techniques.threads import child_main; "
                               "child_main()"], input=json.dumps(spec), env=child_env(cfg),
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, cwd=_REPO)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith(RESULT_MARK)]
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"the fresh process failed (exit {done.returncode}): {tail}")
        return json.loads(lines[-1][len(RESULT_MARK):]), torch.load(spec["out"])


def child_main() -> None:
    """In the fresh process: read the spec from stdin, set interop threads first if asked, time the
    work as the environment left it, then on one thread; print the report, save the output."""
    spec = json.loads(sys.stdin.read())
    params = dict(spec["params"])
    cfg = Config(**{k: v for k, v in params.items() if k != "model"}, model=ModelConfig(**params["model"]))
    if cfg.variant == "interop":
        torch.set_num_interop_threads(spec["threads"])  # before any inter-op work, or it raises
        torch.set_num_threads(1)
    seen = {"num_threads_seen": torch.get_num_threads(),
            "interop_threads_seen": torch.get_num_interop_threads()}
    fn = make_work(cfg)
    out = fn().clone()
    repeats = cfg.min_repeats or Workload.min_repeats  # the knob, else every experiment's own
    timing = time_calls(fn, cfg.warmup, cfg.min_run_time_s, repeats)
    torch.set_num_threads(1)
    one = time_calls(fn, cfg.warmup, cfg.min_run_time_s, repeats)
    torch.save(out, spec["out"])
    report = {**seen, "times_s": timing.times_s, "one_thread_times_s": one.times_s,
              "env": {k: os.environ.get(k) for k in KNOBS_SHOWN if k in os.environ},
              "num_gpus_seen": torch.cuda.device_count(), "devices": hardware.available_devices(),
              "mkl": torch.backends.mkl.is_available()}
    print(RESULT_MARK + json.dumps(report), flush=True)


# --- the experiment -------------------------------------------------------------------------------

def build(cfg: Config) -> Workload:
    return build_fresh(cfg) if cfg.variant in FRESH else build_in_process(cfg)


def build_in_process(cfg: Config) -> Workload:
    fn, n, seen = make_work(cfg), intra_threads(cfg), {}

    def step() -> torch.Tensor:
        with cpu_threads(n):  # the harness times on one thread; this variant's count inside
            seen["num_threads_seen"] = torch.get_num_threads()
            return fn()

    def report() -> dict[str, float]:
        out = {**seen, "interop_threads_seen": torch.get_num_interop_threads()}
        if cfg.variant == REFERENCE:
            return {**out, "speedup": 1.0}
        timing = dict(warmup=cfg.warmup, min_run_time_s=cfg.min_run_time_s)
        one, many = time_step(fn, num_threads=1, **timing), time_step(fn, num_threads=n, **timing)
        return {**out, **speedup_rows(one.median_s, many.median_s, n)}

    return Workload(step=step, check=lambda: {"out": step().clone()}, report=report,
                    per_second=per_step(cfg), notes=notes(cfg), count_flops=False)


def build_fresh(cfg: Config) -> Workload:
    child: dict[str, Any] = {}

    def check() -> dict[str, Any]:
        report, out = run_child(cfg)
        child.update(report)
        return {"out": out, "child": report}

    def report() -> dict[str, float]:
        timing = Timing(tuple(child["times_s"]), cfg.warmup)
        one = Timing(tuple(child["one_thread_times_s"]), cfg.warmup)
        out = {"step_ms": timing.median_ms, "step_iqr_ms": timing.iqr_s * 1e3,
               # the in-process step is empty: its memory readings mean nothing
               "peak_mem_bytes": None, "reserved_bytes": None, "nvml_used_bytes": None,
               "num_threads_seen": child["num_threads_seen"],
               "interop_threads_seen": child["interop_threads_seen"],
               **{m: amount / timing.median_s for m, amount in per_step(cfg).items()},
               **speedup_rows(one.median_s, timing.median_s, intra_threads(cfg))}
        if torch.cuda.is_available():  # meaningful only where this process sees GPUs
            out["num_gpus_seen"] = child["num_gpus_seen"]
        return out

    return Workload(step=lambda: None, check=check, report=report, notes=notes(cfg),
                    count_flops=False)


def speedup_rows(one_s: float, many_s: float, n: int) -> dict[str, float]:
    speedup = one_s / many_s
    out = {"one_thread_ms": one_s * 1e3, "speedup": speedup}
    if n > 1:
        out["serial_fraction"] = (n / speedup - 1) / (n - 1)  # Amdahl's f, from S and n
    return out


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The reference's values, up to a sum's rounding (RTOL of the largest magnitude)."""
    ref, out = reference["out"], outputs["out"]
    diff = (out - ref).abs().max().item()
    ok = out.shape == ref.shape and diff <= RTOL * ref.abs().max().item()
    return Comparison({"max_abs_diff": diff}, ok, "" if ok else f"outputs differ by up to {diff:.3g}")


def expected(cfg: Config) -> dict[str, float]:
    n = intra_threads(cfg)
    out = {"num_threads_seen": float(n), "max_abs_diff": 0.0}
    if cfg.variant == "interop":
        out["interop_threads_seen"] = float(requested(cfg))
    if cfg.variant in FRESH and torch.cuda.is_available():
        out["num_gpus_seen"] = 0.0
    if cfg.work == "elementwise":  # bandwidth-bound: the copy bandwidth at n threads over one
        ceil = [hardware.bandwidth_gbps("cpu", num_threads=k) for k in (1, n)]
        out["speedup"] = ceil[1] / ceil[0]
    else:
        out["speedup"] = float(min(n, physical_cores()))
    return out


def env_note() -> str:
    """Which thread and device knobs are set here, and what torch does with them."""
    set_here = [f"{k}={os.environ[k]!r}" for k in KNOBS_SHOWN if k in os.environ]
    return (f"Set here: {', '.join(set_here) or 'none of ' + ', '.join(KNOBS_SHOWN)}. torch "
            f"{torch.__version__}: {torch.get_num_interop_threads()} inter-op threads, MKL "
            f"{'available' if torch.backends.mkl.is_available() else 'absent'}, OpenMP "
            f"{'on' if torch.backends.openmp.is_available() else 'off'}; "
            f"{os.cpu_count()} logical CPUs, {physical_cores()} physical cores.")


def notes(cfg: Config) -> dict[str, str]:
    fresh = cfg.variant in FRESH
    how = ("timed in a fresh process, call by call, without touching its thread settings (median "
           "and IQR)" if fresh else "timed by the harness, the step setting its thread count inside")
    knob_text = {"one_thread": "torch.set_num_threads(1)",
                 "set_num_threads": f"torch.set_num_threads({requested(cfg)})",
                 "omp_env": f"OMP_NUM_THREADS={requested(cfg)} at process start",
                 "mkl_env": f"MKL_NUM_THREADS={requested(cfg)} at process start",
                 "interop": f"torch.set_num_interop_threads({requested(cfg)}), one intra-op thread"}
    return {
        "step_ms": f"{knob_text[cfg.variant]}; {how}. On 2 shared cores, 2 threads stall at "
                   "random: read the IQR.",
        "num_threads_seen": f"torch.get_num_threads() while the work ran. {env_note()}",
        "speedup": "the same work on one thread, timed in the same process right after, over its "
                   "time here. Predicted: min(n, physical cores) for matmul and forward; the copy "
                   "bandwidth at n threads over one thread for elementwise.",
        "serial_fraction": "Amdahl's f from the measured speed-up S at n threads: (n/S - 1)/(n - 1).",
        "num_gpus_seen": "torch.cuda.device_count() in the fresh process run with CUDA_VISIBLE_DEVICES=''.",
    }
