import dataclasses

import pytest
import torch

from conftest import FAST, by

from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import threads

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

# a one-layer model on 8 tokens: the fresh processes rebuild it from the config, seeded
SIZES = {**FAST, "work": "forward", "threads": 2, "num_layers": 1, "batch_size": 1, "seq_len": 8,
         "device": "cpu"}


def _cfg(**kw):
    return resolve(threads.Config, "tiny", {**SIZES, **kw}, experiment="threads")


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    return run_experiment("threads", preset="tiny", overrides=SIZES, progress=False,
                          runs_dir=str(tmp_path_factory.mktemp("runs"))).rows


def test_each_knob_took_effect_in_the_process_that_ran_the_work(rows):
    assert all(r["status"] == "ok" for r in rows), [r["message"] for r in rows if r["status"] != "ok"]
    seen = {v: by(rows, v, "num_threads_seen")["value"] for v in threads.VARIANTS}
    assert seen == {"one_thread": 1, "set_num_threads": 2, "omp_env": 2, "mkl_env": 2, "interop": 1}
    assert by(rows, "interop", "interop_threads_seen")["value"] == 2
    for v in threads.VARIANTS:
        assert by(rows, v, "num_threads_seen")["predicted"] == seen[v]


def test_every_variant_computes_the_reference_output(rows):
    for v in threads.VARIANTS:
        assert by(rows, v, "max_abs_diff")["value"] <= 1e-5
    assert by(rows, "one_thread", "speedup")["value"] == 1.0


def test_speedups_and_rates_are_the_formulas_on_the_rows_own_times(rows):
    tokens = SIZES["batch_size"] * SIZES["seq_len"]  # work=forward: one call's tokens
    for v in threads.VARIANTS[1:]:
        speedup = by(rows, v, "speedup")["value"]
        n = threads.intra_threads(_cfg(variant=v))
        fraction = [r for r in rows if r["variant"] == v and r["metric"] == "serial_fraction"]
        if n > 1:  # Amdahl's f from S and n
            assert fraction[0]["value"] == pytest.approx((n / speedup - 1) / (n - 1), rel=1e-9)
        else:
            assert not fraction
    for v in threads.FRESH:
        # the fresh process's times replace the empty in-process step's (whose step takes
        # nanoseconds): the rate and the speed-up come from the same median as step_ms
        step_ms = by(rows, v, "step_ms")["value"]
        assert by(rows, v, "tokens_per_s")["value"] == pytest.approx(tokens / (step_ms / 1e3), rel=1e-9)
        assert by(rows, v, "speedup")["value"] == pytest.approx(
            by(rows, v, "one_thread_ms")["value"] / step_ms, rel=1e-9)
        assert not [r for r in rows if r["variant"] == v and r["metric"] == "peak_mem_bytes"]


def test_the_fresh_process_gets_only_the_variants_thread_knob_and_no_gpu(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # stripped: MKL_NUM_THREADS alone sets the count
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    cfg = _cfg(variant="mkl_env")
    env = threads.child_env(cfg)
    assert env["MKL_NUM_THREADS"] == "2" and "OMP_NUM_THREADS" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert threads.child_env(_cfg(variant="omp_env"))["OMP_NUM_THREADS"] == "2"
    report, out = threads.run_child(cfg)
    assert report["env"]["MKL_NUM_THREADS"] == "2" and "OMP_NUM_THREADS" not in report["env"]
    assert report["num_threads_seen"] == 2
    # labkit's device detection honours CUDA_VISIBLE_DEVICES="" (trivially so without a GPU)
    assert report["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert report["num_gpus_seen"] == 0 and report["devices"] == ["cpu"]
    assert torch.equal(out, threads.make_work(cfg)())


@pytest.mark.parametrize("work", ["matmul", "elementwise"])
def test_the_work_gives_the_same_values_on_one_and_two_threads(work):
    cfg = _cfg(work=work, size=96, mib=0.5)
    fn = threads.make_work(cfg)
    torch.set_num_threads(1)
    one = fn().clone()
    torch.set_num_threads(2)
    two = fn().clone()
    assert threads.compare({"out": one}, {"out": two}, cfg).ok
    assert not threads.compare({"out": one}, {"out": one + 1}, cfg).ok


def test_predictions_follow_amdahl_and_the_core_count():
    cfg = _cfg(variant="set_num_threads", work="matmul")
    assert threads.expected(cfg)["speedup"] == min(2, threads.physical_cores())
    assert threads.expected(dataclasses.replace(cfg, variant="interop"))["speedup"] == 1
    rows = threads.speedup_rows(one_s=0.3, many_s=0.2, n=2)  # S = 1.5 -> f = (2/1.5 - 1) / 1
    assert rows["speedup"] == pytest.approx(1.5) and rows["serial_fraction"] == pytest.approx(1 / 3)


def test_bad_values_are_refused_and_a_gpu_device_is_skipped():
    with pytest.raises(ConfigError, match="valid: 0"):
        threads.validate(_cfg(threads=10_000))
    with pytest.raises(ConfigError, match="valid: matmul, elementwise, forward"):
        _cfg(work="gemm")
    with pytest.raises(ConfigError, match="valid num_threads: 1"):
        run_experiment("threads", overrides={**SIZES, "num_threads": 2})
    with pytest.raises(ConfigError, match="min|>= 0"):
        _cfg(threads=-1)
    assert "device=cpu" in threads.skip_reason(dataclasses.replace(_cfg(), device="cuda"))
