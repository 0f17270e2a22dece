import pandas as pd
import pytest

from conftest import FAST

from labkit import hardware, roofline
from labkit.experiment import run_experiment
from labkit.results import RunRecord, load_results


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


def test_ceilings_prefer_the_best_measured_rows_of_this_device_and_say_so(tmp_path):
    runs = str(tmp_path)
    base = hardware.ceilings("cpu")
    empty = roofline.ceilings_for("cpu", runs)
    assert empty.peak_tflops == base.peak_tflops and empty.bandwidth_gbps == base.bandwidth_gbps
    assert all(s.startswith("quick calibration") for s in empty.sources.values())
    params = {"device": "cpu", "num_threads": 1, "size": 512, "m": 0, "n": 0, "k": 0,
              "alignment": "aligned", "op": "copy", "size_mib": 64}
    _store(runs, "matmul", [{"variant": "fp32", "metric": "tflops", "value": v} for v in (0.5, 0.7)],
           params=params)
    _store(runs, "matmul", [{"variant": "fp32", "metric": "tflops", "value": 9.0}],  # another CPU
           params=params, env={**hardware.fingerprint(), "cpu": {"model": "some other CPU"}})
    _store(runs, "matmul", [{"variant": "fp32", "metric": "tflops", "value": 8.0}],  # 2 threads
           params={**params, "num_threads": 2})
    _store(runs, "memory_access", [{"variant": "contiguous", "metric": "gbps", "value": 33.0},
                                   {"variant": "strided", "metric": "gbps", "value": 99.0}], params=params)
    ceil = roofline.ceilings_for("cpu", runs)
    assert ceil.peak_tflops["float32"] == 0.7 and ceil.bandwidth_gbps == 33.0
    assert ceil.sources["float32"].startswith("measured: best of 2 matmul rows")
    assert ceil.sources["bandwidth"].startswith("measured: best of 1 contiguous copies")
    assert ceil.sources["float16"].startswith("quick calibration")  # none measured: the fallback
    assert ceil.ridge("float32") == pytest.approx(0.7e12 / 33e9)
    table = roofline.ceilings_table(ceil)
    assert set(table["ceiling"]) == set(base.peak_tflops) | {"bandwidth"}


def test_calibrate_then_figure_one_roofline_for_every_experiment_run(tmp_path):
    runs = str(tmp_path)
    ceil = roofline.calibrate("cpu", runs, sizes=[128, 256], copy_mib=1,
                              overrides={**FAST})
    assert ceil.sources["float32"].startswith("measured: best of 2 matmul rows")
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
    assert any(n.startswith("float32 roof") and "(measured)" in n for n in names)
    assert len(roofline.figure_for("cpu", runs).data) == len(fig.data)
