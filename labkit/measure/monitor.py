"""A device monitor: samples the GPU (NVML) or the host process in a background thread.

On an NVIDIA GPU each sample holds NVML's utilization %, memory used (all processes), power,
SM clock and temperature (`hardware.nvml_sample`; a reading the GPU does not give is missing), plus
the host process's CPU % and resident memory. Without NVML (no driver, no GPU, `pynvml.NVMLError`)
it samples the process only and says so in `note`. `mark("forward")` starts a phase: every later
sample carries it, and the timeline figure draws it. `serve()` exposes the latest sample in
Prometheus text format on `/metrics`, so one Prometheus can scrape every participant of a workshop.

Sampling is Python in a thread: it needs the GIL, so while a long C++ op runs without releasing it
samples arrive late. Compare `len(monitor.frame())` with duration / interval.
"""
from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pandas as pd

from labkit import hardware

GPU_FIELDS = ("utilization_pct", "memory_used_bytes", "power_draw_w", "sm_clock_mhz", "temperature_c")
CPU_FIELDS = ("cpu_pct", "rss_bytes")
MIB = 2**20
PHASE_COLORS = ("#457b9d", "#2a9d8f", "#8e7dbe", "#f4a261", "#264653", "#e9c46a", "#6d597a")
# sample field -> (Prometheus gauge, help, which device label it carries)
GAUGES = {
    "utilization_pct": ("labkit_gpu_utilization_pct", "GPU utilization (NVML), percent", "gpu"),
    "memory_used_bytes": ("labkit_gpu_memory_used_bytes", "GPU memory used, all processes", "gpu"),
    "power_draw_w": ("labkit_gpu_power_watts", "GPU power draw, watts", "gpu"),
    "sm_clock_mhz": ("labkit_gpu_sm_clock_mhz", "GPU SM clock, MHz", "gpu"),
    "temperature_c": ("labkit_gpu_temperature_celsius", "GPU temperature, Celsius", "gpu"),
    "cpu_pct": ("labkit_process_cpu_pct", "process CPU time per wall time, percent (all threads)", "cpu"),
    "rss_bytes": ("labkit_process_rss_bytes", "process resident memory, bytes", "cpu"),
}


def rss_bytes(statm: str = "/proc/self/statm") -> int | None:
    """Resident memory of this process (Linux /proc); None where there is no /proc."""
    try:
        return int(Path(statm).read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class DeviceMonitor:
    """Samples every `interval_s` between `start()` and `stop()` (or as a context manager)."""

    def __init__(self, device: str = "cpu", interval_s: float = 0.05, max_samples: int = 100_000):
        self.device, self.interval_s, self.max_samples = device, interval_s, max_samples
        self.gpu_index = int(device.split(":")[1]) if device.startswith("cuda:") else 0
        self.source, self.note = "cpu", ""
        if device.startswith("cuda"):
            if hardware.nvml_sample(self.gpu_index) is None:
                self.note = "NVML unavailable (no driver or pynvml.NVMLError): host process only"
            else:
                self.source = "nvml"
        self.fields = (GPU_FIELDS if self.source == "nvml" else ()) + CPU_FIELDS
        self._samples: list[dict[str, Any]] = []
        self._marks: list[tuple[float, str]] = []
        self._phase, self._lock = "", threading.Lock()
        self._stop, self._thread = threading.Event(), None
        self._t0 = self._last = None

    # --- sampling
    def sample(self) -> dict[str, Any]:
        """Take one sample now (the thread calls this); returns it."""
        now, cpu = time.perf_counter(), time.process_time()
        if self._t0 is None:
            self._t0 = now
        reading: dict[str, Any] = {"t_s": now - self._t0, "phase": self._phase}
        if self.source == "nvml":
            reading.update(hardware.nvml_sample(self.gpu_index) or dict.fromkeys(GPU_FIELDS))
        last, self._last = self._last, (now, cpu)
        wall = None if last is None else now - last[0]
        reading["cpu_pct"] = 100 * (cpu - last[1]) / wall if wall else None
        reading["rss_bytes"] = rss_bytes()
        with self._lock:
            if len(self._samples) < self.max_samples:
                self._samples.append(reading)
        return reading

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> DeviceMonitor:
        if self._thread is None:
            self.sample()
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="labkit-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> DeviceMonitor:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.sample()  # a last one, so even a short run has a start and an end
        return self

    def __enter__(self) -> DeviceMonitor:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def mark(self, phase: str) -> None:
        """From now on samples belong to `phase` (drawn as a marker on the timeline)."""
        t = 0.0 if self._t0 is None else time.perf_counter() - self._t0
        with self._lock:
            self._marks.append((t, phase))
            self._phase = phase

    # --- results
    def frame(self) -> pd.DataFrame:
        """One row per sample: t_s, phase, then `fields` (missing readings as NaN)."""
        with self._lock:
            rows = list(self._samples)
        return pd.DataFrame(rows, columns=["t_s", "phase", *self.fields]).astype(
            {f: "float64" for f in self.fields})

    def markers(self) -> pd.DataFrame:
        with self._lock:
            return pd.DataFrame(self._marks, columns=["t_s", "phase"])

    def latest(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._samples[-1]) if self._samples else {}

    @property
    def num_samples(self) -> int:
        with self._lock:
            return len(self._samples)

    def figure(self, max_markers: int = 40):
        """The plotly timeline of every field with readings (`timeline_figure`)."""
        return timeline_figure(self.frame(), self.markers(), title=f"device monitor ({self.device}, "
                               f"{self.source})", max_markers=max_markers)

    def serve(self, port: int = 0, host: str = "127.0.0.1", labels: dict[str, str] | None = None):
        """Serve `/metrics` (Prometheus text) in a thread; port 0 picks a free one. Returns the
        server: `.url`, `.stop()`."""
        return MetricsServer(self, host, port, labels or {})


def timeline_figure(frame: pd.DataFrame, markers: pd.DataFrame, *, title: str = "device monitor",
                    fields: tuple[str, ...] | None = None, max_fields: int | None = None,
                    max_markers: int = 40):
    """The device timeline: one panel per field with readings (of `fields`, default all, at most
    `max_fields`; bytes in MiB), its samples as a line per phase (coloured, legend: the phase),
    and a diamond where each of the first `max_markers` phases began (hover: which)."""
    import numpy as np
    from plotly.subplots import make_subplots

    names = [c for c in (fields or frame.columns) if c in frame and c not in ("t_s", "phase")
             and frame[c].notna().any()][:max_fields]
    fig = make_subplots(rows=max(len(names), 1), cols=1, shared_xaxes=True, vertical_spacing=0.12,
                        subplot_titles=[n.replace("_bytes", " (MiB)") for n in names] or ["no readings"])
    marks = markers.head(max_markers)
    for row, name in enumerate(names, start=1):
        scale = MIB if name.endswith("_bytes") else 1
        for i, (phase, part) in enumerate(frame.groupby("phase", sort=False)):
            fig.add_scatter(x=part["t_s"], y=part[name] / scale, mode="lines", name=phase or "-",
                            legendgroup=phase, showlegend=row == 1, row=row, col=1,
                            line={"color": PHASE_COLORS[i % len(PHASE_COLORS)]})
        known = frame.dropna(subset=[name])
        at = np.interp(marks["t_s"], known["t_s"], known[name] / scale)
        fig.add_scatter(x=marks["t_s"], y=at, mode="markers", name=f"{name} marks",
                        hovertext=marks["phase"], showlegend=False, row=row, col=1,
                        marker={"symbol": "diamond", "size": 9, "color": "#e76f51"})
    fig.update_layout(title=title, height=170 * max(len(names), 1) + 60, margin={"t": 60, "b": 30},
                      xaxis_title="seconds" if len(names) <= 1 else None)
    return fig


# --- Prometheus ----------------------------------------------------------------------------------

def _label_value(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{k}="{_label_value(v)}"' for k, v in labels.items()) + "}"


def prometheus_text(sample: dict[str, Any], *, gpu: str = "0", labels: dict[str, str] | None = None,
                    num_samples: int = 0) -> str:
    """The Prometheus text exposition (format 0.0.4) of one sample: one gauge per reading (a
    missing reading is left out), the current phase as an info-style gauge, the sample count."""
    labels, lines = labels or {}, []
    for field, (metric, help_text, kind) in GAUGES.items():
        value = sample.get(field)
        if value is None or value != value:  # missing or NaN
            continue
        device = {"device": gpu if kind == "gpu" else "cpu"}
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} gauge",
                  f"{metric}{_labels({**device, **labels})} {float(value)!r}"]
    lines += ["# HELP labkit_phase the phase the monitored run is in", "# TYPE labkit_phase gauge",
              f"labkit_phase{_labels({**labels, 'phase': sample.get('phase') or 'none'})} 1",
              "# HELP labkit_monitor_samples samples taken", "# TYPE labkit_monitor_samples gauge",
              f"labkit_monitor_samples{_labels(labels)} {num_samples}"]
    return "\n".join(lines) + "\n"


class MetricsServer:
    """`GET /metrics` -> the monitor's latest sample in Prometheus text; anything else 404."""

    def __init__(self, monitor: DeviceMonitor, host: str, port: int, labels: dict[str, str]):
        def body() -> bytes:
            return prometheus_text(monitor.latest(), gpu=str(monitor.gpu_index), labels=labels,
                                   num_samples=monitor.num_samples).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                data = body()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:  # keep notebooks and the CLI quiet
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}/metrics"
        self._thread = threading.Thread(target=self.server.serve_forever, name="labkit-metrics",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()
