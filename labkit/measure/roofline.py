"""Roofline units: achieved TFLOP/s and GB/s against the device's ceilings."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RooflinePoint:
    tflops: float                 # achieved, 1e12 FLOP/s
    gbps: float | None            # achieved, 1e9 bytes/s (None when bytes unknown)
    pct_peak_flops: float | None  # of the dtype's peak
    pct_bandwidth: float | None
    intensity: float | None       # FLOP per byte
    bound: str | None             # "compute" or "memory": which side of the ridge the point sits on


def roofline(flops: float, seconds: float, *, bytes_moved: float | None = None,
             peak_tflops: float | None = None, bandwidth_gbps: float | None = None) -> RooflinePoint:
    """Place one measured step against the ceilings (any of which may be unknown)."""
    tflops = flops / seconds / 1e12
    gbps = bytes_moved / seconds / 1e9 if bytes_moved else None
    pct_f = 100 * tflops / peak_tflops if peak_tflops else None
    pct_b = 100 * gbps / bandwidth_gbps if gbps and bandwidth_gbps else None
    intensity = flops / bytes_moved if bytes_moved else None
    bound = None
    if intensity is not None and peak_tflops and bandwidth_gbps:
        ridge = peak_tflops * 1e12 / (bandwidth_gbps * 1e9)  # FLOP/byte where the roofs meet
        bound = "compute" if intensity >= ridge else "memory"
    return RooflinePoint(tflops, gbps, pct_f, pct_b, intensity, bound)
