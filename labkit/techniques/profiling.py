"""Profiling: where one training step's time goes, and what looking costs.

One training step of the decoder, split into named phases: `data` (make the batch and move it to
the device), `forward`, `backward`, `optimizer`. Each phase is a `record_function` range (seen by
torch.profiler) and, on a GPU, an NVTX range (seen by Nsight Systems).

- `plain`: the step as is, the reference. On a GPU its second step runs between
  cudaProfilerStart and Stop, so `nsys --capture-range=cudaProfilerApi` records one steady step
  (the command is in the `step_ms` row's message).
- `profiler`: the same step under torch.profiler (CPU activity, CUDA too on a GPU, memory and
  shapes recorded). It reports the operator table's top operator and its share, how many
  operators ran, idle gaps on the timeline, how many ops are tiny, the data-loading share, the
  memory timeline's peak, and writes a Chrome trace (the `trace_bytes` row names its path). Its
  cost is measured against the plain step side by side: `profiler_overhead_pct`.
- `monitor`: the same step with a `DeviceMonitor` sampling in a background thread (NVML on a GPU;
  process CPU % and resident memory on the CPU), phases marked. It reports the samples taken
  against duration / interval and its own overhead.

Every variant computes the same losses as `plain` (profiling observes; it must not change the
numbers). This experiment's technique is measurement itself, so unlike the others it uses
`labkit.measure` (the profiler, the monitor and the timer).
"""
from __future__ import annotations

import functools
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


from labkit import hardware, planner
from labkit.config import RunConfig, knob, torch_dtype
from labkit.measure.monitor import DeviceMonitor
from labkit.measure.profiler import (CaptureRange, Profile, analyse, nsys_command, phase_range,
                                     profile_step, record, top_kernel_command)
from labkit.measure.timer import cpu_threads, time_step
from labkit.results import runs_dir
from labkit.blocks.training import Trainer, make_batch
from labkit.workload import Comparison, Workload

VARIANTS = ("plain", "profiler", "monitor")
REFERENCE = "plain"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"batch_size": 2, "seq_len": 32}, {"batch_size": 1, "seq_len": 32, "num_layers": 2, "overhead_repeats": 1})



@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="how the step is observed")
    steps: int = knob(2, min=1, help="training steps compared with plain")
    lr: float = knob(1e-3, min=0.0, help="AdamW learning rate")
    data_phase: bool = knob(True, help="make the batch inside the step (a `data` phase)")
    memory_timeline: bool = knob(True, help="profiler: one more step with stacks for the memory timeline")
    monitor_interval_ms: float = knob(5.0, min=0.1, help="monitor: sampling interval")
    small_op_us: float = knob(10.0, min=0.0, help="ops or kernels shorter than this count as small")
    overhead_repeats: int = knob(3, min=1, help="side-by-side calls to measure the overhead")
    trace_dir: str = knob("", help="where Chrome traces go (empty: <runs dir>/traces)")


def phased_trainer(cfg: Config, mark: Callable[[str], None] | None = None) -> Trainer:
    """The plain training step (`Trainer.step`) in named phases, each a `phase_range`
    (`labkit.measure.profiler`) and first marked by `mark(name)` when given; the batch made inside
    the step (the `data` phase) when `data_phase`; no gradient norm (the optimizer phase is
    AdamW's step alone)."""
    trainer = Trainer(cfg, weights=torch_dtype(cfg.dtype), lr=cfg.lr)
    if cfg.data_phase:
        trainer.batches = functools.partial(make_batch, cfg)
    trainer.measure_norm = False
    trainer.phase = marked_phases(cfg.device, mark)
    return trainer


def marked_phases(device: str, mark: Callable[[str], None] | None):
    """`Trainer.phase`: each phase a `phase_range`, marked first by `mark(name)` when given."""
    def phase(name: str):
        if mark is not None:
            mark(name)
        return phase_range(name, device)
    return phase


def trace_path(cfg: Config) -> Path:
    folder = Path(cfg.trace_dir) if cfg.trace_dir else runs_dir() / "traces"
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return folder / f"profiling-{cfg.preset}-{cfg.device.replace(':', '')}-{stamp}-{os.getpid()}.json"


def overhead_pct(plain: Callable[[], Any], observed: Callable[[], Any], cfg: Config) -> float:
    """Median time of `observed` over median time of `plain`, minus 1, in %: one call of each in
    turn (after one untimed call each), so a load change on a shared machine hits both alike."""
    kw = {"device": cfg.device, "warmup": 0, "min_run_time_s": 0.0, "min_repeats": 1,
          "num_threads": cfg.num_threads}
    plain(), observed()
    times: dict[str, list[float]] = {"plain": [], "observed": []}
    for _ in range(cfg.overhead_repeats):
        times["plain"].append(time_step(plain, **kw).times_s[0])
        times["observed"].append(time_step(observed, **kw).times_s[0])
    return 100 * (statistics.median(times["observed"]) / statistics.median(times["plain"]) - 1)


def build(cfg: Config) -> Workload:
    trainer = phased_trainer(cfg)
    common = {"check": lambda: trainer.train(cfg.steps), "tokens_per_step": cfg.batch_size * cfg.seq_len,
              "tensors": {"param_bytes": trainer.model.parameters,
                          "optimizer_bytes": trainer.optimizer_tensors},
              "compute_dtype": cfg.dtype}
    if cfg.variant == "profiler":
        return _profiler_workload(cfg, trainer, common)
    if cfg.variant == "monitor":
        return _monitor_workload(cfg, trainer, common)
    notes = {}
    if cfg.device.startswith("cuda"):
        command = nsys_command(device=cfg.device, preset=cfg.preset)
        notes["step_ms"] = f"Nsight Systems on this step: {command}"
    return Workload(step=CaptureRange(cfg.device).wrap(trainer.step), notes=notes, **common)


def _profiler_workload(cfg: Config, trainer: Trainer, common: dict) -> Workload:
    last: dict[str, Any] = {}

    def step() -> float:
        with record(cfg.device) as prof:
            loss = trainer.step()
        last["prof"] = prof
        return loss

    notes: dict[str, str] = {}

    def report() -> dict[str, float]:
        start = time.perf_counter()
        prof = analyse(last["prof"], cfg.device, trace_path=trace_path(cfg))
        out = {"analysis_ms": 1e3 * (time.perf_counter() - start), **prof.summary(cfg.small_op_us),
               "trace_bytes": float(prof.trace_path.stat().st_size)}
        notes.update(_profile_notes(cfg, prof))
        if cfg.memory_timeline:
            timeline, _ = profile_step(trainer.step, cfg.device, memory_timeline=True)
            sizes = timeline.memory.drop(columns="time_us")
            out["timeline_peak_bytes"] = float(sizes.sum(axis=1).max()) if len(sizes) else 0.0
            notes["timeline_peak_bytes"] = f"{timeline.memory_note}; at the peak: " + ", ".join(
                f"{k} {v / 2**20:.2f} MiB" for k, v in sizes.loc[sizes.sum(axis=1).idxmax()].items() if v)
        out["profiler_overhead_pct"] = overhead_pct(trainer.step, step, cfg)
        return out

    return Workload(step=step, report=report, notes=notes, **common)


def _profile_notes(cfg: Config, prof: Profile) -> dict[str, str]:
    lines = prof.findings(cfg.small_op_us)
    by_word = {"data_share_pct": "data loading", "top_op_share_pct": "top operator",
               "idle_gap_pct": "idle", "num_small_ops": "small work"}
    notes = {metric: line for metric, word in by_word.items() for line in lines if line.startswith(word)}
    notes["trace_bytes"] = (f"Chrome trace: {prof.trace_path} (open in https://ui.perfetto.dev, "
                            "chrome://tracing or TensorBoard)")
    notes["profiler_overhead_pct"] = ("the profiled step against the plain one, timed back to back "
                                      f"(alternating, {cfg.overhead_repeats} calls each, medians)")
    kernel = top_kernel_command(prof.events, device=cfg.device, preset=cfg.preset)
    if kernel:
        top = notes.get("top_op_share_pct", "")
        notes["top_op_share_pct"] = f"{top}. Nsight Compute on the top kernel: {kernel}"
    return notes


def _monitor_workload(cfg: Config, trainer: Trainer, common: dict) -> Workload:
    monitor = DeviceMonitor(cfg.device, interval_s=cfg.monitor_interval_ms / 1e3)
    trainer.phase = marked_phases(cfg.device, monitor.mark)
    seen: dict[str, float] = {}

    def step() -> float:
        monitor.start()  # once; it runs through checking, the memory step and timing
        return trainer.step()

    def report() -> dict[str, float]:
        out = {"monitor_overhead_pct": overhead_pct(_unmarked(trainer), step, cfg)}
        monitor.stop()
        frame = monitor.frame()
        seen["duration_s"] = float(frame["t_s"].iloc[-1])
        out.update(num_monitor_samples=float(len(frame)), monitor_cpu_pct=frame["cpu_pct"].mean(),
                   monitor_rss_bytes=frame["rss_bytes"].max())
        if monitor.source == "nvml":
            out.update(gpu_utilization_pct=frame["utilization_pct"].mean(),
                       gpu_memory_used_bytes=frame["memory_used_bytes"].max())
        return {k: float(v) for k, v in out.items() if v == v}  # NaN: a reading never given

    def predicted() -> dict[str, float]:
        # one sample at start and stop, and one every interval in between (if the GIL allows)
        return {"num_monitor_samples": 2 + math.floor(seen["duration_s"] / monitor.interval_s)}

    notes = {"num_monitor_samples": f"source: {monitor.source}. {monitor.note}".strip(),
             "monitor_cpu_pct": "process CPU time / wall time while monitored, all threads (mean)"}
    return Workload(step=step, report=report, predicted=predicted, notes=notes, **common)


def _unmarked(trainer: Trainer) -> Callable[[], float]:
    def step() -> float:
        phase, trainer.phase = trainer.phase, marked_phases(trainer.cfg.device, None)
        try:
            return trainer.step()
        finally:
            trainer.phase = phase
    return step


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The same losses after the same steps: exactly on the CPU; on a GPU within 1e-5 relative
    (some CUDA backward kernels, e.g. the embedding's, add with atomics in a varying order)."""
    ref, got = reference["losses"], outputs["losses"]
    delta = max(abs(a - b) for a, b in zip(ref, got))
    tolerance = 1e-5 * abs(ref[-1]) if cfg.device.startswith("cuda") else 0.0
    ok = len(ref) == len(got) and delta <= tolerance
    return Comparison({"loss": got[-1], "loss_delta": delta}, ok,
                      "" if ok else f"losses {got} differ from plain's {ref}")


def expected(cfg: Config) -> dict[str, float]:
    flops = planner.train_step_flops(cfg.model, batch=cfg.batch_size, seq_len=cfg.seq_len,
                                     attention=cfg.attention)
    out = {"flops": flops, "loss_delta": 0.0, "param_bytes": planner.param_bytes(cfg.model, cfg.dtype),
           "optimizer_bytes": planner.adamw_state_bytes(cfg.model)}
    peak = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads).get(cfg.dtype)
    if peak:
        out.update(tflops=peak, step_ms=flops / (peak * 1e12) * 1e3)
    return out


# --- for notebooks: one profiled step, one monitored run ------------------------------------------

def profile_once(cfg: Config) -> Profile:
    """A warm-up step, then one step profiled with stacks: operator table, findings, memory
    timeline, and the Chrome trace written to `trace_path(cfg)`."""
    with cpu_threads(cfg.num_threads):
        trainer = phased_trainer(cfg)
        trainer.step()
        prof, _ = profile_step(trainer.step, cfg.device, trace_path=trace_path(cfg), memory_timeline=True)
    return prof


def monitor_once(cfg: Config, steps: int | None = None) -> DeviceMonitor:
    """`steps` (default cfg.steps) training steps under a `DeviceMonitor`, stopped afterwards."""
    with cpu_threads(cfg.num_threads):
        monitor = DeviceMonitor(cfg.device, interval_s=cfg.monitor_interval_ms / 1e3)
        trainer = phased_trainer(cfg, monitor.mark)
        with monitor:
            trainer.train(steps or cfg.steps)
    return monitor
