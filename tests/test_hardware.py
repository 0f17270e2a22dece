"""Mechanism tests for labkit.hardware; they run on a CPU-only machine in a few seconds.

GPU paths are exercised with fake torch.cuda properties and a fake pynvml module, so what is
checked is the plumbing (matching, unit conversion, failure handling), not real hardware.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from labkit import hardware

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU-only behaviour")
GIB = 2**30


@pytest.fixture(autouse=True)
def _fresh_caches():
    """NVML and fingerprint caches would leak fakes between tests."""
    hardware._forget_nvml()
    hardware._static_fingerprint.cache_clear()
    yield
    hardware._forget_nvml()
    hardware._static_fingerprint.cache_clear()


def _fake_props(name="NVIDIA H200", memory_bytes=150_000_000_000, bus=0x1A):
    return types.SimpleNamespace(
        name=name, major=9, minor=0, multi_processor_count=132, L2_cache_size=50 * 2**20,
        total_memory=memory_bytes, pci_domain_id=0, pci_bus_id=bus, pci_device_id=0,
    )


@pytest.fixture
def fake_cuda(monkeypatch):
    """Make torch report one GPU whose properties the test can set via the returned dict."""
    state = {"props": _fake_props()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: state["props"])
    return state


class _FakeNVMLError(Exception):
    pass


def _fake_pynvml(calls: dict) -> types.SimpleNamespace:
    """A pynvml stand-in: one GPU, power in mW like the real library, no temperature sensor."""

    def by_bus_id(bus_id):
        calls["bus_id"] = bus_id
        return "handle0"

    def no_sensor(handle, sensor):
        raise _FakeNVMLError("not supported")

    return types.SimpleNamespace(
        NVMLError=_FakeNVMLError, NVML_CLOCK_SM=1, NVML_CLOCK_MEM=2, NVML_TEMPERATURE_GPU=0,
        nvmlInit=lambda: calls.setdefault("init", 0),
        nvmlDeviceGetHandleByPciBusId=by_bus_id,
        nvmlDeviceGetHandleByIndex=lambda i: "handle-by-index",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=3 * GIB, total=141 * GIB),
        nvmlDeviceGetPowerUsage=lambda h: 250_500,  # mW
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000,  # mW
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87, memory=40),
        nvmlDeviceGetClockInfo=lambda h, clock: {1: 1980, 2: 2619}[clock],
        nvmlDeviceGetMaxClockInfo=lambda h, clock: 1980,
        nvmlDeviceGetTemperature=no_sensor,
        nvmlSystemGetDriverVersion=lambda: b"570.86.15",  # old pynvml returns bytes
    )


# ---------------------------------------------------------------- devices


@CPU_ONLY
def test_cpu_only_machine_sees_only_cpu():
    assert hardware.available_devices() == ["cpu"]
    assert hardware.default_device() == "cpu"
    assert hardware.gpu_info() == []
    assert hardware.nvml_sample() is None


def test_available_devices_lists_each_gpu(fake_cuda):
    assert hardware.available_devices() == ["cpu", "cuda", "cuda:0"]
    assert hardware.default_device() == "cuda"


@pytest.mark.slow
def test_importing_touches_neither_nvml_nor_cuda():
    code = (
        "import pynvml, torch\n"
        "def boom(*a, **k): raise SystemExit('called at import time')\n"
        "pynvml.nvmlInit = boom; torch.cuda.is_available = boom; torch.cuda.device_count = boom\n"
        "torch.mm = boom\n"
        "import labkit.hardware\n"
    )
    repo = Path(hardware.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# ---------------------------------------------------------------- CPU


def test_cpu_info_reads_model_flags_and_live_thread_count():
    info = hardware.cpu_info()
    assert info.model and info.num_cores >= 1
    assert set(info.flags) <= set(hardware._CPU_FLAGS)
    assert info.capability == torch.backends.cpu.get_cpu_capability()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert hardware.cpu_info().torch_threads == 1
    finally:
        torch.set_num_threads(previous)


def test_parse_cpuinfo_and_native_bf16(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 amx_bf16\n\n"
                    "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu avx2 amx_bf16\n")
    assert hardware._parse_cpuinfo(str(path)) == ("Test CPU 9000", {"fpu", "avx2", "amx_bf16"})
    assert hardware._parse_cpuinfo(str(tmp_path / "missing")) == (None, None)
    make = lambda flags: hardware.CpuInfo("x", 1, 1, flags, "AVX2")  # noqa: E731
    assert make(("avx2", "amx_bf16")).native_bf16
    assert make(("avx512f", "avx512_bf16")).native_bf16
    assert not make(("avx2", "avx512f")).native_bf16


# ---------------------------------------------------------------- GPU and NVML


def test_nvml_init_failure_leaves_nvml_fields_none(fake_cuda, monkeypatch):
    pynvml = pytest.importorskip("pynvml")

    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    (gpu,) = hardware.gpu_info()
    assert (gpu.name, gpu.compute_capability, gpu.multiprocessors) == ("NVIDIA H200", (9, 0), 132)
    assert gpu.l2_cache_bytes == 50 * 2**20
    assert gpu.driver is None and gpu.power_draw_w is None and gpu.memory_used_bytes is None
    assert hardware.nvml_sample(0) is None
    fp = hardware.fingerprint()
    assert fp["gpus"][0]["compute_capability"] == "9.0" and fp["gpus"][0]["driver"] is None
    json.dumps(fp)


def test_missing_pynvml_is_handled(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    assert hardware.gpu_info()[0].sm_clock_mhz is None
    assert hardware.nvml_sample() is None


def test_nvml_readings_are_mapped_by_pci_bus_and_converted(fake_cuda, monkeypatch):
    calls: dict = {}
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(calls))
    (gpu,) = hardware.gpu_info()
    assert calls["bus_id"] == "00000000:1a:00.0"
    assert gpu.power_draw_w == pytest.approx(250.5) and gpu.power_limit_w == pytest.approx(700.0)
    assert (gpu.sm_clock_mhz, gpu.mem_clock_mhz, gpu.max_sm_clock_mhz) == (1980, 2619, 1980)
    assert gpu.memory_used_bytes == 3 * GIB and gpu.utilization_pct == 87
    assert gpu.driver == "570.86.15"
    assert gpu.temperature_c is None  # unsupported sensor -> None, not an exception
    sample = hardware.nvml_sample(0)
    assert set(sample) == {"memory_used_bytes", "sm_clock_mhz", "power_draw_w", "utilization_pct",
                           "temperature_c"}
    assert sample["power_draw_w"] == pytest.approx(250.5)


@pytest.mark.parametrize("cc, expected", [
    ((6, 1), ()),
    ((7, 0), ("float16",)),
    ((7, 5), ("float16", "int8")),
    ((8, 0), ("float16", "bfloat16", "tf32", "int8")),
    ((8, 6), ("float16", "bfloat16", "tf32", "int8")),
    ((8, 9), ("float16", "bfloat16", "tf32", "int8", "float8")),
    ((9, 0), ("float16", "bfloat16", "tf32", "int8", "float8")),
    ((10, 0), ("float16", "bfloat16", "tf32", "int8", "float8", "float4")),
    ((12, 0), ("float16", "bfloat16", "tf32", "int8", "float8", "float4")),
])
def test_tensor_core_dtypes_rule(cc, expected):
    gpu = hardware.GpuInfo(index=0, name="x", compute_capability=cc, multiprocessors=1,
                           l2_cache_bytes=None, memory_total_bytes=1)
    assert gpu.tensor_core_dtypes == expected


# ---------------------------------------------------------------- gpus.json


REQUIRED = ("name", "match", "architecture", "compute_capability", "memory_gib", "bandwidth_gbps",
            "peak_tflops", "sms", "l2_cache_mib", "tdp_w", "interconnect", "interconnect_gbps",
            "source", "notes")
PEAK_KEYS = {"float32", "tf32", "float16", "bfloat16", "float8", "int8", "float4"}


def test_gpus_json_rows_are_complete_and_consistent():
    raw = json.loads((hardware.DATA_DIR / "gpus.json").read_text())
    assert raw["schema"] and raw["gpus"] == hardware.load_gpu_specs()
    rows = hardware.load_gpu_specs()
    assert len({r["name"] for r in rows}) == len(rows) >= 17
    for row in rows:
        assert all(k in row for k in REQUIRED), row["name"]
        for key in ("memory_gib", "bandwidth_gbps", "sms", "l2_cache_mib", "tdp_w", "interconnect_gbps"):
            assert row[key] > 0, (row["name"], key)
        assert row["source"].startswith("https://") and row["notes"]
        assert row["match"] and all(p == p.lower() for p in row["match"])
        peaks = row["peak_tflops"]
        assert set(peaks) <= PEAK_KEYS and all(v > 0 for v in peaks.values()) and peaks["float32"] > 0
        assert peaks.get("bfloat16", peaks["float32"]) >= peaks["float32"], row["name"]
        major, minor = map(int, row["compute_capability"].split("."))
        gpu = hardware.GpuInfo(0, row["name"], (major, minor), row["sms"], None, 1)
        assert set(peaks) - {"float32"} <= set(gpu.tensor_core_dtypes), row["name"]


@pytest.mark.parametrize("device_name, row_name", [
    ("NVIDIA H200", "H200 SXM 141GB"),
    ("NVIDIA H200 NVL", "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM5 80GB"),
    ("NVIDIA H100 PCIe", "H100 PCIe 80GB"),
    ("NVIDIA H100 NVL", "H100 NVL"),
    ("NVIDIA GeForce RTX 4090", "GeForce RTX 4090"),
    ("NVIDIA GeForce RTX 3090", "GeForce RTX 3090"),
    ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100 SXM4 40GB"),
    ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB"),
    ("NVIDIA A10", "A10"),
    ("NVIDIA L4", "L4"),
    ("NVIDIA L40S", "L40S"),
    ("NVIDIA RTX A6000", "RTX A6000"),
    ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada Generation"),
    ("Tesla V100-SXM2-32GB", "V100 SXM2 32GB"),
    ("Tesla T4", "T4"),
    ("NVIDIA B200", "B200"),
])
def test_gpu_spec_matches_device_names(device_name, row_name):
    assert hardware.gpu_spec(device_name)["name"] == row_name


@pytest.mark.parametrize("device_name", [
    "Foo GPU", "NVIDIA GeForce RTX 3090 Ti", "NVIDIA GH200 480GB", "NVIDIA GB200", "NVIDIA A10G",
    "NVIDIA L40", "Quadro RTX 6000",
])
def test_gpu_spec_unknown_names_give_none(device_name):
    assert hardware.gpu_spec(device_name) is None


def test_gpu_spec_ties_broken_by_memory_and_returns_copies():
    assert hardware.gpu_spec("NVIDIA A100", memory_bytes=int(39.4 * GIB))["name"] == "A100 SXM4 40GB"
    assert hardware.gpu_spec("NVIDIA A100", memory_bytes=int(79.2 * GIB))["name"] == "A100 SXM4 80GB"
    row = hardware.gpu_spec("NVIDIA L4")
    row["peak_tflops"]["float32"] = -1.0
    assert hardware.gpu_spec("NVIDIA L4")["peak_tflops"]["float32"] > 0


# ---------------------------------------------------------------- ceilings


def test_cpu_ceilings_are_cached_per_thread_count_and_restore_threads():
    previous = torch.get_num_threads()
    first = hardware.ceilings("cpu")
    assert torch.get_num_threads() == previous
    assert first.measured and first.device == "cpu" and first.source.startswith("physical ceiling")
    assert set(first.calibrated_tflops) == set(first.peak_tflops) == {"float32", "bfloat16", "float16"}
    assert first.bandwidth_gbps > 0 and first.memory_bytes > 0
    assert hardware.ceilings("cpu") is first and hardware.ceilings("cpu", num_threads=1) is first
    assert first.peak_tflops == hardware.cpu_peak(1).tflops


def test_the_cpu_calibration_is_invisible_to_a_memory_meter_around_it():
    """First measured inside an experiment's memory meter (collectives' notes name the ceiling in
    its build), the copy's two 64 MiB buffers and the matmuls neither count nor pass its
    virtual budget."""
    from labkit.measure.memory import LiveTensorTracker

    hardware._cpu_bandwidth.cache_clear()
    hardware._cpu_ceilings.cache_clear()
    with LiveTensorTracker(budget_bytes=2**20) as tracker:
        assert hardware.bandwidth_gbps("cpu") > 0 and hardware.ceilings("cpu").bandwidth_gbps > 0
    assert tracker.peak_bytes == 0


def test_the_physical_ceiling_bounds_this_machines_calibration():
    """The ceiling's inputs come from this machine's cpuinfo; a calibration above it is a bug."""
    ceil = hardware.ceilings("cpu")
    assert ceil.notes == ()
    for dtype, measured in ceil.calibrated_tflops.items():
        assert 0 < measured <= ceil.peak_tflops[dtype], dtype


def _cpuinfo(vendor, family, model, flags, *, name="Test CPU", mhz=None, cpus=2):
    block = (f"processor\t: {{i}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
             f"model\t\t: {model}\nmodel name\t: {name}\n"
             + (f"cpu MHz\t\t: {mhz}\n" if mhz else "") + f"flags\t\t: fpu {flags}\n")
    return "\n".join(block.format(i=i) for i in range(cpus))


AMD, INTEL = "AuthenticAMD", "GenuineIntel"
SKX = "Intel(R) Xeon(R) Platinum 8168 CPU @ 2.70GHz"
# name: (cpuinfo, cpufreq max kHz, threads, FLOP/cycle/core fp32 bf16 fp16, clock GHz, fp32 TFLOP/s)
PEAK_CASES = {
    "zen2 avx2, VM": (_cpuinfo(AMD, 23, 49, "fma avx2", mhz=2249.998), None, 2, (32, 32, 32), 4.7, 0.3008),
    "zen3 avx2, cpufreq": (_cpuinfo(AMD, 25, 1, "fma avx2", mhz=2450.0), 3_500_000, 2, (32, 32, 32), 3.5, 0.224),
    "skylake-sp": (_cpuinfo(INTEL, 6, 85, "fma avx2 avx512f", name=SKX), 3_700_000, 1, (64, 64, 64), 3.7, 0.2368),
    "sapphire rapids": (_cpuinfo(INTEL, 6, 143, "avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile"),
                        None, 1, (64, 1024, 128), 4.8, 0.3072),
    "zen4": (_cpuinfo(AMD, 25, 17, "avx2 avx512f avx512_bf16", mhz=2400.0), None, 1, (32, 64, 32), 5.7, 0.1824),
    "zen5": (_cpuinfo(AMD, 26, 2, "avx2 avx512f avx512_bf16", mhz=2596.1), None, 2, (64, 128, 64), 5.7, 0.7296),
    "unknown, cpufreq": (_cpuinfo(INTEL, 6, 151, "fma avx2", mhz=800.0), 4_900_000, 2, (32, 32, 32), 4.9, 0.3136),
    "unknown, VM": (_cpuinfo(INTEL, 6, 151, "fma avx2", mhz=3000.0), None, 1, (32, 32, 32), 6.2, 0.1984),
    "name above cpufreq": (_cpuinfo(INTEL, 6, 151, "avx2", name="X @ 3.10GHz"), 3_000_000, 1, (32, 32, 32), 3.1,
                           0.0992),
}


@pytest.mark.parametrize("case", PEAK_CASES)
def test_cpu_peak_is_cores_x_fma_units_x_lanes_x_2_x_clock(case):
    text, max_khz, threads, per_cycle, ghz, fp32_tflops = PEAK_CASES[case]
    peak = hardware.cpu_peak(threads, text, max_khz, num_cpus=2)
    assert peak.flop_per_cycle == dict(zip(("float32", "bfloat16", "float16"), per_cycle))
    assert peak.clock_ghz == ghz and peak.num_cores == threads
    assert peak.tflops["float32"] == pytest.approx(fp32_tflops, rel=1e-12)
    assert peak.tflops["bfloat16"] == pytest.approx(fp32_tflops * per_cycle[1] / per_cycle[0], rel=1e-12)
    assert set(peak.sources) == {"cores", "fma", "clock", "float32", "bfloat16", "float16"}


def test_cpu_peak_sources_name_the_row_the_default_and_the_emulation():
    zen2 = PEAK_CASES["zen2 avx2, VM"][0]
    peak = hardware.cpu_peak(4, zen2, None, num_cpus=2)
    assert peak.num_cores == 2  # threads past the logical CPUs add no FMA units
    assert peak.sources["fma"].startswith("data/cpus.json AMD Zen 2")
    assert peak.sources["clock"].startswith("the highest boost of any AMD Zen 2 part")
    assert "does not expose its maximum clock" in peak.sources["clock"] and "2.25 GHz" in peak.sources["clock"]
    assert "emulated via fp32" in peak.sources["bfloat16"] and "avx512_bf16" in hardware.cpu_peak(
        1, PEAK_CASES["zen4"][0], None, num_cpus=2).sources["bfloat16"]
    skx = hardware.cpu_peak(1, PEAK_CASES["skylake-sp"][0], 3_700_000, num_cpus=2)
    assert skx.sources["clock"] == f"{hardware._MAX_FREQ_PATH} (max turbo)"
    unknown = hardware.cpu_peak(1, PEAK_CASES["unknown, VM"][0], None, num_cpus=2)
    assert unknown.sources["fma"].startswith("no data/cpus.json row for GenuineIntel family 6 model 151: "
                                             "assumed 2 FMA units at the widest vector width of its flags (256")
    assert unknown.sources["clock"].startswith("6.2 GHz, the fastest boost of any shipping x86 CPU")


def test_cpu_peak_without_cpuinfo_uses_torchs_capability_and_the_fallback_clock():
    peak = hardware.cpu_peak(1, "", None, num_cpus=1)
    bits = 512 if "avx512f" in hardware.cpu_info().flags else 256 if "avx2" in hardware.cpu_info().flags else None
    assert peak.clock_ghz == 6.2 and "reported: none" in peak.sources["clock"]
    if bits:  # x86: the widest vector width torch dispatches to
        assert peak.vector_bits == bits and peak.fma_units == 2


def test_cpus_json_rows_are_complete_and_do_not_overlap():
    seen = set()
    for row in hardware.cpu_table():
        assert {"name", "vendor", "family", "models", "fma_units", "fma_bits", "max_boost_ghz",
                "boost_source", "source"} <= set(row)
        assert row["fma_bits"] in (128, 256, 512) and row["fma_units"] in (1, 2, 4)
        for lo, hi in row["models"]:
            models = {(row["vendor"], row["family"], m) for m in range(lo, hi + 1)}
            assert not models & seen, row["name"]
            seen |= models


def test_a_measurement_over_its_ceiling_is_a_note_not_a_clamp():
    notes = hardware.over_ceiling({"float32": 1.2, "bfloat16": 0.5}, {"float32": 1.0, "bfloat16": 1.0})
    assert len(notes) == 1 and notes[0].startswith("float32: measured 1.2 TFLOP/s is 120%")
    assert hardware.over_ceiling({"float32": 1.0}, {"float32": 1.0}) == ()


@CPU_ONLY
def test_auto_means_cpu_and_cuda_is_refused_without_gpu():
    assert hardware.ceilings("auto").device == "cpu"
    with pytest.raises(RuntimeError):
        hardware.ceilings("cuda")
    with pytest.raises(ValueError):
        hardware.ceilings("cpu", num_threads=0)


def test_gpu_ceilings_come_from_the_spec_row(fake_cuda, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    ceil = hardware.ceilings("cuda")
    assert ceil.device == "cuda:0" and not ceil.measured
    assert ceil.peak_tflops["bfloat16"] == pytest.approx(989.5)
    assert ceil.bandwidth_gbps == 4800 and ceil.memory_bytes == 150_000_000_000
    assert ceil.source.startswith("https://")
    fake_cuda["props"] = _fake_props(name="Foo GPU")
    unknown = hardware.ceilings("cuda:0")
    assert unknown.peak_tflops == {} and unknown.bandwidth_gbps is None
    assert unknown.source == "unknown GPU: not in data/gpus.json"


# ---------------------------------------------------------------- env and fingerprint


def test_env_knobs_picks_up_measurement_variables(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("LABKIT_SEED", "7")
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    monkeypatch.setenv("NOT_NCCL_DEBUG", "x")
    knobs = hardware.env_knobs()
    assert knobs["OMP_NUM_THREADS"] == "3" and knobs["NCCL_DEBUG"] == "INFO"
    assert knobs["LABKIT_SEED"] == "7" and knobs["TORCHINDUCTOR_MAX_AUTOTUNE"] == "1"
    assert "UNRELATED_VARIABLE" not in knobs and "NOT_NCCL_DEBUG" not in knobs
    assert hardware.fingerprint()["env"]["NCCL_DEBUG"] == "INFO"


def test_fingerprint_is_json_safe_and_rereads_threads():
    fp = hardware.fingerprint()
    json.dumps(fp)
    assert fp["torch"] == torch.__version__ and fp["cpu"]["model"] == hardware.cpu_info().model
    assert {"device", "gpus", "cuda", "cudnn", "python", "platform", "hostname", "git_commit"} <= set(fp)
    commit = fp["git_commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{4,40}(-dirty)?", commit)
    fp["cpu"]["model"] = "mutated"
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        again = hardware.fingerprint()
    finally:
        torch.set_num_threads(previous)
    assert again["cpu"]["torch_threads"] == 1 and again["cpu"]["model"] != "mutated"


def test_git_commit_is_none_outside_a_checkout(tmp_path):
    assert hardware._git_commit(tmp_path) is None


def test_git_commit_short_hash_then_dirty(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    try:
        subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True, timeout=10)
        (tmp_path / "a.txt").write_text("a")
        subprocess.run([*git, "add", "a.txt"], cwd=tmp_path, check=True, timeout=10)
        subprocess.run([*git, "commit", "-qm", "a"], cwd=tmp_path, check=True, timeout=10)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("git unavailable")
    clean = hardware._git_commit(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{4,40}", clean)
    (tmp_path / "a.txt").write_text("b")
    assert hardware._git_commit(tmp_path) == clean + "-dirty"
