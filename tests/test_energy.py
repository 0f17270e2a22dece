"""Energy per token: the RAPL reader on fake powercap trees, the NVML path with a fake pynvml, and
the harness's `joules_per_token` rows (the counter deltas divided by exactly the calls timed)."""
from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import torch

from conftest import FAST, TINY_DECODE

from labkit import cli, hardware
from labkit.harness.experiment import run_experiment
from labkit.measure import energy
from labkit.techniques import kv_cache

# The CPU, read by RAPL (the fake powercap trees below): on a GPU host the default device is
# cuda, read by NVML (test_cuda_paths.py).
SIZES = {**TINY_DECODE, "batch_size": 2, "device": "cpu"}
TOKENS = SIZES["batch_size"] * SIZES["new_tokens"]  # kv_cache's energy_tokens: one step's tokens
BIG = 2**40  # a max_energy_range_uj no test reaches


def zone(root: Path, name: str, label: str, energy_uj: int, max_uj: int = BIG) -> Path:
    """One powercap zone folder as Linux lays it out: name, energy_uj, max_energy_range_uj."""
    d = root / name
    d.mkdir(parents=True)
    (d / "name").write_text(label + "\n")
    (d / "max_energy_range_uj").write_text(f"{max_uj}\n")
    set_uj(d, energy_uj)
    return d


def set_uj(zone_dir: Path, value: int) -> None:
    (zone_dir / "energy_uj").write_text(f"{value}\n")


def get_uj(zone_dir: Path) -> int:
    return int((zone_dir / "energy_uj").read_text())


@pytest.fixture
def tree(tmp_path):
    """Two packages (the second 1,000 uJ short of wrapping), a core subzone, a psys domain, an
    MMIO duplicate of package 0 and the control-type folder: only the two packages count."""
    root = tmp_path / "powercap"
    (root / "intel-rapl").mkdir(parents=True)  # the control type: no counter of its own
    zones = {"pkg0": zone(root, "intel-rapl:0", "package-0", 1_000),
             "pkg1": zone(root, "intel-rapl:1", "package-1", 999_000, max_uj=1_000_000),
             "core": zone(root, "intel-rapl:0:0", "core", 50),
             "psys": zone(root, "intel-rapl:2", "psys", 70),
             "mmio": zone(root, "intel-rapl-mmio:0", "package-0", 90)}
    return root, zones


# --------------------------------------------------------------------------------------- RAPL

def test_rapl_sums_package_domains_only_across_a_wrap(tree):
    root, z = tree
    meter = energy.RaplMeter(root)
    assert [p.name for p in meter.zones] == ["intel-rapl:0", "intel-rapl:1"]
    start = meter.joules()
    set_uj(z["pkg0"], 1_000 + 2_000_000)  # +2 J
    set_uj(z["pkg1"], 500)  # wrapped: 1,000 uJ to the top of its range, then 500
    for other in ("core", "psys", "mmio"):
        set_uj(z[other], 10**9)  # parts of a package, or the platform: never added
    assert meter.joules() - start == pytest.approx((2_000_000 + 1_000 + 500) / 1e6, rel=1e-12)
    set_uj(z["pkg1"], 2_500)  # the next reading continues from the wrapped value
    assert meter.joules() - start == pytest.approx((2_000_000 + 1_500 + 2_000) / 1e6, rel=1e-12)


def test_wrapped_delta():
    assert energy.wrapped_delta(100, 250, 1_000) == 150
    assert energy.wrapped_delta(900, 50, 1_000) == 150


def test_the_root_comes_from_the_environment(tree, monkeypatch):
    root, _ = tree
    monkeypatch.setenv(energy.POWERCAP_ENV, str(root))
    assert energy.RaplMeter().root == root


def test_no_powercap_says_so(tmp_path):
    with pytest.raises(energy.EnergyUnavailable, match=r"no .*absent: this kernel exposes no powercap"):
        energy.RaplMeter(tmp_path / "absent")


def test_no_package_domain_says_so(tmp_path):
    zone(tmp_path, "intel-rapl:0:0", "core", 1)
    with pytest.raises(energy.EnergyUnavailable, match="no RAPL package domain"):
        energy.RaplMeter(tmp_path)


def test_an_unreadable_counter_names_platypus(tree, monkeypatch):
    """As root (these tests may be) a chmod would not stop the read: the read itself is refused."""
    root, _ = tree
    real = energy._read_text

    def refuse(path: Path) -> str:
        if path.name == "energy_uj":
            raise PermissionError(13, "Permission denied", str(path))
        return real(path)

    monkeypatch.setattr(energy, "_read_text", refuse)
    with pytest.raises(energy.EnergyUnavailable, match=r"energy_uj is not readable: .*CVE-2020-8694"):
        energy.RaplMeter(root)


# --------------------------------------------------------------------------------------- NVML

class FakeNVMLError(Exception):
    pass


class FakeNotSupported(FakeNVMLError):
    pass


def fake_pynvml(readings_mj: list[int] | None) -> types.SimpleNamespace:
    """A pynvml whose total-energy counter returns `readings_mj` in turn (None: Not Supported)."""
    def total_energy(handle):
        if readings_mj is None:
            raise FakeNotSupported("Not Supported")
        return readings_mj.pop(0)

    return types.SimpleNamespace(
        NVMLError=FakeNVMLError, NVMLError_NotSupported=FakeNotSupported, nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
        nvmlDeviceGetTotalEnergyConsumption=total_energy)


@pytest.fixture
def nvml(monkeypatch):
    def install(readings_mj):
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(readings_mj))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # handle by index
        hardware._forget_nvml()
    yield install
    hardware._forget_nvml()


def test_nvml_counter_deltas_become_joules_per_token(nvml):
    # made (1 read), idle before/after (2), window start/stop (2); millijoules
    nvml([5_000, 10_000, 10_600, 11_000, 71_000])
    window = energy.EnergyWindow(energy.make_meter("cuda:0"), "cpu", idle_s=0.01)
    span = window.stop(num_calls=4)
    assert span.joules == pytest.approx(60.0)  # (71,000 - 11,000) mJ
    assert span.idle_watts == pytest.approx(0.6 / span.idle_seconds)  # 600 mJ over the sleep
    got = span.per_token(tokens_per_call=3)
    assert got["joules_per_token"] == pytest.approx(60.0 / 12)
    assert got["joules_per_token_above_idle"] == pytest.approx((60.0 - span.idle_watts * span.seconds) / 12)


def test_nvml_not_supported_and_missing_say_why(nvml, monkeypatch):
    nvml(None)
    with pytest.raises(energy.EnergyUnavailable, match="Not Supported.*Volta or newer"):
        energy.make_meter("cuda")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    hardware._forget_nvml()
    with pytest.raises(energy.EnergyUnavailable, match="NVML unavailable"):
        energy.make_meter("cuda")


def test_the_tdp_bound_is_board_power_for_the_window(monkeypatch):
    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=150_000_000_000)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    span = energy.EnergySpan(joules=100.0, seconds=2.0, num_calls=5, idle_watts=80.0,
                             idle_seconds=0.5, source="test")
    tdp = hardware.gpu_spec("NVIDIA H200")["tdp_w"]
    assert energy.tdp_bound("cuda:0", span, 4) == pytest.approx(tdp * 2.0 / 20)
    assert energy.tdp_bound("cpu", span, 4) is None  # no CPU TDP table: no prediction


# ---------------------------------------------------------------------------------- the harness

def energy_row(rows, variant, metric="joules_per_token"):
    (row,) = [r for r in rows if r["variant"] == variant and r["metric"] == metric]
    return row


@pytest.mark.slow
def test_run_says_why_energy_is_missing(tmp_path, monkeypatch, capsys):
    """Through `labkit run`: the skipped row carries the reason; the measured rows stay."""
    monkeypatch.setenv(energy.POWERCAP_ENV, str(tmp_path / "no-powercap"))
    code = cli.main(["run", "kv_cache", "--preset", "tiny", "--json", "--runs-dir", str(tmp_path),
                     *[a for k, v in SIZES.items() for a in ("--set", f"{k}={v}")]])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert code == 0
    row = energy_row(rows, "none")
    assert row["status"] == "skipped" and row["value"] is None
    assert "no-powercap: this kernel exposes no powercap interface" in row["message"]
    assert energy_row(rows, "none", "step_ms")["status"] == "ok"


def bumping_build(monkeypatch, pkg: Path, uj_per_call: int) -> None:
    """kv_cache whose step adds `uj_per_call` to the fake package counter: the energy of a call."""
    real = kv_cache.build

    def build(cfg):
        wl = real(cfg)
        step = wl.step

        def bumped():
            set_uj(pkg, get_uj(pkg) + uj_per_call)
            return step()

        return dataclasses.replace(wl, step=bumped)

    monkeypatch.setattr(kv_cache, "build", build)


@pytest.mark.slow
def test_energy_is_divided_by_exactly_the_calls_timed(tree, tmp_path, monkeypatch):
    """1 J per call and nothing while idle: joules_per_token is 1 J / one call's tokens only when
    the window's calls are counted exactly (warm-up and calibration included)."""
    root, z = tree
    monkeypatch.setenv(energy.POWERCAP_ENV, str(root))
    monkeypatch.setattr(energy, "IDLE_WINDOW_S", 0.01)
    bumping_build(monkeypatch, z["pkg0"], 1_000_000)
    rows = run_experiment("kv_cache", preset="tiny", variants=["static"], runs_dir=str(tmp_path),
                          overrides={**SIZES, **FAST, "min_run_time_s": 0.05}, progress=False).rows
    for variant in ("none", "static"):
        jpt = energy_row(rows, variant)
        assert jpt["status"] == "ok" and jpt["unit"] == "J/token"
        assert jpt["value"] == pytest.approx(1.0 / TOKENS, rel=1e-9)
        assert jpt["predicted"] is None  # the CPU has no TDP in the table: no prediction
        assert energy_row(rows, variant, "idle_watts")["value"] == 0.0
        above = energy_row(rows, variant, "joules_per_token_above_idle")
        assert above["value"] == pytest.approx(jpt["value"], rel=1e-9)


@pytest.mark.slow
def test_a_counter_failing_after_timing_keeps_the_timing(tree, tmp_path, monkeypatch):
    root, _ = tree
    monkeypatch.setenv(energy.POWERCAP_ENV, str(root))
    monkeypatch.setattr(energy, "IDLE_WINDOW_S", 0.01)

    def fail(self, num_calls):
        raise energy.EnergyUnavailable("the counter vanished")

    monkeypatch.setattr(energy.EnergyWindow, "stop", fail)
    rows = run_experiment("kv_cache", preset="tiny", variants=["none"], runs_dir=str(tmp_path),
                          overrides=SIZES, progress=False).rows
    row = energy_row(rows, "none")
    assert row["status"] == "skipped" and row["message"] == "the counter vanished"
    assert energy_row(rows, "none", "step_ms")["status"] == "ok"
    assert energy_row(rows, "none", "tokens_per_s")["value"] > 0
