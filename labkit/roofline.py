"""The roofline: every measured point against the device's compute roofs and bandwidth slope.

A step that does F FLOPs while moving B bytes has intensity I = F / B (FLOP per byte). It can run
no faster than min(peak, I x bandwidth): below the ridge point I* = peak / bandwidth it is bound
by memory, above it by compute. The ceilings come, in order of preference, from

1. this device's stored results (`load_results`, rows whose params and fingerprint match it):
   the best `tflops` of the `matmul` experiment per dtype, and the best `gbps` of a
   `memory_access` contiguous copy past the caches (at least its default size; a copy that fits
   in cache would beat memory); `calibrate()` runs both over a few sizes to store them;
2. `hardware.ceilings()`: a GPU's datasheet, or the CPU's quick (< 1 s) calibration,

and every ceiling says which (`sources`). Points are the result groups (one run, variant and sweep
point) that have both a `tflops` row and a `*gbps` row: intensity = tflops x 1e12 / (gbps x 1e9).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from labkit import hardware
from labkit.results import load_results
from labkit.techniques import memory_access

# The matmul experiment's variants and the peak_tflops key (data/gpus.json) of each.
MATMUL_DTYPES = {"fp32": "float32", "tf32": "tf32", "fp16": "float16", "bf16": "bfloat16",
                 "fp8": "float8"}
CALIBRATION_SIZES = {"cpu": [256, 512, 1024], "cuda": [4096, 8192, 16384]}
COPY_MIB = {"cpu": 256, "cuda": 2048}


@dataclass(frozen=True)
class RooflineCeilings:
    device: str
    name: str
    peak_tflops: dict[str, float]  # per dtype key
    bandwidth_gbps: float | None
    sources: dict[str, str] = field(default_factory=dict)  # dtype key or "bandwidth" -> where from

    def ridge(self, dtype: str) -> float | None:
        return ridge_point(self.peak_tflops[dtype], self.bandwidth_gbps)


def ridge_point(peak_tflops: float, bandwidth_gbps: float | None) -> float | None:
    """FLOP per byte where the bandwidth slope meets the compute roof."""
    return peak_tflops * 1e12 / (bandwidth_gbps * 1e9) if bandwidth_gbps else None


def attainable_tflops(intensity: float, peak_tflops: float, bandwidth_gbps: float | None) -> float:
    """The roof at `intensity` FLOP/byte: min(peak, intensity x bandwidth), in TFLOP/s."""
    if not bandwidth_gbps:
        return peak_tflops
    return min(peak_tflops, intensity * bandwidth_gbps * 1e9 / 1e12)


# --- the ceilings -----------------------------------------------------------------------------

def device_name(device: str) -> str:
    """What a fingerprint calls `device` ("cpu" or "cuda:N"): the CPU model or the GPU's name."""
    if device == "cpu":
        return hardware.cpu_info().model
    import torch

    return torch.cuda.get_device_name(int(device.split(":")[1]))


def _row_device(params: dict[str, Any], env: dict[str, Any]) -> tuple[str, str | None]:
    """("cpu" or "cuda:N", the name the run's fingerprint gives that device)."""
    device = str(params.get("device", ""))
    if not device.startswith("cuda"):
        return device, (env.get("cpu") or {}).get("model")
    index = int(device.split(":")[1]) if ":" in device else 0
    gpus = env.get("gpus") or []
    return f"cuda:{index}", gpus[index]["name"] if index < len(gpus) else None


def on_device(frame: pd.DataFrame, device: str, num_threads: int = 1) -> pd.DataFrame:
    """The `ok` rows measured on `device` ("cpu" or "cuda:N") of this machine's kind (same CPU
    model or GPU name); CPU rows also at `num_threads` threads."""
    if frame.empty:
        return frame
    name = device_name(device)

    def here(row) -> bool:
        params = row["params"] if isinstance(row["params"], dict) else {}
        if _row_device(params, row["env"] if isinstance(row["env"], dict) else {}) != (device, name):
            return False
        return device != "cpu" or params.get("num_threads") == num_threads

    return frame[(frame["status"] == "ok") & frame.apply(here, axis=1)]


def _past_the_caches(params: Any, min_mib: float) -> bool:
    """A contiguous copy of at least `min_mib` (0: the experiment's default size, which is)."""
    return isinstance(params, dict) and params.get("op") == "copy" and (
        not params.get("size_mib") or params["size_mib"] >= min_mib)


def best_measured(frame: pd.DataFrame, min_copy_mib: float = 0.0) -> dict[str, tuple[float, str]]:
    """{dtype key or "bandwidth": (best value, where it was measured)} from rows of one device.
    Copies smaller than `min_copy_mib` are left out: from the caches they beat memory."""
    out: dict[str, tuple[float, str]] = {}
    matmul = frame[(frame["experiment"] == "matmul") & (frame["metric"] == "tflops")]
    for variant, rows in matmul.groupby("variant"):
        best = rows.loc[rows["value"].idxmax()]
        m, n, k = (best["params"].get(x) for x in "mnk")
        shape = f"{m}x{n}x{k}" if m or n or k else f"size {best['params'].get('size') or 'default'}"
        out[MATMUL_DTYPES[variant]] = (best["value"], f"measured: best of {len(rows)} matmul "
                                       f"rows ({shape}, {best['params'].get('alignment')}), "
                                       f"run {best['run_id']}")
    copies = frame[(frame["experiment"] == "memory_access") & (frame["metric"] == "gbps")
                   & (frame["variant"] == "contiguous")
                   & frame["params"].map(lambda p: _past_the_caches(p, min_copy_mib))]
    if not copies.empty:
        best = copies.loc[copies["value"].idxmax()]
        size = best["params"].get("size_mib") or "default"
        out["bandwidth"] = (best["value"], f"measured: best of {len(copies)} contiguous copies "
                                           f"({size} MiB), run {best['run_id']}")
    return out


def ceilings_for(device: str = "auto", runs_dir: str | None = None, *,
                 num_threads: int = 1) -> RooflineCeilings:
    """This device's ceilings: measured ones from stored results where they exist, else
    `hardware.ceilings()` (a GPU's datasheet, the CPU's quick calibration), each with its source."""
    base = hardware.ceilings(device, num_threads=num_threads)
    fallback = ("datasheet: " if not base.measured else "quick calibration: ") + base.source
    kind = "cpu" if base.device == "cpu" else "cuda"
    measured = best_measured(on_device(load_results(runs_dir), base.device, num_threads),
                             min_copy_mib=memory_access.DEFAULT_MIB[kind])
    peaks = {k: float(v) for k, v in base.peak_tflops.items()}
    sources = {k: fallback for k in peaks}
    bandwidth = base.bandwidth_gbps
    if bandwidth:
        sources["bandwidth"] = fallback
    for key, (value, source) in measured.items():
        if key == "bandwidth":
            bandwidth = float(value)
        else:
            peaks[key] = float(value)
        sources[key] = source
    return RooflineCeilings(base.device, base.name, peaks, bandwidth, sources)


def ceilings_table(ceilings: RooflineCeilings) -> pd.DataFrame:
    """One line per ceiling: value, unit, ridge point and source."""
    rows = [{"ceiling": k, "value": v, "unit": "TFLOP/s", "ridge_flop_per_byte": ceilings.ridge(k),
             "source": ceilings.sources.get(k, "")} for k, v in ceilings.peak_tflops.items()]
    if ceilings.bandwidth_gbps:
        rows.append({"ceiling": "bandwidth", "value": ceilings.bandwidth_gbps, "unit": "GB/s",
                     "ridge_flop_per_byte": None, "source": ceilings.sources.get("bandwidth", "")})
    return pd.DataFrame(rows)


def calibrate(device: str = "auto", runs_dir: str | None = None, *, sizes: list[int] | None = None,
              copy_mib: float | None = None, num_threads: int = 1,
              overrides: dict[str, Any] | None = None) -> RooflineCeilings:
    """Measure the achievable ceilings and store them: matmul in every dtype this device runs,
    over a few square sizes (the best one counts), and a contiguous copy well past the caches.
    Returns `ceilings_for(device, runs_dir)`, which now prefers them."""
    from labkit.config import resolve_device
    from labkit.experiment import run_experiment

    device = resolve_device(device)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    common = {"device": device, "num_threads": num_threads, **(overrides or {})}
    run_experiment("matmul", overrides=common, sweep={"size": sizes or CALIBRATION_SIZES[kind]},
                   runs_dir=runs_dir, progress=False)
    run_experiment("memory_access", variants=["contiguous"], runs_dir=runs_dir, progress=False,
                   overrides={**common, "size_mib": copy_mib or COPY_MIB[kind], "op": "copy"})
    return ceilings_for(hardware.ceilings(device).device, runs_dir, num_threads=num_threads)


# --- the points -------------------------------------------------------------------------------

def _gbps_metric(metrics: list[str]) -> str | None:
    """`gbps`, else `achieved_gbps`, else the first other `*gbps` metric (by name)."""
    names = sorted(m for m in metrics if isinstance(m, str) and m.endswith("gbps"))
    return next((m for m in ("gbps", "achieved_gbps") if m in names), names[0] if names else None)


def points(frame: pd.DataFrame) -> pd.DataFrame:
    """One point per (run, variant, sweep point, rank) with both a `tflops` and a `*gbps` row:
    experiment, variant, label, tflops, gbps (and the metric it came from), intensity (FLOP/B)."""
    columns = ["experiment", "variant", "label", "run_id", "rank", "tflops", "gbps", "gbps_metric",
               "intensity"]
    ok = frame[(frame["status"] == "ok") & frame["metric"].notna()] if not frame.empty else frame
    if ok.empty:
        return pd.DataFrame(columns=columns)
    keyed = ok.assign(_point=ok["params"].map(lambda p: json.dumps(p, sort_keys=True, default=str)),
                      _rank=ok["rank"].fillna(0))
    out = []
    for (run_id, experiment, variant, point, rank), rows in keyed.groupby(
            ["run_id", "experiment", "variant", "_point", "_rank"], sort=False):
        values = dict(zip(rows["metric"], rows["value"]))
        gbps_metric = _gbps_metric(list(values))
        tflops, gbps = values.get("tflops"), values.get(gbps_metric)
        if not (tflops and gbps and tflops > 0 and gbps > 0):
            continue
        sweep = json.loads(point).get("sweep") or {}
        label = f"{experiment}/{variant}" + "".join(f" {k}={v}" for k, v in sweep.items())
        out.append({"experiment": experiment, "variant": variant, "label": label, "run_id": run_id,
                    "rank": rank, "tflops": tflops, "gbps": gbps, "gbps_metric": gbps_metric,
                    "intensity": tflops * 1e12 / (gbps * 1e9)})
    return pd.DataFrame(out, columns=columns)


# --- the figure -------------------------------------------------------------------------------

PALETTE = ("#264653", "#e76f51", "#2a9d8f", "#8e7dbe", "#f4a261", "#457b9d", "#e9c46a", "#6d597a")
POINT_COLORS = ("#d62728", "#1f77b4", "#ff7f0e", "#9467bd", "#17becf", "#8c564b", "#e377c2")
ROOF_DTYPES = ("float32", "tf32", "float16", "bfloat16", "float8")  # int8 (TOPS) left out


def _x_range(pts: pd.DataFrame, ceilings: RooflineCeilings) -> tuple[float, float]:
    xs = list(pts["intensity"]) + [r for k in ceilings.peak_tflops if (r := ceilings.ridge(k))]
    xs = [x for x in xs if x and x > 0] or [1.0]
    return min(xs) / 4, max(xs) * 4


def roofline_figure(pts: pd.DataFrame, ceilings: RooflineCeilings, *, title: str = ""):
    """Log-log: one roof per dtype (min(peak, I x bandwidth)) with its ridge point, and the points
    coloured by experiment."""
    import plotly.graph_objects as go

    fig = go.Figure()
    lo, hi = _x_range(pts, ceilings)
    xs = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    bw = ceilings.bandwidth_gbps
    for i, dtype in enumerate(d for d in ROOF_DTYPES if d in ceilings.peak_tflops):
        peak, color = ceilings.peak_tflops[dtype], PALETTE[i % len(PALETTE)]
        source = ceilings.sources.get(dtype, "").split(":")[0]
        fig.add_scatter(x=xs, y=[attainable_tflops(x, peak, bw) for x in xs], mode="lines",
                        name=f"{dtype} roof {peak:.3g} TFLOP/s ({source})", legendgroup=dtype,
                        line={"color": color, "dash": "dot"})
        ridge = ceilings.ridge(dtype)
        if ridge:
            fig.add_scatter(x=[ridge], y=[peak], mode="markers+text", text=[f"ridge {ridge:.3g}"],
                            textposition="bottom right", marker={"color": color, "symbol": "x"},
                            legendgroup=dtype, showlegend=False)
    for i, (experiment, rows) in enumerate(pts.groupby("experiment", sort=True)):
        fig.add_scatter(x=rows["intensity"], y=rows["tflops"], mode="markers", name=experiment,
                        text=rows["label"], hovertemplate="%{text}<br>%{x:.3g} FLOP/B, %{y:.3g} "
                        "TFLOP/s<extra></extra>",
                        marker={"size": 10, "color": POINT_COLORS[i % len(POINT_COLORS)]})
    slope = f"{bw:.3g} GB/s ({ceilings.sources.get('bandwidth', '').split(':')[0]})" if bw else "unknown"
    fig.update_layout(title=title or f"Roofline: {ceilings.name} ({ceilings.device}); bandwidth {slope}",
                      xaxis={"type": "log", "title": "arithmetic intensity (FLOP/byte)"},
                      yaxis={"type": "log", "title": "TFLOP/s"}, height=480,
                      legend={"orientation": "h", "y": -0.25})
    return fig


def figure_for(device: str = "auto", runs_dir: str | None = None, *, num_threads: int = 1):
    """One roofline for every experiment stored for this device so far."""
    ceilings = ceilings_for(device, runs_dir, num_threads=num_threads)
    return roofline_figure(points(on_device(load_results(runs_dir), ceilings.device, num_threads)),
                           ceilings)


def summary(ceilings: RooflineCeilings) -> str:
    """One line per dtype: peak, ridge point, source."""
    lines = []
    for dtype, peak in ceilings.peak_tflops.items():
        ridge = ceilings.ridge(dtype)
        ridge_text = f", ridge {ridge:.3g} FLOP/B" if ridge and math.isfinite(ridge) else ""
        lines.append(f"{dtype}: {peak:.4g} TFLOP/s{ridge_text} [{ceilings.sources.get(dtype, '')}]")
    if ceilings.bandwidth_gbps:
        lines.append(f"bandwidth: {ceilings.bandwidth_gbps:.4g} GB/s "
                     f"[{ceilings.sources.get('bandwidth', '')}]")
    return "\n".join(lines)
