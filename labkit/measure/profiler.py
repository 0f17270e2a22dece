"""Profiling one step: torch.profiler tables and traces, NVTX phase ranges, Nsight commands, findings.

- `phase_range(name, device)`: a `record_function` range (seen by torch.profiler) and, on CUDA, an
  NVTX range (seen by Nsight Systems) around one phase of a step (data, forward, backward, ...).
- `record(device)`: torch.profiler around a block (CPU activity, plus CUDA on a GPU) with
  `profile_memory` and `record_shapes`; `analyse(prof)` turns it into a `Profile`: every event as a
  DataFrame, the operator table, the Chrome trace (Perfetto, `chrome://tracing`, TensorBoard) and
  the memory timeline by category.
- `findings(...)`: plain sentences with numbers: the data-loading share, the top operator and its
  share, idle gaps on the timeline, and how many ops or kernels are tiny (launch-bound).
- `nsys_command(...)` and `ncu_command(...)`: the exact command lines to take the same run to
  Nsight Systems (timeline) and Nsight Compute (one kernel in depth).

The memory timeline comes from torch.profiler's memory profiler (`export_memory_timeline`; it needs
`with_stack=True`, which adds overhead, so it is opt-in). It categorises bytes on the CPU too;
what the CPU cannot give is the CUDA caching allocator's own view (`torch.cuda.memory.
_record_memory_history` snapshots, segments and fragmentation), which exists only on GPUs.
"""
from __future__ import annotations

import contextlib
import json
import re
import shlex
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, record_function

EVENT_COLUMNS = ("name", "kind", "start_us", "duration_us", "self_us", "self_device_us",
                 "self_mem_bytes", "leaf")
SMALL_US = 10.0  # an op or kernel shorter than this is launch-bound: its fixed cost dominates
MIN_GAP_US = 1.0  # idle stretches shorter than this are not counted as gaps
MEMORY_EVENT = "[memory]"  # profile_memory's allocation events in `prof.events()`


def is_cuda(device: str | torch.device) -> bool:
    return str(device).startswith("cuda")


# --- phases: ranges both torch.profiler and Nsight see ----------------------------------------

@contextlib.contextmanager
def phase_range(name: str, device: str = "cpu") -> Iterator[None]:
    """`record_function(name)`, and on CUDA an NVTX range of the same name (no-op on the CPU)."""
    cuda = is_cuda(device)
    if cuda:
        torch.cuda.nvtx.range_push(name)
    try:
        with record_function(name):
            yield
    finally:
        if cuda:
            torch.cuda.nvtx.range_pop()


class CaptureRange:
    """Opens the CUDA profiler range (cudaProfilerStart/Stop) around one call of a step, the
    `at_call`-th (0-based; 1 = the first call after a warm-up), so `nsys --capture-range=
    cudaProfilerApi` records one steady-state step. Does nothing on the CPU."""

    def __init__(self, device: str, at_call: int = 1):
        self.device, self.at_call, self.calls = device, at_call, 0

    def wrap(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def wrapped() -> Any:
            capture = is_cuda(self.device) and self.calls == self.at_call
            self.calls += 1
            if not capture:
                return step()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            try:
                result = step()
                torch.cuda.synchronize()
                return result
            finally:
                torch.cuda.profiler.stop()
        return wrapped


# --- recording and analysis ---------------------------------------------------------------------

def activities(device: str) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda(device) else [])


@contextlib.contextmanager
def record(device: str = "cpu", *, memory_timeline: bool = False) -> Iterator[profile]:
    """torch.profiler around the block (synchronised at the end on CUDA). `memory_timeline` turns
    on `with_stack`, which the memory profiler needs and which costs extra time."""
    with profile(activities=activities(device), profile_memory=True, record_shapes=True,
                 with_stack=memory_timeline) as prof:
        yield prof
        if is_cuda(device):
            torch.cuda.synchronize()


@dataclass
class Profile:
    """One profiled block: its events, operator table, trace file and memory timeline."""

    device: str
    events: pd.DataFrame  # EVENT_COLUMNS; kind: op, phase, annotation, kernel, device_annotation
    operators: pd.DataFrame  # see operator_table
    trace_path: Path | None = None
    memory: pd.DataFrame | None = None  # time_us and one bytes column per category
    memory_note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def phases_ms(self) -> dict[str, float]:
        return phase_times_ms(self.events)

    def findings(self, small_us: float = SMALL_US) -> list[str]:
        return findings(self.events, self.operators, small_us=small_us)

    def summary(self, small_us: float = SMALL_US) -> dict[str, float]:
        return summary(self.events, self.operators, small_us=small_us)


def analyse(prof: profile, device: str = "cpu", *, trace_path: str | Path | None = None,
            memory_timeline: bool = False) -> Profile:
    """A `Profile` of a finished `record()`; writes the Chrome trace to `trace_path` if given."""
    events = event_frame(prof.events())
    result = Profile(device, events, operator_table(events))
    if trace_path is not None:
        result.trace_path = Path(trace_path)
        result.trace_path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(result.trace_path))
    if memory_timeline:
        result.memory, result.memory_note = memory_frame(prof, device)
    return result


def profile_step(step: Callable[[], Any], device: str = "cpu", **kw: Any) -> tuple[Profile, Any]:
    """Run `step()` once under the profiler: its `Profile` (see `analyse` for `kw`) and result."""
    with record(device, memory_timeline=kw.get("memory_timeline", False)) as prof:
        result = step()
    return analyse(prof, device, **kw), result


def event_frame(events: Sequence[Any]) -> pd.DataFrame:
    """torch.profiler FunctionEvents -> one row each (Python stack frames left out). Times in us;
    `self_us` excludes child ops; `leaf` is an op with no child op. "kernel" is any device-side
    activity (kernels, memcpy, memset) except the device's copies of the phase ranges."""
    cpu = torch.autograd.DeviceType.CPU
    ranges = {e.name for e in events if e.is_user_annotation and e.device_type == cpu}
    rows = []
    for e in events:
        # "[memory]" carries allocations the profiler could not pin on an op: not an operator
        if getattr(e, "is_python_function", False) or e.name == MEMORY_EVENT:
            continue
        kernel = e.device_type != cpu
        if kernel and (e.is_user_annotation or e.name in ranges):  # a range drawn on the GPU timeline
            kind = "device_annotation"
        else:
            kind = "kernel" if kernel else _annotation_kind(e) if e.is_user_annotation else "op"
        children = [c for c in e.cpu_children if not getattr(c, "is_python_function", False)]
        rows.append((e.name, kind, e.time_range.start, e.time_range.elapsed_us(),
                     e.time_range.elapsed_us() if kernel else e.self_cpu_time_total,
                     e.time_range.elapsed_us() if kernel else e.self_device_time_total,
                     e.self_device_memory_usage if kernel else e.self_cpu_memory_usage,
                     not children))
    return pd.DataFrame(rows, columns=list(EVENT_COLUMNS))


def _annotation_kind(e: Any) -> str:
    """"phase" for an outermost user range (the caller's phases), "annotation" for one nested in
    another (torch's own, such as `Optimizer.step#AdamW.step`)."""
    parent = e.cpu_parent
    while parent is not None:
        if parent.is_user_annotation:
            return "annotation"
        parent = parent.cpu_parent
    return "phase"


def operator_table(events: pd.DataFrame) -> pd.DataFrame:
    """Ops aggregated by name, most self time first: calls, self/total CPU ms, self device ms
    (kernel time the op launched; 0 on the CPU), self memory bytes, share of all ops' self time."""
    ops = events[events["kind"] == "op"]
    table = ops.groupby("name").agg(calls=("name", "size"), self_cpu_ms=("self_us", "sum"),
                                    total_cpu_ms=("duration_us", "sum"),
                                    self_device_ms=("self_device_us", "sum"),
                                    self_mem_bytes=("self_mem_bytes", "sum"))
    for col in ("self_cpu_ms", "total_cpu_ms", "self_device_ms"):
        table[col] = table[col] / 1e3
    by = "self_device_ms" if table["self_device_ms"].sum() > 0 else "self_cpu_ms"
    total = table[by].sum()
    table["share_pct"] = 100 * table[by] / total if total else 0.0
    return table.sort_values(by, ascending=False).reset_index()


def memory_frame(prof: profile, device: str) -> tuple[pd.DataFrame | None, str]:
    """The memory timeline (bytes live per category over time, us) and a note on what it is."""
    try:
        from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX
    except ImportError as e:  # a private module: say so rather than fail
        return None, f"memory timeline unavailable in this torch: {e}"
    names = [c.name.lower() if c is not None else "unknown"
             for c, _ in sorted(_CATEGORY_TO_INDEX.items(), key=lambda kv: kv[1])]
    target = "cuda:0" if device == "cuda" else device
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in favour of CUDA-only snapshots
        path = Path(tmp) / "memory.json"
        prof.export_memory_timeline(str(path), device=target)
        times, sizes = json.loads(path.read_text())
    frame = pd.DataFrame([row[1:] for row in sizes], columns=names)  # row[0] is unused padding
    frame.insert(0, "time_us", [t - min(times, default=0) for t in times])
    note = "bytes live per category (torch.profiler memory profiler)"
    if not is_cuda(device):
        note += ("; the CUDA allocator's view (segments, fragmentation, memory snapshots) "
                 "exists only on GPUs")
    return frame, note


# --- findings ----------------------------------------------------------------------------------

def phase_times_ms(events: pd.DataFrame) -> dict[str, float]:
    phases = events[events["kind"] == "phase"]
    return (phases.groupby("name", sort=False)["duration_us"].sum() / 1e3).to_dict()


def work_events(events: pd.DataFrame) -> pd.DataFrame:
    """What the device runs: kernels when there are any (GPU), else the CPU's ops."""
    kernels = events[events["kind"] == "kernel"]
    return kernels if len(kernels) else events[events["kind"] == "op"]


def idle_time(events: pd.DataFrame, min_gap_us: float = MIN_GAP_US) -> dict[str, float]:
    """The union of busy intervals of `work_events` over their span: idle us, span us, the number
    of gaps >= `min_gap_us` and the longest gap."""
    work = work_events(events).sort_values("start_us")
    if work.empty:
        return {"idle_us": 0.0, "span_us": 0.0, "num_gaps": 0, "longest_gap_us": 0.0}
    idle, gaps, longest = 0.0, 0, 0.0
    end = work["start_us"].iloc[0]
    for start, duration in zip(work["start_us"], work["duration_us"]):
        gap = start - end
        if gap >= min_gap_us:
            idle, gaps, longest = idle + gap, gaps + 1, max(longest, gap)
        end = max(end, start + duration)
    return {"idle_us": float(idle), "span_us": float(end - work["start_us"].iloc[0]),
            "num_gaps": gaps, "longest_gap_us": float(longest)}


def small_work(events: pd.DataFrame, small_us: float = SMALL_US) -> tuple[int, int]:
    """(how many, out of how many) kernels, or leaf CPU ops, run under `small_us`."""
    work = work_events(events)
    work = work if (work["kind"] == "kernel").any() else work[work["leaf"]]
    return int((work["duration_us"] < small_us).sum()), len(work)


def summary(events: pd.DataFrame, operators: pd.DataFrame, small_us: float = SMALL_US) -> dict[str, float]:
    """The findings as numbers (metric names with units)."""
    idle = idle_time(events)
    small, total = small_work(events, small_us)
    out = {"num_ops": float(len(operators)), "num_op_calls": float(operators["calls"].sum()),
           "top_op_share_pct": float(operators["share_pct"].iloc[0]) if len(operators) else 0.0,
           "idle_gap_pct": float(100 * idle["idle_us"] / idle["span_us"]) if idle["span_us"] else 0.0,
           "num_small_ops": float(small), "small_ops_pct": 100 * small / total if total else 0.0}
    phases = phase_times_ms(events)
    if "data" in phases:
        out["data_share_pct"] = 100 * phases["data"] / sum(phases.values())
    return out


def findings(events: pd.DataFrame, operators: pd.DataFrame, small_us: float = SMALL_US) -> list[str]:
    """One line each, with the number: data share, top operator, idle gaps, tiny ops."""
    lines = []
    phases = phase_times_ms(events)
    if "data" in phases:
        total = sum(phases.values())
        lines.append(f"data loading: {100 * phases['data'] / total:.1f}% of the step's phases "
                     f"({phases['data']:.2f} of {total:.2f} ms in `data`)")
    if len(operators):
        top = operators.iloc[0]
        what = "device" if top["self_device_ms"] > 0 else "CPU"
        lines.append(f"top operator: {top['name']}, {top['share_pct']:.1f}% of self {what} time "
                     f"({int(top['calls'])} calls)")
    idle = idle_time(events)
    if idle["span_us"]:
        unit = "kernel" if (events["kind"] == "kernel").any() else "operator"
        lines.append(f"idle: {100 * idle['idle_us'] / idle['span_us']:.1f}% of the "
                     f"{idle['span_us'] / 1e3:.2f} ms timeline runs no {unit}, in {idle['num_gaps']} "
                     f"gaps (longest {idle['longest_gap_us'] / 1e3:.3f} ms)")
    small, total = small_work(events, small_us)
    if total:
        unit = "kernels" if (events["kind"] == "kernel").any() else "leaf ops"
        lines.append(f"small work: {small} of {total} {unit} ({100 * small / total:.0f}%) take under "
                     f"{small_us:g} us: launch overhead, not math, sets their cost")
    return lines


# --- Nsight command lines -------------------------------------------------------------------------

def _labkit_run(experiment: str, device: str, preset: str | None, variant: str | None,
                overrides: dict[str, Any] | None) -> list[str]:
    cmd = ["python", "-m", "labkit", "run", experiment, "--device", device]
    cmd += ["--preset", preset] if preset else []
    cmd += ["--variant", variant] if variant else []
    for key, value in (overrides or {}).items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def nsys_command(experiment: str = "profiling", *, output: str = "labkit_nsys", device: str = "cuda",
                 preset: str | None = None, variant: str | None = "plain",
                 overrides: dict[str, Any] | None = None, capture_range: bool = True) -> str:
    """Nsight Systems over `labkit run`: CUDA API, NVTX ranges and OS runtime calls. With
    `capture_range`, only what runs between cudaProfilerStart and Stop is recorded (the profiling
    experiment's `plain` variant opens that range around its second step: `CaptureRange`)."""
    cmd = ["nsys", "profile", "-t", "cuda,nvtx,osrt"]
    if capture_range:
        cmd += ["--capture-range=cudaProfilerApi", "--capture-range-end=stop"]
    cmd += ["-o", output, "--force-overwrite=true"]
    return shlex.join(cmd + _labkit_run(experiment, device, preset, variant, overrides))


def ncu_command(kernel: str, *, experiment: str = "profiling", launch_skip: int = 0,
                launch_count: int = 1, nvtx_range: str | None = None, output: str = "labkit_ncu",
                device: str = "cuda", preset: str | None = None, variant: str | None = "plain",
                overrides: dict[str, Any] | None = None) -> str:
    """Nsight Compute on one kernel: names matching `kernel` (a regex), skipping `launch_skip`
    launches of it (e.g. the warm-up step's), then `launch_count`, with the full metric set."""
    cmd = ["ncu", "--target-processes", "all"]
    if nvtx_range:
        cmd += ["--nvtx", "--nvtx-include", f"{nvtx_range}/"]
    cmd += ["--kernel-name", f"regex:{kernel}", "--launch-skip", str(launch_skip),
            "--launch-count", str(launch_count), "--set", "full", "-f", "-o", output]
    return shlex.join(cmd + _labkit_run(experiment, device, preset, variant, overrides))


def kernel_regex(name: str, max_len: int = 60) -> str:
    """A regex for a (possibly templated, very long) kernel name: its escaped leading part."""
    return re.escape(name[:max_len])


def top_kernel_command(events: pd.DataFrame, **kw: Any) -> str | None:
    """`ncu_command` for the kernel with the most device time, skipping its launches in one step
    (those of the first, warm-up step); None without kernels (on the CPU)."""
    kernels = events[events["kind"] == "kernel"]
    if kernels.empty:
        return None
    by_name = kernels.groupby("name")["duration_us"].agg(["sum", "size"])
    name = by_name["sum"].idxmax()
    return ncu_command(kernel_regex(name), launch_skip=int(by_name.loc[name, "size"]), **kw)
