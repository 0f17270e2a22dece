import pandas as pd
import pytest

from conftest import FAST

from labkit import hardware
from labkit.views import roofline
from labkit.harness.experiment import run_experiment
from labkit.results import RunRecord, load_results

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds


def test_ridge_point_and_roof_are_the_formulas():
    assert roofline.ridge_point(100.0, 2000.0) == pytest.approx(50.0)  # 100e12 / 2000e9
    assert roofline.attainable_tflops(10.0, 100.0, 2000.0) == pytest.approx(20.0)  # 10 x 2 TB/s
    assert roofline.attainable_tflops(50.0, 100.0, 2000.0) == pytest.approx(100.0)  # at the ridge
    assert roofline.attainable_tflops(500.0, 100.0, 2000.0) == 100.0
    assert roofline.attainable_tflops(1.0, 100.0, None) == 100.0
    assert roofline.ridge_point(100.0, None) is None


def _row(variant, metric, value, *, status="ok", sweep=None, experiment="matmul", run_id="r1"):
    return {"run_id": run_id, "experiment": experiment, "variant": variant, "metric": metric,
            "value": value, "status": status, "rank": 0, "env": {},
            "params": {"device": "cpu", "sweep": sweep or {}, "size": (sweep or {}).get("size", 0)}}


def test_points_pair_tflops_with_gbps_per_run_variant_and_sweep_point():
    frame = pd.DataFrame([
        _row("fp32", "tflops", 2.0, sweep={"size": 1}), _row("fp32", "gbps", 100.0, sweep={"size": 1}),
        _row("fp32", "tflops", 4.0, sweep={"size": 2}), _row("fp32", "gbps", 50.0, sweep={"size": 2}),
        _row("fp16", "tflops", 1.0),  # no bandwidth row: no point
        _row("bf16", "tflops", 1.0, status="error"), _row("bf16", "gbps", 1.0, status="error"),
        _row("static", "tflops", 0.5, experiment="kv_cache"),
        _row("static", "achieved_gbps", 500.0, experiment="kv_cache"),
    ])
    pts = roofline.points(frame)
    assert list(pts["label"]) == ["matmul/fp32 size=1", "matmul/fp32 size=2", "kv_cache/static"]
    assert list(pts["intensity"]) == pytest.approx([20.0, 80.0, 1.0])  # FLOP/B = 1e3 x TFLOP/s / GB/s
    assert list(pts["gbps_metric"]) == ["gbps", "gbps", "achieved_gbps"]
    assert roofline.points(frame.iloc[:0]).empty


def _store(runs_dir, experiment, rows, *, params, env=None):
    record = RunRecord(experiment, env or hardware.fingerprint(), params, runs_dir)
    record.add([{"params": params, "rank": 0, "unit": "", "predicted": None, "message": "",
                 "status": "ok", **r} for r in rows])
    record.finish()


def test_roofs_are_the_physical_ceiling_and_the_best_measurement_sits_below(tmp_path):
    runs = str(tmp_path)
    base = hardware.ceilings("cpu")
    empty = roofline.ceilings_for("cpu", runs)
    assert empty.peak_tflops == base.peak_tflops and empty.best_tflops == base.calibrated_tflops
    assert empty.bandwidth_gbps == base.bandwidth_gbps
    assert all(empty.sources[k].startswith("physical") for k in base.peak_tflops)
    assert all(empty.sources[f"best {k}"].startswith("quick calibration") for k in base.peak_tflops)
    assert empty.sources["bandwidth"].startswith("quick calibration")
    peak, cal = base.peak_tflops["float32"], base.calibrated_tflops["float32"]
    params = {"device": "cpu", "num_threads": 1, "size": 512, "m": 0, "n": 0, "k": 0,
              "alignment": "aligned", "op": "copy", "size_mib": 64}
    between = (cal + peak) / 2
    _store(runs, "matmul", [{"variant": "fp32", "metric": "tflops", "value": v} for v in (cal / 2, between)],
           params=params)
    _store(runs, "matmul", [{"variant": "fp32", "metric": "tflops", "value": 9 * peak}],  # another CPU
           params=params, env={**hardware.fingerprint(), "cpu": {"model": "some other CPU"}})
    _store(runs, "matmul", [{"variant": "fp32", "metric": "tflops", "value": 8 * peak}],  # 2 threads
           params={**params, "num_threads": 2})
    copy = 2 * base.bandwidth_gbps
    _store(runs, "memory_access", [{"variant": "contiguous", "metric": "gbps", "value": copy},
                                   {"variant": "strided", "metric": "gbps", "value": 9 * copy}], params=params)
    ceil = roofline.ceilings_for("cpu", runs)
    assert ceil.peak_tflops == base.peak_tflops  # a measurement never becomes the roof
    assert ceil.best_tflops["float32"] == between and ceil.bandwidth_gbps == copy
    assert ceil.sources["best float32"].startswith("measured: best of 2 matmul rows")
    assert ceil.sources["bandwidth"].startswith("measured: best of 1 contiguous copies")
    assert ceil.sources["best float16"].startswith("quick calibration")  # none stored: the calibration
    assert ceil.notes == base.notes and ceil.ridge("float32") == pytest.approx(peak * 1e12 / (copy * 1e9))
    table = roofline.ceilings_table(ceil)
    assert set(table["ceiling"]) == set(base.peak_tflops) | {f"{k} best measured" for k in base.peak_tflops} | {"bandwidth"}
    assert table.set_index("ceiling").loc["float32 best measured", "pct_of_roof"] == pytest.approx(100 * between / peak)


def test_a_measurement_above_its_roof_is_noted_never_clamped(tmp_path):
    runs, base = str(tmp_path), hardware.ceilings("cpu")
    params = {"device": "cpu", "num_threads": 1, "size": 512, "alignment": "aligned"}
    above = 2 * base.peak_tflops["float32"]
    _store(runs, "matmul", [{"variant": "fp32", "metric": "tflops", "value": above}], params=params)
    ceil = roofline.ceilings_for("cpu", runs)
    assert ceil.best_tflops["float32"] == above and ceil.peak_tflops == base.peak_tflops
    assert any(n.startswith("float32: measured") and "200%" in n for n in ceil.notes)
    assert "note: float32: measured" in roofline.summary(ceil)


def test_points_above_their_roof_are_listed_and_a_cache_speed_gets_its_own_slope():
    ceil = roofline.RooflineCeilings("cpu", "x", {"float32": 1.0, "bfloat16": 2.0}, 100.0)
    pts = pd.DataFrame([
        {"experiment": "matmul", "variant": "fp32", "label": "mm fp32", "tflops": 1.5, "gbps": 15.0,
         "intensity": 100.0},  # above the fp32 roof (1.0), under bf16's: listed
        {"experiment": "matmul", "variant": "bf16", "label": "mm bf16", "tflops": 1.5, "gbps": 15.0,
         "intensity": 100.0},
        {"experiment": "memory_access", "variant": "sum", "label": "sum", "tflops": 0.05, "gbps": 400.0,
         "intensity": 0.125}])  # 400 GB/s: above the 100 GB/s slope, from cache
    assert roofline.over_roof(pts, ceil, 100.0) == [
        "mm fp32: 1.5 TFLOP/s is above its roof 1: the roof is wrong",
        "sum: 0.05 TFLOP/s is above its roof 0.0125: the roof is wrong"]
    assert roofline._cache_slope(pts, 100.0) == (400.0, "measured: sum (faster than memory: in cache)")
    fig = roofline.roofline_figure(pts, ceil)
    assert any((t.name or "").startswith("400 GB/s (measured") for t in fig.data)
    assert [a.text for a in fig.layout.annotations] == ["mm fp32: 1.5 TFLOP/s is above its roof 1: the roof is wrong"]


def test_calibrate_then_figure_one_roofline_for_every_experiment_run(tmp_path):
    runs = str(tmp_path)
    ceil = roofline.calibrate("cpu", runs, sizes=[128, 256], copy_mib=1,
                              overrides={**FAST})
    stored = load_results(runs)
    fp32 = stored[(stored["variant"] == "fp32") & (stored["metric"] == "tflops")]["value"]
    assert len(fp32) == 2
    assert ceil.best_tflops["float32"] == max(*fp32, hardware.ceilings("cpu").calibrated_tflops["float32"])
    assert ceil.sources["bandwidth"].startswith("quick calibration")  # 1 MiB fits in cache
    run_experiment("memory_access", overrides={**FAST, "device": "cpu", "size_mib": 1, "op": "sum"},
                   variants=["strided"], runs_dir=runs, progress=False)
    pts = roofline.points(roofline.on_device(load_results(runs), "cpu"))
    matmul = pts[pts["experiment"] == "matmul"]
    expected = [2 * s**3 / (3 * s * s * 4) for s in (128, 256)]  # fp32: 2n^3 / (3 n^2 x 4 bytes)
    assert sorted(matmul[matmul["variant"] == "fp32"]["intensity"]) == pytest.approx(expected)
    sums = pts[pts["experiment"] == "memory_access"]["intensity"]
    assert list(sums) == pytest.approx([2**18 / ((2**18 + 512) * 4)] * 2)  # one add per value read
    fig = roofline.roofline_figure(pts, ceil)
    assert fig.layout.xaxis.type == "log" and fig.layout.yaxis.type == "log"
    names = [t.name for t in fig.data if t.name]
    assert "matmul" in names and "memory_access" in names
    assert any(n.startswith("float32 roof") and "(physical)" in n for n in names)
    assert any(n.startswith("float32 best measured") for n in names)
    cache = roofline._cache_slope(pts, ceil.bandwidth_gbps)
    assert roofline.over_roof(pts, ceil, cache[0] if cache else ceil.bandwidth_gbps) == []
    assert len(roofline.figure_for("cpu", runs).data) == len(fig.data)


def test_on_device_keeps_the_rows_of_this_device_kind_by_its_fingerprint_name():
    here = hardware.fingerprint()
    assert roofline.device_name("cpu") == hardware.cpu_info().model == here["cpu"]["model"]
    other = {**here, "cpu": {**here["cpu"], "model": "another CPU"}}
    gpu_row = {"status": "ok", "params": {"device": "cuda:0", "num_threads": 1}, "env": here}
    frame = pd.DataFrame([{"status": "ok", "params": {"device": "cpu", "num_threads": 1}, "env": here},
                          {"status": "ok", "params": {"device": "cpu", "num_threads": 2}, "env": here},
                          {"status": "ok", "params": {"device": "cpu", "num_threads": 1}, "env": other},
                          gpu_row])
    assert list(roofline.on_device(frame, "cpu").index) == [0]
    assert list(roofline.on_device(frame, "cpu", num_threads=2).index) == [1]
