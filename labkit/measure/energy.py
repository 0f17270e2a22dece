"""Energy of a timed region, read from the hardware's own energy counters.

- GPU: NVML's total-energy counter (`nvmlDeviceGetTotalEnergyConsumption`): millijoules the whole
  board used since the driver was loaded; Volta or newer (older GPUs: `NVMLError_NotSupported`).
  On recent GPUs NVML refreshes it every 20-100 ms (PETSc's `PetscLogGpuEnergyMeter` note), so a
  window of a fraction of a second carries up to that much uncertainty.
- CPU: RAPL through Linux's powercap sysfs (`/sys/class/powercap/intel-rapl:N/energy_uj`, AMD Zen
  exposes the same interface): microjoules per package, each counter wrapping at its
  `max_energy_range_uj`. Only the package domains (`intel-rapl:N` named `package-N`) are summed:
  their subzones (`intel-rapl:N:M`: cores, uncore, dram) are parts of a package, and a `psys`
  domain is the whole platform. A package counter holds every process on the socket, not only this
  one. Since the 2020 Platypus fix (CVE-2020-8694) `energy_uj` is readable by root only.

Either counter gives the device's energy: this process's calls plus what the device draws doing
nothing. `EnergyWindow` measures that idle draw over a short sleep first, so a measurement states
`idle_watts` and the energy above it beside the total. `EnergyUnavailable` says, in one line, why
a device's energy cannot be read here (the message of a skipped row).
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from labkit import hardware
from labkit.measure.clock import clock

POWERCAP_ROOT = "/sys/class/powercap"
POWERCAP_ENV = "LABKIT_POWERCAP_ROOT"  # another powercap tree: a fake one in tests
IDLE_WINDOW_S = 0.5  # the sleep over which the idle draw is measured, before the timed region
_PACKAGE_ZONE = re.compile(r"intel-rapl:\d+")  # not intel-rapl:N:M (subzones), not intel-rapl-mmio
PLATYPUS = "root-only since the 2020 Platypus fix (CVE-2020-8694)"
# each row's unit: these metric names carry none through `results.unit_of`'s suffixes
UNITS = {"joules_per_token": "J/token", "idle_watts": "W", "joules_per_token_above_idle": "J/token"}


class EnergyUnavailable(Exception):
    """This device's energy cannot be read here; the message says why."""


class Meter(Protocol):
    source: str  # what is read, and what it includes

    def joules(self) -> float:
        """Joules so far (from an arbitrary origin): only differences mean anything."""


# --------------------------------------------------------------------------------------- RAPL


def package_zones(root: Path) -> list[Path]:
    """The RAPL package domains under a powercap tree, or EnergyUnavailable saying why none."""
    if not root.is_dir():
        raise EnergyUnavailable(f"no {root}: this kernel exposes no powercap interface (a VM, or "
                                f"a kernel without the intel_rapl driver), so CPU energy is not read")
    zones = sorted(p for p in root.iterdir()
                   if _PACKAGE_ZONE.fullmatch(p.name) and _zone_name(p).startswith("package"))
    if not zones:
        raise EnergyUnavailable(f"{root} has no RAPL package domain (intel-rapl:N named package-N), "
                                "so CPU energy is not read")
    return zones


def _zone_name(zone: Path) -> str:
    try:
        return _read_text(zone / "name").strip()
    except OSError:
        return ""


def _read_text(path: Path) -> str:
    return path.read_text()


def read_uj(path: Path) -> int:
    """One powercap counter in microjoules, or EnergyUnavailable naming why it cannot be read."""
    try:
        return int(_read_text(path))
    except PermissionError:
        raise EnergyUnavailable(f"{path} is not readable: {PLATYPUS}; run as root or make it "
                                "readable (chmod o+r) to measure CPU energy") from None
    except (OSError, ValueError) as e:
        raise EnergyUnavailable(f"cannot read {path}: {e}") from None


def wrapped_delta(before_uj: int, after_uj: int, max_range_uj: int) -> int:
    """Microjoules between two readings of a counter that wraps to 0 past `max_range_uj` (at most
    one wrap in between: a package takes minutes to fill a range)."""
    return after_uj - before_uj if after_uj >= before_uj else max_range_uj - before_uj + after_uj


class RaplMeter:
    """Joules of every CPU package since this meter was made, from RAPL's powercap counters. The
    tree is `root`, else $LABKIT_POWERCAP_ROOT, else /sys/class/powercap."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root or os.environ.get(POWERCAP_ENV) or POWERCAP_ROOT)
        self.zones = package_zones(self.root)
        self._ranges = {z: read_uj(z / "max_energy_range_uj") for z in self.zones}
        self._last = {z: read_uj(z / "energy_uj") for z in self.zones}
        self._total_uj = 0
        self.source = (f"RAPL, {len(self.zones)} CPU package(s) under {self.root} (every process "
                       "on the socket, not only this one)")

    def joules(self) -> float:
        for zone in self.zones:
            now = read_uj(zone / "energy_uj")
            self._total_uj += wrapped_delta(self._last[zone], now, self._ranges[zone])
            self._last[zone] = now
        return self._total_uj / 1e6  # uJ -> J


# --------------------------------------------------------------------------------------- NVML


class NvmlMeter:
    """Joules of GPU `index` (torch numbering) from NVML's total-energy counter."""

    def __init__(self, index: int = 0):
        self._nv, self._handle = hardware._nvml(), hardware._nvml_handle(index)
        if self._nv is None or self._handle is None:
            raise EnergyUnavailable("NVML unavailable (pynvml not installed, no driver, or "
                                    "nvmlInit failed), so GPU energy is not read")
        self.source = (f"NVML total-energy counter of GPU {index} (the whole board; refreshed "
                       "every 20-100 ms)")
        self.joules()  # an unsupported counter says so now, before anything is timed

    def joules(self) -> float:
        nv = self._nv
        try:
            return nv.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1e3  # mJ -> J
        except nv.NVMLError as e:
            if isinstance(e, getattr(nv, "NVMLError_NotSupported", ())):
                raise EnergyUnavailable("this GPU does not report its total energy (NVML: Not "
                                        "Supported; the counter needs Volta or newer)") from None
            raise EnergyUnavailable(f"NVML's total-energy read failed: {e}") from None


def make_meter(device: str, *, powercap_root: str | Path | None = None) -> Meter:
    """The energy meter of `device` ("cpu", "cuda", "cuda:N"), or EnergyUnavailable saying why
    there is none here."""
    if str(device).startswith("cuda"):
        return NvmlMeter(int(device.split(":")[1]) if ":" in device else 0)
    return RaplMeter(powercap_root)


# ----------------------------------------------------------------------------- the timed region


class CountedCalls:
    """`fn`, counting its calls: the energy window divides by exactly the calls made inside it."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.num_calls = fn, 0

    def __call__(self) -> Any:
        self.num_calls += 1
        return self.fn()


@dataclass(frozen=True)
class EnergySpan:
    """`joules` over `seconds` of wall time in which `num_calls` calls ran; `idle_watts` the
    device drew just before, doing nothing."""

    joules: float
    seconds: float
    num_calls: int
    idle_watts: float
    idle_seconds: float
    source: str

    def per_token(self, tokens_per_call: int) -> dict[str, float]:
        """joules_per_token (J/token), idle_watts (W), joules_per_token_above_idle (J/token: the
        energy less idle power x the window's time; noise can make it negative)."""
        tokens = self.num_calls * tokens_per_call
        above = self.joules - self.idle_watts * self.seconds
        return {"joules_per_token": self.joules / tokens, "idle_watts": self.idle_watts,
                "joules_per_token_above_idle": above / tokens}

    def describe(self, tokens_per_call: int) -> str:
        return (f"{self.source}: {self.joules:.4g} J over {self.seconds:.3g} s "
                f"({self.joules / max(self.seconds, 1e-9):.3g} W average) for {self.num_calls} "
                f"calls x {tokens_per_call} tokens (every call in the window, warm-up included); "
                f"idle {self.idle_watts:.3g} W over a {self.idle_seconds:.2g} s sleep just before.")


def idle_watts(meter: Meter, device: str, seconds: float,
               sleep: Callable[[float], None] = time.sleep) -> tuple[float, float]:
    """(watts, seconds measured): the meter's energy over a sleep of `seconds`, the device drained."""
    t0, j0 = clock(device), meter.joules()
    sleep(seconds)
    t1, j1 = clock(device), meter.joules()
    return (j1 - j0) / max(t1 - t0, 1e-9), t1 - t0


class EnergyWindow:
    """Made just before the timed region (after measuring the idle draw over `idle_s`, default
    IDLE_WINDOW_S); `stop(num_calls)` right after it gives the span. Either may raise
    EnergyUnavailable (a counter that stops answering)."""

    def __init__(self, meter: Meter, device: str, idle_s: float | None = None):
        self.meter, self.device = meter, device
        self.idle_watts, self.idle_seconds = idle_watts(meter, device, idle_s or IDLE_WINDOW_S)
        self._t0, self._j0 = clock(device), meter.joules()

    def stop(self, num_calls: int) -> EnergySpan:
        seconds = clock(self.device) - self._t0
        joules = self.meter.joules() - self._j0
        return EnergySpan(joules, seconds, num_calls, self.idle_watts, self.idle_seconds,
                          self.meter.source)


def tdp_bound(device: str, span: EnergySpan, tokens_per_call: int) -> float | None:
    """An upper bound on joules_per_token: the GPU's board power (data/gpus.json's `tdp_w`) for
    the whole window, per token served; None on the CPU or a GPU not in the table."""
    tdp = gpu_tdp_watts(device)
    return None if tdp is None else tdp * span.seconds / (span.num_calls * tokens_per_call)


def gpu_tdp_watts(device: str) -> float | None:
    """The datasheet board power of GPU `device`, or None (the CPU, or a GPU not in the table)."""
    if not str(device).startswith("cuda"):
        return None
    props = torch.cuda.get_device_properties(int(device.split(":")[1]) if ":" in device else 0)
    spec = hardware.gpu_spec(props.name, memory_bytes=props.total_memory)
    return None if spec is None or spec.get("tdp_w") is None else float(spec["tdp_w"])
