"""What machine is this, and what are its limits?

Three jobs, in order of the file:

1. Describe the devices: ``available_devices``, ``cpu_info``, ``gpu_info`` (torch properties plus
   NVML readings) and ``nvml_sample`` (one cheap reading for a background monitor).
2. Give the ceilings every measurement is compared against: ``ceilings`` returns datasheet peaks
   for a GPU (``data/gpus.json`` via ``gpu_spec``); for the CPU, its physical ceiling (``cpu_peak``:
   cores x FMA units x lanes x 2 x clock, from cpuinfo and ``data/cpus.json``) plus a short
   *measured* calibration and copy bandwidth.
3. Record the context of a result: ``env_knobs`` and ``fingerprint``.

Importing this module is cheap: no NVML init, no ``torch.cuda`` call, no calibration. NVML is
initialised lazily on first use and then kept for the life of the process (init is refcounted and
a monitor samples often, so re-initialising per call would cost more than it saves).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from labkit.measure.clock import repeat_seconds
from labkit.measure.modes import unmetered
from labkit.measure.timer import cpu_threads

DATA_DIR: Path = Path(__file__).resolve().parents[1] / "data"
REPO_DIR = Path(__file__).resolve().parents[1]  # the source checkout

# Flags that decide which CPU kernels (and which dtypes) run natively.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16",
              "amx_int8")


# ---------------------------------------------------------------- devices


def available_devices() -> list[str]:
    """``["cpu"]``, plus ``"cuda"`` and ``"cuda:0"``..``"cuda:N-1"`` when CUDA is available.

    N is what torch sees, so ``CUDA_VISIBLE_DEVICES`` is respected.
    """
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devices


def default_device() -> str:
    """``"cuda"`` if torch can use a GPU, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- CPU


@dataclass(frozen=True)
class CpuInfo:
    """The host CPU as torch uses it."""

    model: str
    num_cores: int  # logical CPUs (os.cpu_count)
    torch_threads: int  # intra-op threads torch uses now
    flags: tuple[str, ...]  # the subset of _CPU_FLAGS present
    capability: str  # torch.backends.cpu.get_cpu_capability(), e.g. "AVX512"

    @property
    def native_bf16(self) -> bool:
        """True when bf16 matmuls have hardware support (otherwise they are emulated, ~50x slower)."""
        return "avx512_bf16" in self.flags or "amx_bf16" in self.flags


def cpu_info() -> CpuInfo:
    """Describe the CPU; static parts are read once, ``torch_threads`` on every call."""
    model, flags, capability = _cpu_static()
    return CpuInfo(model, os.cpu_count() or 1, torch.get_num_threads(), flags, capability)


@functools.lru_cache(maxsize=1)
def _cpu_static() -> tuple[str, tuple[str, ...], str]:
    """(model, flags, capability) from /proc/cpuinfo, or torch's capability off Linux."""
    capability = torch.backends.cpu.get_cpu_capability()
    model, present = _parse_cpuinfo()
    if present is None:  # not Linux: infer what we can from the kernel torch dispatches to
        present = {"AVX512": {"avx2", "avx512f"}, "AVX2": {"avx2"}}.get(capability, set())
    model = model or platform.processor() or platform.machine() or "unknown CPU"
    return model, tuple(f for f in _CPU_FLAGS if f in present), capability


def _parse_cpuinfo(path: str = "/proc/cpuinfo") -> tuple[str | None, set[str] | None]:
    """The first processor's "model name" and flags in /proc/cpuinfo; (None, None) if unreadable."""
    fields = _cpuinfo_fields(_read_text(path))
    return (fields.get("model name"), _cpuinfo_flags(fields)) if fields else (None, None)


def _cpuinfo_flags(fields: dict[str, str]) -> set[str]:
    """The CPU's flags ("Features" on ARM) from `_cpuinfo_fields`."""
    return set((fields.get("flags") or fields.get("Features") or "").split())


def _memory_total_bytes() -> int | None:
    """Physical RAM: /proc/meminfo MemTotal, else sysconf; None if neither works."""
    with contextlib.suppress(OSError, ValueError):
        match = re.search(r"^MemTotal:\s*(\d+)\s*kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
        if match:
            return int(match.group(1)) * 1024
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


# ---------------------------------------------------------------- GPU


@dataclass(frozen=True)
class GpuInfo:
    """One visible GPU: torch properties, plus NVML readings (None when NVML is unavailable)."""

    index: int  # torch index (after CUDA_VISIBLE_DEVICES)
    name: str
    compute_capability: tuple[int, int]
    multiprocessors: int
    l2_cache_bytes: int | None
    memory_total_bytes: int
    memory_used_bytes: int | None = None  # all processes, as NVML sees it
    sm_clock_mhz: int | None = None
    mem_clock_mhz: int | None = None
    max_sm_clock_mhz: int | None = None
    power_draw_w: float | None = None
    power_limit_w: float | None = None  # enforced limit
    utilization_pct: int | None = None
    driver: str | None = None
    temperature_c: int | None = None

    @property
    def tensor_core_dtypes(self) -> tuple[str, ...]:
        """Dtypes with tensor-core matmuls, by compute capability.

        Rule: <7.0 none (Pascal and older); 7.0 Volta float16 only; 7.2/7.5 (Xavier, Turing) add
        int8; 8.0-8.8 Ampere float16, bfloat16, tf32, int8; 8.9 Ada and 9.x Hopper add float8;
        >=10 Blackwell adds float4.
        """
        cc = self.compute_capability
        if cc < (7, 0):
            return ()
        if cc < (8, 0):
            return ("float16",) if cc == (7, 0) else ("float16", "int8")
        ampere = ("float16", "bfloat16", "tf32", "int8")
        if cc < (8, 9):
            return ampere
        return ampere + ("float8",) if cc < (10, 0) else ampere + ("float8", "float4")


def gpu_info() -> list[GpuInfo]:
    """Every GPU torch can see, in torch order; ``[]`` without CUDA. NVML failures leave None."""
    if not torch.cuda.is_available():
        return []
    return [_gpu_at(i) for i in range(torch.cuda.device_count())]


def _gpu_at(index: int) -> GpuInfo:
    props = torch.cuda.get_device_properties(index)
    return GpuInfo(
        index=index,
        name=props.name,
        compute_capability=(props.major, props.minor),
        multiprocessors=props.multi_processor_count,
        l2_cache_bytes=getattr(props, "L2_cache_size", None),  # absent in older torch
        memory_total_bytes=props.total_memory,
        **_nvml_fields(index),
    )


def nvml_sample(index: int = 0) -> dict[str, Any] | None:
    """One cheap NVML reading of GPU ``index`` (torch numbering), or None without NVML or GPU.

    Keys: memory_used_bytes, sm_clock_mhz, power_draw_w, utilization_pct, temperature_c; a value
    is None when the GPU does not report it. Meant to be polled by a background monitor.
    """
    nv, handle = _nvml(), _nvml_handle(index)
    if nv is None or handle is None:
        return None
    return _read_sample(nv, handle)


def _read_sample(nv: Any, handle: Any) -> dict[str, Any]:
    memory = _nvml_try(nv, nv.nvmlDeviceGetMemoryInfo, handle)
    power_mw = _nvml_try(nv, nv.nvmlDeviceGetPowerUsage, handle)  # NVML reports milliwatts
    utilization = _nvml_try(nv, nv.nvmlDeviceGetUtilizationRates, handle)
    return {
        "memory_used_bytes": None if memory is None else int(memory.used),
        "sm_clock_mhz": _nvml_try(nv, nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_SM),
        "power_draw_w": None if power_mw is None else power_mw / 1000.0,
        "utilization_pct": None if utilization is None else int(utilization.gpu),
        "temperature_c": _nvml_try(nv, nv.nvmlDeviceGetTemperature, handle, nv.NVML_TEMPERATURE_GPU),
    }


def _nvml_fields(index: int) -> dict[str, Any]:
    """The NVML half of GpuInfo as keyword arguments; {} when NVML cannot see this GPU."""
    nv, handle = _nvml(), _nvml_handle(index)
    if nv is None or handle is None:
        return {}
    limit_mw = _nvml_try(nv, nv.nvmlDeviceGetEnforcedPowerLimit, handle)
    driver = _nvml_try(nv, nv.nvmlSystemGetDriverVersion)
    return {
        **_read_sample(nv, handle),
        "mem_clock_mhz": _nvml_try(nv, nv.nvmlDeviceGetClockInfo, handle, nv.NVML_CLOCK_MEM),
        "max_sm_clock_mhz": _nvml_try(nv, nv.nvmlDeviceGetMaxClockInfo, handle, nv.NVML_CLOCK_SM),
        "power_limit_w": None if limit_mw is None else limit_mw / 1000.0,
        "driver": driver.decode() if isinstance(driver, bytes) else driver,  # old pynvml: bytes
    }


@functools.lru_cache(maxsize=1)
def _nvml() -> Any | None:
    """The initialised ``pynvml`` module, or None (not installed, no driver, init failed)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    return pynvml


@functools.lru_cache(maxsize=None)
def _nvml_handle(index: int) -> Any | None:
    """NVML handle for torch GPU ``index``: by PCI bus id (survives CUDA_VISIBLE_DEVICES), else by index."""
    nv = _nvml()
    if nv is None:
        return None
    bus_id = _torch_pci_bus_id(index)
    if bus_id is not None:
        with contextlib.suppress(nv.NVMLError):
            return nv.nvmlDeviceGetHandleByPciBusId(bus_id)
    try:
        return nv.nvmlDeviceGetHandleByIndex(index)
    except nv.NVMLError:
        return None


def _torch_pci_bus_id(index: int) -> str | None:
    """'domain:bus:device.0' (hex) of torch GPU ``index``, None if torch cannot tell."""
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    props = torch.cuda.get_device_properties(index)
    ids = [getattr(props, f"pci_{part}_id", None) for part in ("domain", "bus", "device")]
    if any(i is None for i in ids):
        return None
    return f"{ids[0]:08x}:{ids[1]:02x}:{ids[2]:02x}.0"


def _nvml_try(nv: Any, fn: Callable[..., Any], *args: Any) -> Any | None:
    """``fn(*args)``, or None when NVML says the GPU does not support or answer it."""
    try:
        return fn(*args)
    except nv.NVMLError:
        return None


def _forget_nvml() -> None:
    """Drop the cached NVML session and handles (tests swap pynvml in and out)."""
    _nvml.cache_clear()
    _nvml_handle.cache_clear()


# ---------------------------------------------------------------- datasheet specs


def load_gpu_specs() -> list[dict[str, Any]]:
    """Rows of ``data/gpus.json`` (a fresh copy; the file is read once per process)."""
    return copy.deepcopy(_spec_rows())


@functools.lru_cache(maxsize=1)
def _spec_rows() -> list[dict[str, Any]]:
    with open(DATA_DIR / "gpus.json", encoding="utf-8") as f:
        return json.load(f)["gpus"]


def _tokens(text: str) -> str:
    """Lowercase, non-alphanumeric runs -> one space, padded, so ' a10 ' never matches ' a100 '."""
    return " " + " ".join(re.split(r"[^a-z0-9]+", text.lower())).strip() + " "


def gpu_spec(name: str, *, memory_bytes: int | None = None) -> dict[str, Any] | None:
    """The ``gpus.json`` row for a device name such as "NVIDIA H100 80GB HBM3", or None.

    A row matches when one of its ``match`` patterns appears as whole tokens in the name and none
    of its ``exclude`` patterns does. The longest matching pattern wins ("h100 pcie" over
    "h100"); ties go to the row whose ``memory_gib`` is closest to ``memory_bytes`` if given,
    else to the first row in the file.
    """
    target = _tokens(name)
    best, best_key = None, None
    for row in _spec_rows():
        if any(_tokens(p) in target for p in row.get("exclude", ())):
            continue
        lengths = [len(p) for p in row["match"] if _tokens(p) in target]
        if not lengths:
            continue
        gap = 0.0 if memory_bytes is None else abs(row["memory_gib"] - memory_bytes / 2**30)
        key = (max(lengths), -gap)
        if best_key is None or key > best_key:
            best, best_key = row, key
    return copy.deepcopy(best)


# ---------------------------------------------------------------- ceilings


# ---------------------------------------------------------------- CPU physical peak

# Clock assumed when no source gives one: the fastest boost clock of a shipping x86 CPU (Intel
# Core i9-14900KS, 6.2 GHz), so that the ceiling errs high rather than low.
_FALLBACK_GHZ = 6.2
_MAX_FREQ_PATH = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"  # kHz, max turbo
_AMX = {"bfloat16": "amx_bf16", "float16": "amx_fp16"}
_AVX512_16 = {"bfloat16": "avx512_bf16", "float16": "avx512_fp16"}
_AMX_FLOP_PER_CYCLE = 1024  # one 16x16x32 tile product (16384 FLOPs) per 16 cycles per core


@dataclass(frozen=True)
class CpuPeak:
    """The physical matmul ceiling of ``num_cores`` cores, term by term, each with its source.

    fp32 FLOP/cycle/core = fma_units x (vector_bits / 32) lanes x 2 (an FMA is a multiply and an
    add); the 16-bit dtypes follow the instructions the flags name (see ``_flop_per_cycle``).
    """

    num_cores: int
    fma_units: int
    vector_bits: int
    clock_ghz: float
    flop_per_cycle: dict[str, int]  # per core, per dtype key
    sources: dict[str, str]  # "cores", "fma", "clock" and each dtype key -> where it came from

    @property
    def tflops(self) -> dict[str, float]:
        return {k: self.num_cores * f * self.clock_ghz * 1e9 / 1e12 for k, f in self.flop_per_cycle.items()}

    def describe(self) -> str:
        terms = (f"{self.num_cores} core(s) [{self.sources['cores']}] x {self.fma_units} FMA unit(s) "
                 f"x {self.vector_bits // 32} fp32 lanes [{self.sources['fma']}] x 2 FLOP/FMA x "
                 f"{self.clock_ghz:.3g} GHz [{self.sources['clock']}]")
        return "physical ceiling: " + terms + "; " + "; ".join(
            f"{k} {v} FLOP/cycle/core ({self.sources[k]})" for k, v in self.flop_per_cycle.items())


def cpu_peak(num_threads: int, cpuinfo: str | None = None, max_freq_khz: int | None = None,
             *, num_cpus: int | None = None) -> CpuPeak:
    """The physical ceiling of ``num_threads`` cores of this CPU (or of the given /proc/cpuinfo
    text and cpufreq maximum, in kHz: the tests pass synthetic ones)."""
    if cpuinfo is None:
        cpuinfo, max_freq_khz = _read_text("/proc/cpuinfo"), _read_max_freq_khz()
    fields = _cpuinfo_fields(cpuinfo)
    flags = _cpuinfo_flags(fields)
    if not cpuinfo:  # not Linux: the flags torch's kernel capability implies
        flags = set(_cpu_static()[1])
    cores = min(num_threads, num_cpus or os.cpu_count() or num_threads)
    row = _cpu_row(fields)
    units, bits, fma_source = _fma_layout(row, fields, flags)
    ghz, clock_source = _clock_ghz(cpuinfo, fields.get("model name", ""), max_freq_khz, row)
    per_cycle, sources = _flop_per_cycle(units, bits, flags)
    sources.update(cores=f"{num_threads} torch thread(s) of {num_cpus or os.cpu_count()} logical CPUs; "
                         "SMT siblings share a core's FMA units, so with SMT this errs high",
                   fma=fma_source, clock=clock_source)
    return CpuPeak(cores, units, bits, ghz, per_cycle, sources)


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _read_max_freq_khz() -> int | None:
    text = _read_text(_MAX_FREQ_PATH).strip()
    return int(text) if text.isdigit() else None


def _cpuinfo_fields(text: str) -> dict[str, str]:
    """The first processor's "key : value" lines of /proc/cpuinfo (keys as written)."""
    out: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out.setdefault(key.strip(), value.strip())
    return out


@functools.lru_cache(maxsize=1)
def cpu_table() -> list[dict[str, Any]]:
    """Rows of ``data/cpus.json``: FMA units and width per microarchitecture."""
    with open(DATA_DIR / "cpus.json", encoding="utf-8") as f:
        return json.load(f)["cpus"]


def _cpu_row(fields: dict[str, str]) -> dict[str, Any] | None:
    """The data/cpus.json row of this vendor / cpu family / model, or None."""
    vendor, family, model = fields.get("vendor_id"), fields.get("cpu family"), fields.get("model")
    if not (family and family.isdigit() and model and model.isdigit()):
        return None
    return next((row for row in cpu_table() if (row["vendor"], row["family"]) == (vendor, int(family))
                 and any(lo <= int(model) <= hi for lo, hi in row["models"])), None)


def _fma_layout(row: dict[str, Any] | None, fields: dict[str, str],
                flags: set[str]) -> tuple[int, int, str]:
    """(FMA units per core, their width in bits, source): the table row's, else 2 units (4 on
    ARM) at the widest vector width the flags give."""
    if row is not None:
        return row["fma_units"], row["fma_bits"], f"data/cpus.json {row['name']}: {row['source']}"
    vendor = fields.get("vendor_id")
    where = (f"{vendor} family {fields.get('cpu family')} model {fields.get('model')}"
             if vendor else "this CPU")
    if "sve" in flags:
        return 2, 512, f"no data/cpus.json row for {where}: assumed 2 x 512-bit SVE FMA units (errs high)"
    if "asimd" in flags or platform.machine().lower() in ("arm64", "aarch64"):
        return 4, 128, f"no data/cpus.json row for {where}: assumed 4 x 128-bit NEON FMA units (errs high)"
    bits = 512 if "avx512f" in flags else 256 if flags & {"avx2", "fma", "avx"} else 128
    return 2, bits, (f"no data/cpus.json row for {where}: assumed 2 FMA units at the widest vector "
                     f"width of its flags ({bits} bits); an upper bound, up to 2x high")


def _clock_ghz(cpuinfo: str, model_name: str, max_freq_khz: int | None,
               row: dict[str, Any] | None) -> tuple[float, str]:
    """The clock of the ceiling, and its source: cpufreq's maximum (turbo) where the machine
    exposes it; otherwise (a VM) the highest boost of any part of the table row (else
    _FALLBACK_GHZ), since the reported clock ("cpu MHz", the model name's "@ x.xxGHz") is a
    nominal one a core boosts past. Never below any reported clock."""
    mhz = [float(m) for m in re.findall(r"^cpu MHz\s*:\s*([\d.]+)", cpuinfo, re.MULTILINE)]
    reported = [(max(mhz) / 1e3, "highest 'cpu MHz' in /proc/cpuinfo")] if mhz else []
    named = re.search(r"@\s*([\d.]+)\s*GHz", model_name)
    if named:
        reported.append((float(named.group(1)), "the model name's clock"))
    if max_freq_khz:
        return max([(max_freq_khz / 1e6, f"{_MAX_FREQ_PATH} (max turbo)"), *reported])
    if row is not None:
        bound = (row["max_boost_ghz"], f"the highest boost of any {row['name']} part ({row['boost_source']})")
    else:
        bound = (_FALLBACK_GHZ, f"{_FALLBACK_GHZ} GHz, the fastest boost of any shipping x86 CPU")
    seen = ", ".join(f"{g:.3g} GHz from the {src.removeprefix('the ')}" for g, src in reported) or "none"
    ghz, source = max([bound, *reported])
    return ghz, (f"{source}: this machine does not expose its maximum clock (as in most VMs; "
                 f"reported: {seen}), so the ceiling takes the highest it could be")


def _flop_per_cycle(units: int, bits: int, flags: set[str]) -> tuple[dict[str, int], dict[str, str]]:
    """FLOP/cycle/core per dtype, with sources. fp32: units x lanes x 2. bf16/fp16: AMX tiles
    (1024), else AVX-512 16-bit instructions (twice the lanes: 2x fp32), else converted to fp32
    and multiplied there, so fp32's rate bounds them."""
    fp32 = units * (bits // 32) * 2
    out, sources = {"float32": fp32}, {"float32": f"{units} x {bits // 32} lanes x 2"}
    for dtype in ("bfloat16", "float16"):
        if _AMX[dtype] in flags:
            out[dtype] = _AMX_FLOP_PER_CYCLE
            sources[dtype] = f"{_AMX[dtype]}: one 16x16x32 tile per 16 cycles"
        elif _AVX512_16[dtype] in flags:
            out[dtype], sources[dtype] = 2 * fp32, f"{_AVX512_16[dtype]}: twice fp32's lanes"
        else:
            out[dtype] = fp32
            sources[dtype] = ("no native instructions: emulated via fp32, so bounded by fp32's "
                              "rate (an upper bound, not a datasheet figure)")
    return out, sources


# ---------------------------------------------------------------- ceilings


@dataclass(frozen=True)
class Ceilings:
    """The limits a measurement is reported against. Treat as read-only: CPU results are cached.

    ``peak_tflops`` is an upper bound: a GPU's datasheet, or the CPU's physical ceiling
    (``cpu_peak``). ``calibrated_tflops`` is the best a quick matmul measured here (the CPU's,
    per dtype; empty on a GPU), drawn as the best measured point below the roof.
    """

    device: str  # "cuda:0" or "cpu"
    name: str
    peak_tflops: dict[str, float]  # dense peak per dtype key; int8 in TOPS; only known keys
    bandwidth_gbps: float | None  # memory bandwidth, GB/s (1e9 bytes/s); measured on the CPU
    memory_bytes: int | None
    source: str  # the datasheet URL, or each CPU term's source and how the calibration ran
    measured: bool  # True when bandwidth and calibrated_tflops were measured here (the CPU)
    calibrated_tflops: dict[str, float] = field(default_factory=dict)  # measured, per dtype key
    notes: tuple[str, ...] = ()  # e.g. a calibration above its ceiling: the ceiling is wrong
    sources: dict[str, str] = field(default_factory=dict)  # CPU: each term of the ceiling -> source


def ceilings(device: str | torch.device = "auto", *, num_threads: int = 1) -> Ceilings:
    """Peak compute and bandwidth of ``device`` ("auto", "cpu", "cuda", "cuda:N").

    GPU: datasheet numbers from ``data/gpus.json`` (empty peaks for an unknown GPU).
    CPU: the physical ceiling of ``num_threads`` cores (``cpu_peak``), a measured bandwidth and a
    <1 s matmul calibration (``calibrated_tflops``) with ``num_threads`` torch threads, cached per
    ``num_threads`` for the life of the process.
    """
    if _SIMULATED_GPU and str(device).startswith("cuda") and not torch.cuda.is_available():
        return _spec_ceilings(str(device), _SIMULATED_GPU[-1], None)
    resolved = _resolve_device(device)
    if resolved == "cpu":
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        return _cpu_ceilings(num_threads)
    return _gpu_ceilings(int(resolved.split(":")[1]))


def peak_tflops(device: str | torch.device = "auto", *, num_threads: int = 1) -> dict[str, float]:
    """`ceilings(device, num_threads=num_threads).peak_tflops` without the CPU's calibration:
    the physical ceiling is read, not measured (what a prediction needs: every rank of a launch
    asks for it, and each rank is a new process that would calibrate again)."""
    if _is_cpu(device):
        return cpu_peak(num_threads).tflops
    return ceilings(device, num_threads=num_threads).peak_tflops


def bandwidth_gbps(device: str | torch.device = "auto", *, num_threads: int = 1) -> float | None:
    """`ceilings(device, num_threads=num_threads).bandwidth_gbps`; on the CPU the copy alone is
    measured (once per process and thread count), not the matmul calibration."""
    if _is_cpu(device):
        return _cpu_bandwidth(num_threads)
    return ceilings(device, num_threads=num_threads).bandwidth_gbps


def _is_cpu(device: str | torch.device) -> bool:
    return (default_device() if str(device) == "auto" else str(device)) == "cpu"


def _resolve_device(device: str | torch.device) -> str:
    """'cpu' or 'cuda:N'; raises when a GPU is asked for and torch has none."""
    text = default_device() if str(device) == "auto" else str(device)
    if text == "cpu":
        return text
    parsed = torch.device(text)
    if parsed.type != "cuda":
        raise ValueError(f"unsupported device for ceilings: {device!r}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"{device!r} requested but torch sees no CUDA device")
    return f"cuda:{parsed.index or 0}"


# The GPU whose datasheet `ceilings("cuda")` answers with on a machine without one, inside
# `simulated_gpu()`: formulas (an exercise's reference for a GPU) need no GPU to be computed.
_SIMULATED_GPU: list[str] = []


@contextlib.contextmanager
def simulated_gpu(name: str = "NVIDIA H200"):
    """Within the block, `ceilings("cuda")` on a machine without a GPU gives `name`'s datasheet
    ceilings (nothing is measured; a real GPU, when present, still wins)."""
    if gpu_spec(name) is None:
        raise ValueError(f"{name!r} is not in data/gpus.json")
    _SIMULATED_GPU.append(name)
    try:
        yield
    finally:
        _SIMULATED_GPU.pop()


def _gpu_ceilings(index: int) -> Ceilings:
    props = torch.cuda.get_device_properties(index)
    return _spec_ceilings(f"cuda:{index}", props.name, props.total_memory)


def _spec_ceilings(device: str, name: str, memory_bytes: int | None) -> Ceilings:
    spec = gpu_spec(name, memory_bytes=memory_bytes)
    if spec is None:
        return Ceilings(device, name, {}, None, memory_bytes, "unknown GPU: not in data/gpus.json",
                        measured=False)
    return Ceilings(
        device=device,
        name=name,
        peak_tflops={k: float(v) for k, v in spec["peak_tflops"].items()},
        bandwidth_gbps=float(spec["bandwidth_gbps"]),
        memory_bytes=memory_bytes or int(spec["memory_gib"] * 2**30),
        source=spec["source"],
        measured=False,
    )


@functools.lru_cache(maxsize=None)
def _cpu_ceilings(num_threads: int) -> Ceilings:
    """The physical ceiling of ``num_threads`` cores, and a calibration with that many threads
    (torch's thread count restored after), unmetered (`_cpu_bandwidth`)."""
    with cpu_threads(num_threads), unmetered():
        calibrated = {
            "float32": _matmul_tflops(1024, torch.float32),
            # small: without avx512_bf16/amx bf16 (avx512_fp16 for fp16) is emulated, ~50x slower
            "bfloat16": _matmul_tflops(256, torch.bfloat16),
            "float16": _matmul_tflops(256, torch.float16),
        }
    bandwidth = _cpu_bandwidth(num_threads)
    peak = cpu_peak(num_threads)
    model = cpu_info().model
    measured = (f"measured on this CPU ({model}, {num_threads} thread(s)), median of 3 after "
                "warm-up: ")
    sources = {**peak.sources,
               **{k: f"{peak.num_cores} core(s) x {f} FLOP/cycle ({peak.sources[k]}) x "
                     f"{peak.clock_ghz:.3g} GHz" for k, f in peak.flop_per_cycle.items()},
               "calibration": measured + "fp32 matmul 1024^3, bf16 and fp16 256^3",
               "bandwidth": measured + "a 64 MiB copy (read + write); a VM gives no DRAM spec"}
    source = f"{peak.describe()}. {sources['calibration']}; bandwidth {sources['bandwidth']}"
    return Ceilings("cpu", model, peak.tflops, bandwidth, _memory_total_bytes(), source,
                    measured=True, calibrated_tflops=calibrated,
                    notes=over_ceiling(calibrated, peak.tflops), sources=sources)


@functools.lru_cache(maxsize=None)
def _cpu_bandwidth(num_threads: int) -> float:
    """A 64 MiB copy's GB/s with `num_threads` torch threads (torch's thread count restored).
    Unmetered: the first call may come inside an experiment's memory meter (collectives' notes
    name the ceiling in its build), whose virtual budget the copy's two 64 MiB buffers would
    pass (a 4 KiB all-reduce was an `oom` row under a 0.05 GiB budget), and whose dispatch
    would be timed with the copy."""
    with cpu_threads(num_threads), unmetered():
        return _copy_gbps(64 * 2**20)


def percent(share: float) -> str:
    """A percentage to two significant figures, whole above 10: "0.48%", "9.1%", "55%", "100%"."""
    return f"{share:.0f}%" if share >= 10 else f"{share:.2g}%"


def over_ceiling(measured: dict[str, float], peaks: dict[str, float]) -> tuple[str, ...]:
    """One note per dtype whose measured rate beats its ceiling: a bug in the ceiling (usually a
    clock below the turbo the core ran at), never clamped."""
    return tuple(f"{k}: measured {v:.4g} TFLOP/s is {percent(100 * v / peaks[k])} of its "
                 f"ceiling {peaks[k]:.4g}: the ceiling is too low (a clock below the turbo clock?)"
                 for k, v in measured.items() if peaks.get(k) and v > peaks[k])


def _median_seconds(fn: Callable[[], object], *, repeats: int = 3, warmup: int = 1) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after ``warmup`` runs (CPU only: no sync)."""
    return statistics.median(repeat_seconds(fn, device="cpu", repeats=repeats, warmup=warmup))


def _matmul_tflops(n: int, dtype: torch.dtype) -> float:
    """Achieved TFLOP/s of an (n, n) @ (n, n) matmul: 2 n^3 flops."""
    a = torch.randn(n, n).to(dtype)
    b = torch.randn(n, n).to(dtype)
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b)) / 1e12


def _copy_gbps(num_bytes: int) -> float:
    """Achieved GB/s of copying ``num_bytes``, counting read + write (2 * num_bytes)."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.zeros_like(src)  # zeros_like touches the pages so first-touch faults are not timed
    return 2 * num_bytes / _median_seconds(lambda: dst.copy_(src)) / 1e9


# ---------------------------------------------------------------- context of a result

# Variables that change what the lab measures: device visibility, allocator, threading, kernels.
_ENV_EXACT = frozenset({
    "CUDA_VISIBLE_DEVICES", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING", "CUDA_DEVICE_MAX_CONNECTIONS",
    "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_NO_CUDA_MEMORY_CACHING",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "OMP_PROC_BIND", "KMP_AFFINITY",
    "KMP_BLOCKTIME", "GOMP_CPU_AFFINITY", "OMP_DYNAMIC", "OPENBLAS_NUM_THREADS",
    "TRITON_INTERPRET", "NVIDIA_TF32_OVERRIDE", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG",
})
_ENV_PREFIXES = ("TORCH_CUDNN_V8_API_", "NCCL_", "TORCHINDUCTOR_", "LABKIT_")


def env_knobs() -> dict[str, str]:
    """The set environment variables that change measurements, sorted by name."""
    return {k: v for k, v in sorted(os.environ.items())
            if k in _ENV_EXACT or k.startswith(_ENV_PREFIXES)}


def fingerprint() -> dict[str, Any]:
    """JSON-safe description of machine and software, stored with every result.

    Static parts are gathered once per process; ``cpu.torch_threads`` and ``env`` are re-read on
    every call. Each call returns a fresh dict.
    """
    result = copy.deepcopy(_static_fingerprint())
    result["cpu"]["torch_threads"] = torch.get_num_threads()
    result["env"] = env_knobs()
    return result


@functools.lru_cache(maxsize=1)
def _static_fingerprint() -> dict[str, Any]:
    cpu = cpu_info()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "device": default_device(),
        "gpus": [_gpu_fingerprint(g) for g in gpu_info()],
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": {"model": cpu.model, "num_cores": cpu.num_cores, "flags": list(cpu.flags)},
        "hostname": socket.gethostname(),
        "git_commit": _git_commit(REPO_DIR),
    }


def _gpu_fingerprint(gpu: GpuInfo) -> dict[str, Any]:
    major, minor = gpu.compute_capability
    return {
        "name": gpu.name,
        "compute_capability": f"{major}.{minor}",
        "memory_total_bytes": gpu.memory_total_bytes,
        "driver": gpu.driver,
        "sm_clock_mhz": gpu.sm_clock_mhz,
        "max_sm_clock_mhz": gpu.max_sm_clock_mhz,
        "power_limit_w": gpu.power_limit_w,
    }


@functools.lru_cache(maxsize=1)
def inductor_cpu_problem() -> str | None:
    """Why torch.compile's CPU backend (Inductor's C++ code) cannot build kernels here, or None
    when its compiler answers."""
    import shutil

    from torch._inductor import cpp_builder

    try:
        cxx = cpp_builder.get_cpp_compiler()
        if shutil.which(cxx) is None:
            return f"Inductor's CPU backend needs a C++ compiler; {cxx!r} is not on PATH"
        subprocess.run([cxx, "--version"], check=True, capture_output=True, timeout=30)
    except Exception as e:  # any failure to find or run the compiler is the reason to skip
        return f"Inductor's CPU backend needs a working C++ compiler: {type(e).__name__}: {e}"
    return None


def _git_commit(repo: Path) -> str | None:
    """Short HEAD of ``repo``, with "-dirty" if ``git status --porcelain`` lists anything; None
    if ``repo`` is not a git checkout or git is missing or slow (2 s timeout per command)."""
    head = _git(repo, "rev-parse", "--short", "HEAD")
    if not head:
        return None
    status = _git(repo, "status", "--porcelain")
    return head + "-dirty" if status else head


def _git(repo: Path, *args: str) -> str | None:
    """Stripped stdout of ``git args`` in ``repo``, None on any failure."""
    try:
        done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def describe() -> str:
    """A few readable lines about this machine: devices, ceilings, software, knobs."""
    fp, ceil = fingerprint(), ceilings("auto")
    cpu = fp["cpu"]
    lines = [f"device      {ceil.device} ({ceil.name})",
             f"cpu         {cpu['model']}, {cpu['num_cores']} cores, flags: {', '.join(cpu['flags']) or '-'}"]
    for g in fp["gpus"]:
        lines.append(f"gpu         {g['name']}, cc {g['compute_capability']}, "
                     f"{g['memory_total_bytes'] / 2**30:.1f} GiB, driver {g.get('driver')}")
    lines += _ceiling_lines(ceil)
    lines.append(f"torch       {fp['torch']} (CUDA {fp['cuda']}), python {fp['python']}")
    knobs = ", ".join(f"{k}={v}" for k, v in fp["env"].items())
    lines.append(f"env knobs   {knobs or 'none set'}")
    return "\n".join(lines)


def _ceiling_lines(ceil: Ceilings) -> list[str]:
    """The ceilings, then (on a CPU) each term's source, the calibration as % of the ceiling,
    and any note."""
    peaks = ", ".join(f"{k} {v:.3g}" for k, v in ceil.peak_tflops.items()) or "unknown"
    bandwidth = f"{ceil.bandwidth_gbps:.0f} GB/s" if ceil.bandwidth_gbps else "unknown GB/s"
    if not ceil.calibrated_tflops:
        return [f"ceilings    {peaks} TFLOP/s; {bandwidth} ({ceil.source})"]
    lines = [f"ceilings    {peaks} TFLOP/s physical (cores x FMA units x lanes x 2 x clock); "
             f"{bandwidth} measured"]
    lines += [f"  {term:<11} {source}" for term, source in ceil.sources.items()]
    calibrated = ", ".join(f"{k} {v:.3g} ({percent(100 * v / ceil.peak_tflops[k])})"
                           for k, v in ceil.calibrated_tflops.items() if ceil.peak_tflops.get(k))
    lines.append(f"calibrated  {calibrated} TFLOP/s (% of the ceiling)")
    return lines + [f"note        {note}" for note in ceil.notes]


def architecture() -> list[dict[str, Any]]:
    """One row per device (the CPU, then each GPU): what it is and which dtypes it runs natively."""
    cpu = cpu_info()
    rows = [{"device": "cpu", "name": cpu.model, "cores / SMs": cpu.num_cores,
             "memory_gib": round((_memory_total_bytes() or 0) / 2**30, 1),
             "native 16-bit matmul": ", ".join(f for f in cpu.flags if "bf16" in f or "fp16" in f) or "none",
             "notes": f"kernel capability {cpu.capability}"}]
    for g in gpu_info():
        l2 = f"L2 {g.l2_cache_bytes / 2**20:.0f} MiB" if g.l2_cache_bytes else "L2 unknown"
        rows.append({"device": f"cuda:{g.index}", "name": g.name, "cores / SMs": g.multiprocessors,
                     "memory_gib": round(g.memory_total_bytes / 2**30, 1),
                     "native 16-bit matmul": "tensor cores: " + (", ".join(g.tensor_core_dtypes) or "none"),
                     "notes": f"compute capability {g.compute_capability[0]}.{g.compute_capability[1]}, {l2}"})
    return rows


# --- torch's private entry points, used through these two functions only ------------------------

def has_triton() -> bool:
    """Whether Triton is installed and usable by torch (torch.utils._triton: no public name)."""
    from torch.utils._triton import has_triton as probe

    return probe()


def set_allocator_settings(settings: str) -> None:
    """Change the caching allocator's settings at run time (the PYTORCH_CUDA_ALLOC_CONF syntax).
    New segments follow them; existing ones keep theirs (the caller empties the cache first)."""
    # torch.cuda.memory._set_allocator_settings exists from 2.6 on and calls whatever its torch
    # parses CUDA settings with; newer torch deprecates it (a FutureWarning) for the
    # device-generic torch._C._accelerator_setAllocatorSettings, used once the old name is gone.
    legacy = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if legacy is None:
        torch._C._accelerator_setAllocatorSettings(settings)
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        legacy(settings)
