"""The roofline: every measured point against the device's compute roofs and bandwidth slope.

A step that does F FLOPs while moving B bytes has intensity I = F / B (FLOP per byte). It can run
no faster than min(peak, I x bandwidth): below the ridge point I* = peak / bandwidth it is bound
by memory, above it by compute. A ceiling is an upper bound, so

- the compute roofs are `hardware.ceilings()`'s peaks: a GPU's datasheet, or the CPU's physical
  ceiling (cores x FMA units x lanes x 2 x clock); never a measurement;
- the best measured matmul per dtype (the CPU's quick calibration, or the best `tflops` of the
  `matmul` rows stored for this device, whichever is higher) is drawn below its roof;
- the bandwidth slope is a GPU's datasheet or, on a CPU (no reliable DRAM spec in a VM), the best
  measured copy: the quick calibration or a stored `memory_access` contiguous copy past the caches
  (at least its default size), whichever is higher; a point faster than it (data in cache) gets a
  slope of its own, labelled as measured;

and every ceiling says where it comes from (`sources`). A measurement above its roof is a bug in
the roof: nothing is clamped, and `notes` says so. Points are the result groups (one run, variant
and sweep point) with both a `tflops` row and a `*gbps` row: intensity = tflops x 1e12 / (gbps x 1e9).
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
from labkit.views import device_identity

# The matmul experiment's variants and the peak_tflops key (data/gpus.json) of each.
MATMUL_DTYPES = {"fp32": "float32", "tf32": "tf32", "fp16": "float16", "bf16": "bfloat16",
                 "fp8": "float8"}
CALIBRATION_SIZES = {"cpu": [256, 512, 1024], "cuda": [4096, 8192, 16384]}
COPY_MIB = {"cpu": 256, "cuda": 2048}


@dataclass(frozen=True)
class RooflineCeilings:
    device: str
    name: str
    peak_tflops: dict[str, float]  # the roofs, per dtype key: a datasheet or a physical ceiling
    bandwidth_gbps: float | None  # the slope: a datasheet, or the best measured copy (a CPU)
    sources: dict[str, str] = field(default_factory=dict)  # dtype key, "bandwidth", "best <dtype>"
    best_tflops: dict[str, float] = field(default_factory=dict)  # best measured matmul per dtype
    notes: tuple[str, ...] = ()  # measurements above their roof: a bug in the roof

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

def device_name(device: str) -> str | None:
    """What this machine's fingerprint calls `device` ("cpu" or "cuda:N"): the CPU model or the
    GPU's name (`views.device_identity`)."""
    return device_identity(hardware.fingerprint(), device)[1]


def on_device(frame: pd.DataFrame, device: str, num_threads: int = 1) -> pd.DataFrame:
    """The `ok` rows measured on `device` ("cpu" or "cuda:N") of this machine's kind (same CPU
    model or GPU name); CPU rows also at `num_threads` threads."""
    if frame.empty:
        return frame
    name = device_name(device)

    def here(row) -> bool:
        params = row["params"] if isinstance(row["params"], dict) else {}
        if device_identity(row["env"], params.get("device")) != (device, name):
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
    """This device's roofs (`hardware.ceilings()`: a datasheet or the CPU's physical ceiling), its
    best measured matmul per dtype and its bandwidth, each with its source (see the module doc)."""
    base = hardware.ceilings(device, num_threads=num_threads)
    kind = "cpu" if base.device == "cpu" else "cuda"
    stored = best_measured(on_device(load_results(runs_dir), base.device, num_threads),
                           min_copy_mib=memory_access.DEFAULT_MIB[kind])
    sources = {k: f"physical: {base.sources[k]}" if k in base.sources else f"datasheet: {base.source}"
               for k in base.peak_tflops}
    best = {k: (v, f"quick calibration: {base.sources.get('calibration', base.source)}")
            for k, v in base.calibrated_tflops.items()}
    for key, (value, source) in stored.items():
        if key != "bandwidth" and value > best.get(key, (0.0, ""))[0]:
            best[key] = (float(value), source)
    sources.update({f"best {k}": source for k, (_, source) in best.items()})
    bandwidth, sources["bandwidth"] = _bandwidth(base, stored.get("bandwidth"))
    best_tflops = {k: v for k, (v, _) in best.items()}
    notes = tuple(dict.fromkeys(base.notes + hardware.over_ceiling(best_tflops, base.peak_tflops)))
    return RooflineCeilings(base.device, base.name, dict(base.peak_tflops), bandwidth, sources,
                            best_tflops, notes)


def _bandwidth(base: hardware.Ceilings, stored: tuple[float, str] | None) -> tuple[float | None, str]:
    """(GB/s, source) of the slope: the higher of the base's (a datasheet, or the CPU's quick
    copy) and the best stored copy; a GPU's datasheet stays unless a copy beats it."""
    label = "quick calibration: " if base.measured else "datasheet: "
    own = (base.bandwidth_gbps, label + base.sources.get("bandwidth", base.source))
    if stored is None or (own[0] and own[0] >= stored[0]):
        return own if own[0] else (None, "")
    return float(stored[0]), stored[1]


def ceilings_table(ceilings: RooflineCeilings) -> pd.DataFrame:
    """One line per roof, per best measured matmul (with its % of the roof) and for the
    bandwidth: value, unit, ridge point, source."""
    rows = []
    for k, v in ceilings.peak_tflops.items():
        rows.append({"ceiling": k, "value": v, "unit": "TFLOP/s", "pct_of_roof": None,
                     "ridge_flop_per_byte": ceilings.ridge(k), "source": ceilings.sources.get(k, "")})
        if k in ceilings.best_tflops:
            best = ceilings.best_tflops[k]
            rows.append({"ceiling": f"{k} best measured", "value": best, "unit": "TFLOP/s",
                         "pct_of_roof": 100 * best / v, "ridge_flop_per_byte": None,
                         "source": ceilings.sources.get(f"best {k}", "")})
    if ceilings.bandwidth_gbps:
        rows.append({"ceiling": "bandwidth", "value": ceilings.bandwidth_gbps, "unit": "GB/s",
                     "pct_of_roof": None, "ridge_flop_per_byte": None,
                     "source": ceilings.sources.get("bandwidth", "")})
    return pd.DataFrame(rows)


def calibrate(device: str = "auto", runs_dir: str | None = None, *, sizes: list[int] | None = None,
              copy_mib: float | None = None, num_threads: int = 1,
              overrides: dict[str, Any] | None = None) -> RooflineCeilings:
    """Measure the achievable ceilings and store them: matmul in every dtype this device runs,
    over a few square sizes (the best one counts), and a contiguous copy well past the caches.
    Returns `ceilings_for(device, runs_dir)`, which now prefers them."""
    from labkit.config import resolve_device
    from labkit.harness.experiment import run_experiment

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


ROUNDING = 1e-9  # relative: what float rounding leaves between a point and the roof it sets


def point_roof(point: pd.Series, ceilings: RooflineCeilings, bandwidth: float | None) -> float | None:
    """The roof above one point: its matmul dtype's, else the highest roof, at its intensity."""
    peaks = ceilings.peak_tflops
    peak = peaks.get(MATMUL_DTYPES.get(point["variant"], "")) if point["experiment"] == "matmul" else None
    peak = peak or max(peaks.values(), default=None)
    return attainable_tflops(point["intensity"], peak, bandwidth) if peak else None


def over_roof(pts: pd.DataFrame, ceilings: RooflineCeilings, bandwidth: float | None) -> list[str]:
    """One note per point above its roof (compute roof and slope `bandwidth`): a bug in the roof.
    A point on its roof is not above it: the fastest point sets the cache slope, and its
    intensity x GB/s can round a last bit below its own TFLOP/s."""
    notes = []
    for _, point in pts.iterrows():
        roof = point_roof(point, ceilings, bandwidth)
        if roof and point["tflops"] > roof * (1 + ROUNDING):
            notes.append(f"{point['label']}: {point['tflops']:.3g} TFLOP/s is above its roof "
                         f"{roof:.3g}: the roof is wrong")
    return notes


def _cache_slope(pts: pd.DataFrame, bandwidth: float | None) -> tuple[float, str] | None:
    """(GB/s, label) of the fastest point when it outruns the memory slope (its data was in cache)."""
    if pts.empty or (bandwidth and pts["gbps"].max() <= bandwidth):
        return None
    fastest = pts.loc[pts["gbps"].idxmax()]
    return float(fastest["gbps"]), f"measured: {fastest['label']} (faster than memory: in cache)"


def _add_roofs(fig, xs: list[float], ceilings: RooflineCeilings) -> None:
    """Per dtype: the roof (dotted) with its ridge point, and the best measured (solid) below it."""
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
        best = ceilings.best_tflops.get(dtype)
        if best:
            fig.add_scatter(x=xs, y=[attainable_tflops(x, best, bw) for x in xs], mode="lines",
                            name=f"{dtype} best measured {best:.3g} TFLOP/s "
                                 f"({hardware.percent(100 * best / peak)} of the roof)",
                            legendgroup=dtype, line={"color": color, "width": 1})


def roofline_figure(pts: pd.DataFrame, ceilings: RooflineCeilings, *, title: str = ""):
    """Log-log: one roof per dtype (min(peak, I x bandwidth)) with its ridge point and the best
    measured matmul below it, the points coloured by experiment, and a note per point above
    its roof (none unless a roof is wrong)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    lo, hi = _x_range(pts, ceilings)
    xs = [lo * (hi / lo) ** (i / 199) for i in range(200)]
    _add_roofs(fig, xs, ceilings)
    bw, cache = ceilings.bandwidth_gbps, _cache_slope(pts, ceilings.bandwidth_gbps)
    if cache:
        peak = max(ceilings.peak_tflops.values(), default=float("inf"))
        fig.add_scatter(x=xs, y=[attainable_tflops(x, peak, cache[0]) for x in xs], mode="lines",
                        name=f"{cache[0]:.3g} GB/s ({cache[1]})", line={"color": "#999", "dash": "dash"})
    for i, (experiment, rows) in enumerate(pts.groupby("experiment", sort=True)):
        fig.add_scatter(x=rows["intensity"], y=rows["tflops"], mode="markers", name=experiment,
                        text=rows["label"], hovertemplate="%{text}<br>%{x:.3g} FLOP/B, %{y:.3g} "
                        "TFLOP/s<extra></extra>",
                        marker={"size": 10, "color": POINT_COLORS[i % len(POINT_COLORS)]})
    notes = list(ceilings.notes) + over_roof(pts, ceilings, cache[0] if cache else bw)
    for j, note in enumerate(notes):
        fig.add_annotation(text=note, xref="paper", yref="paper", x=0, y=1 - 0.06 * j,
                           showarrow=False, xanchor="left", font={"color": "#b00020"})
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
    """One line per dtype: roof, ridge point, source; the best measured and its % of the roof;
    then the bandwidth and any note."""
    lines = []
    for dtype, peak in ceilings.peak_tflops.items():
        ridge = ceilings.ridge(dtype)
        ridge_text = f", ridge {ridge:.3g} FLOP/B" if ridge and math.isfinite(ridge) else ""
        lines.append(f"{dtype}: {peak:.4g} TFLOP/s{ridge_text} [{ceilings.sources.get(dtype, '')}]")
        if dtype in ceilings.best_tflops:
            best = ceilings.best_tflops[dtype]
            share = hardware.percent(100 * best / peak)
            lines.append(f"  best measured {best:.4g} TFLOP/s, {share} of the roof "
                         f"[{ceilings.sources.get(f'best {dtype}', '')}]")
    if ceilings.bandwidth_gbps:
        lines.append(f"bandwidth: {ceilings.bandwidth_gbps:.4g} GB/s "
                     f"[{ceilings.sources.get('bandwidth', '')}]")
    return "\n".join(lines + [f"note: {n}" for n in ceilings.notes])
