import re
import sys
import time
import types
import urllib.error
import urllib.request

import pytest
import torch

from labkit import hardware
from labkit.measure import monitor as mon
from labkit.measure.monitor import DeviceMonitor, prometheus_text

LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; every line must be a comment or a sample."""
    out = {}
    for line in text.strip().splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = LINE.match(line)
        assert match, line
        out[match.group(1) + (match.group(2) or "")] = float(match.group(3))
    return out


def test_cpu_monitor_samples_the_process_with_phase_marks():
    with DeviceMonitor("cpu", interval_s=0.005) as monitor:
        for phase in ("forward", "backward"):
            monitor.mark(phase)
            end = time.perf_counter() + 0.1
            x = torch.randn(128, 128)
            while time.perf_counter() < end:
                x = torch.tanh(x @ x)
    frame = monitor.frame()
    assert monitor.source == "cpu" and list(frame.columns) == ["t_s", "phase", "cpu_pct", "rss_bytes"]
    assert len(frame) >= 4 and frame["t_s"].is_monotonic_increasing
    assert list(dict.fromkeys(frame["phase"])) in (["", "forward", "backward"], ["forward", "backward"])
    assert frame["cpu_pct"].iloc[1:].notna().all() and (frame["cpu_pct"] > 0).any()
    assert (frame["rss_bytes"] > 0).all()
    assert list(monitor.markers()["phase"]) == ["forward", "backward"]
    fig = monitor.figure()
    marks = [t for t in fig.data if t.mode == "markers"]  # a diamond per mark in each of the two panels
    assert [len(t.x) for t in marks] == [2, 2] and list(marks[0].hovertext) == ["forward", "backward"]
    assert {t.name for t in fig.data if t.mode == "lines"} >= {"forward", "backward"}
    small = mon.timeline_figure(frame, monitor.markers(), fields=("utilization_pct", "rss_bytes",
                                                                  "cpu_pct"), max_fields=1)
    assert [t.name for t in small.data if t.mode == "markers"] == ["rss_bytes marks"]  # no NVML here


def test_rss_is_read_from_statm(tmp_path):
    statm = tmp_path / "statm"
    statm.write_text("1000 25 10 1 0 50 0\n")
    import os
    assert mon.rss_bytes(str(statm)) == 25 * os.sysconf("SC_PAGE_SIZE")
    assert mon.rss_bytes(str(tmp_path / "missing")) is None


class FakeNVMLError(Exception):
    pass


def fake_pynvml(*, init_fails=False, power_fails=False) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVMLError, nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM, nv.NVML_TEMPERATURE_GPU = FakeNVMLError, 1, 2, 0

    def init():
        if init_fails:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def power(handle):
        if power_fails:
            raise FakeNVMLError("Not Supported")
        return 312_500  # milliwatts

    nv.nvmlInit = init
    nv.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=40 * 2**30, total=80 * 2**30)
    nv.nvmlDeviceGetPowerUsage = power
    nv.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=87, memory=40)
    nv.nvmlDeviceGetClockInfo = lambda h, kind: {1: 1980, 2: 2619}[kind]
    nv.nvmlDeviceGetTemperature = lambda h, sensor: 61
    return nv


@pytest.fixture
def nvml(monkeypatch):
    """Install a fake pynvml (a factory taking its failure modes); NVML state reset around it."""
    def install(**kw):
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(**kw))
        hardware._forget_nvml()
    yield install
    hardware._forget_nvml()


def test_nvml_readings_are_parsed_into_units(nvml):
    nvml()
    monitor = DeviceMonitor("cuda:0", interval_s=0.01)
    assert monitor.source == "nvml" and monitor.note == ""
    sample = monitor.sample()
    assert sample["utilization_pct"] == 87 and sample["memory_used_bytes"] == 40 * 2**30
    assert sample["power_draw_w"] == 312.5 and sample["sm_clock_mhz"] == 1980
    assert sample["temperature_c"] == 61 and sample["rss_bytes"] > 0
    assert list(monitor.frame().columns)[2:] == [*mon.GPU_FIELDS, *mon.CPU_FIELDS]


def test_an_unsupported_reading_is_missing_not_invented(nvml):
    nvml(power_fails=True)
    monitor = DeviceMonitor("cuda", interval_s=0.01)
    monitor.sample()
    frame = monitor.frame()
    assert frame["power_draw_w"].isna().all() and frame["utilization_pct"].iloc[0] == 87
    assert "labkit_gpu_power_watts" not in prometheus_text(monitor.latest())


def test_without_nvml_the_monitor_falls_back_to_the_process(nvml):
    nvml(init_fails=True)
    monitor = DeviceMonitor("cuda:0")
    assert monitor.source == "cpu" and "NVML unavailable" in monitor.note
    assert monitor.fields == mon.CPU_FIELDS
    assert set(monitor.sample()) == {"t_s", "phase", "cpu_pct", "rss_bytes"}


def test_prometheus_text_of_a_gpu_sample():
    sample = {"phase": "forward", "utilization_pct": 87, "memory_used_bytes": 2**30, "power_draw_w": None,
              "cpu_pct": 99.5, "rss_bytes": 1000}
    metrics = parse(prometheus_text(sample, gpu="1", labels={"participant": 'a"b'}, num_samples=7))
    assert metrics == {
        'labkit_gpu_utilization_pct{device="1",participant="a\\"b"}': 87.0,
        'labkit_gpu_memory_used_bytes{device="1",participant="a\\"b"}': 2.0**30,
        'labkit_process_cpu_pct{device="cpu",participant="a\\"b"}': 99.5,
        'labkit_process_rss_bytes{device="cpu",participant="a\\"b"}': 1000.0,
        'labkit_phase{participant="a\\"b",phase="forward"}': 1.0,
        'labkit_monitor_samples{participant="a\\"b"}': 7.0}


@pytest.mark.slow
def test_the_metrics_endpoint_serves_parseable_text(nvml):
    nvml()
    monitor = DeviceMonitor("cuda:0", interval_s=0.01)
    monitor.mark("optimizer")
    monitor.sample()
    server = monitor.serve(port=0)
    try:
        with urllib.request.urlopen(server.url, timeout=5) as response:
            assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            metrics = parse(response.read().decode())
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(server.url.replace("/metrics", "/other"), timeout=5)
    finally:
        server.stop()
    assert metrics['labkit_gpu_utilization_pct{device="0"}'] == 87
    assert metrics['labkit_gpu_power_watts{device="0"}'] == 312.5
    assert metrics['labkit_phase{phase="optimizer"}'] == 1
