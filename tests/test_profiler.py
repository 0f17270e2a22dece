import json

import pandas as pd
import pytest
import torch

from conftest import TINY_TRAIN, by

from labkit import planner
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.measure import profiler
from labkit.blocks.model import build_model
from labkit.blocks.training import make_batch
from labkit.measure.timer import Timing
from labkit.techniques import profiling

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

SIZES = {**TINY_TRAIN, "overhead_repeats": 1}
TWO_STEPS = {"device": "cpu", "steps": 2}  # the losses compared are after an optimizer step


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    traces = tmp_path_factory.mktemp("traces")
    return run_experiment("profiling", preset="tiny", progress=False,
                          overrides={**SIZES, **TWO_STEPS, "trace_dir": str(traces)},
                          runs_dir=str(tmp_path_factory.mktemp("runs"))).rows


def test_every_variant_computes_the_plain_losses_and_reports_its_rows(rows):
    assert all(r["status"] == "ok" for r in rows)
    # the plain training loop, written out here: the same seeded model, batch and AdamW
    cfg = resolve(profiling.Config, "tiny", {**SIZES, **TWO_STEPS}, experiment="profiling")
    model = build_model(cfg.model, seed=cfg.seed, attention=cfg.attention)
    inputs, targets = make_batch(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    for _ in range(cfg.steps):
        loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    for variant in profiling.VARIANTS:
        assert by(rows, variant, "loss_delta")["value"] == 0.0
        assert by(rows, variant, "loss")["value"] == loss.item(), variant  # one thread: exact
    value = {r["metric"]: r["value"] for r in rows if r["variant"] == "profiler"}
    # the largest of shares that sum to 100 is at least their mean
    assert 100 / value["num_ops"] <= value["top_op_share_pct"] <= 100
    assert value["num_ops"] <= value["num_op_calls"] and value["num_small_ops"] <= value["num_op_calls"]
    assert value["small_ops_pct"] <= 100 and 0 <= value["idle_gap_pct"] < 100
    # the timeline's step holds the parameters and AdamW's state the whole time
    assert value["timeline_peak_bytes"] >= value["param_bytes"] + value["optimizer_bytes"]
    monitor = by(rows, "monitor", "num_monitor_samples")
    assert 2 <= monitor["value"] <= monitor["predicted"]  # start, stop, at most one per interval


def test_overhead_is_the_ratio_of_medians_timed_in_turns_minus_one(monkeypatch):
    """Scripted times (s): plain 2, 9, 2 (median 2), observed 3, 3, 50 (median 3, mean 18.7):
    +50%, the medians' ratio; a mean or a swapped ratio gives another number."""
    script = {"plain": iter([2.0, 9.0, 2.0]), "observed": iter([3.0, 3.0, 50.0])}
    order = []

    def fake_time_step(step, **kw):
        order.append(step())
        return Timing((next(script[order[-1]]),), 0)

    monkeypatch.setattr(profiling, "time_step", fake_time_step)
    cfg = resolve(profiling.Config, "tiny", {**SIZES, "device": "cpu", "overhead_repeats": 3},
                  experiment="profiling")
    pct = profiling.overhead_pct(lambda: "plain", lambda: "observed", cfg)
    assert pct == pytest.approx(50.0)
    assert order == ["plain", "observed"] * 3  # alternating, after one untimed call each


def trace_events(rows) -> list[dict]:
    path = by(rows, "profiler", "trace_bytes")["message"].split("Chrome trace: ")[1].split(" (open")[0]
    return json.loads(open(path).read())["traceEvents"]


def test_the_rows_describe_one_profiled_step_as_its_chrome_trace_shows(rows):
    """The trace is torch's own export of the profile: one step's four phases, its operators."""
    events = trace_events(rows)
    phases = {e["name"]: e["dur"] for e in events
              if e.get("cat") == "user_annotation" and e["name"] in ("data", "forward", "backward", "optimizer")}
    assert len(phases) == 4 == sum(e.get("cat") == "user_annotation" and e["name"] in phases for e in events)
    assert by(rows, "profiler", "data_share_pct")["value"] == pytest.approx(
        100 * phases["data"] / sum(phases.values()), rel=1e-6)
    names = {e["name"] for e in events if e.get("cat") == "cpu_op"}
    assert by(rows, "profiler", "num_ops")["value"] == len(names)


def test_operator_counts_of_a_known_model_and_program():
    """Every nn.Linear is one aten::mm forward and two backward (input and weight gradients)."""
    cfg = resolve(profiling.Config, "tiny", {**SIZES, "device": "cpu"}, experiment="profiling")
    trainer = profiling.phased_trainer(cfg)
    trainer.step()  # AdamW's state is made on the first step: profile a steady one
    prof, _ = profiler.profile_step(trainer.step, "cpu")
    linears = sum(isinstance(m, torch.nn.Linear) for m in trainer.model.modules())
    calls = prof.operators.set_index("name")["calls"]
    assert calls["aten::mm"] == 3 * linears
    assert prof.summary()["num_op_calls"] == calls.sum() and prof.summary()["num_ops"] == len(calls)
    a, b = torch.randn(8, 8), torch.randn(8, 8)

    def program():
        with profiler.phase_range("data"):
            c = a @ b
        with profiler.phase_range("forward"):
            return torch.mm(c, b) @ b + a + b

    prof, _ = profiler.profile_step(program, "cpu")
    calls = prof.operators.set_index("name")["calls"]
    assert calls["aten::mm"] == 3 and calls["aten::add"] == 2
    assert set(calls.index) >= {"aten::mm", "aten::add", "aten::matmul"} and "[memory]" not in calls
    assert list(prof.phases_ms()) == ["data", "forward"]
    assert prof.operators["share_pct"].sum() == pytest.approx(100)


def test_the_trace_file_is_a_chrome_trace_with_the_phases(rows):
    row = by(rows, "profiler", "trace_bytes")
    path = row["message"].split("Chrome trace: ")[1].split(" (open")[0]
    assert row["value"] == len(open(path, "rb").read())
    names = {e.get("name") for e in trace_events(rows)}
    assert {"data", "forward", "backward", "optimizer", "aten::mm"} <= names


def test_the_memory_timeline_holds_the_parameters_and_optimizer_state_exactly(tmp_path):
    cfg = resolve(profiling.Config, "tiny", {**SIZES, "device": "cpu", "trace_dir": str(tmp_path)},
                  experiment="profiling")
    prof = profiling.profile_once(cfg)
    last = prof.memory.iloc[-1]
    assert last["parameter"] == planner.param_bytes(cfg.model, "float32")
    # AdamW's two fp32 moments, plus its fp32 `step` counter per parameter tensor
    num_tensors = len(list(profiling.phased_trainer(cfg).model.parameters()))
    assert last["optimizer_state"] == planner.adamw_state_bytes(cfg.model) + 4 * num_tensors
    ops = prof.operators
    assert {"name", "calls", "self_cpu_ms", "total_cpu_ms", "self_device_ms", "self_mem_bytes"} <= set(ops)
    assert ops["share_pct"].sum() == pytest.approx(100)
    assert "aten::mm" in set(ops["name"])
    assert list(prof.phases_ms()) == ["data", "forward", "backward", "optimizer"]
    assert prof.trace_path.exists() and len(prof.findings()) == 4


def synthetic() -> pd.DataFrame:
    """Two phases over 100 us; ops busy 0-10, 10-40 (a nested op inside), 60-65, 90-100 us."""
    rows = [("data", "phase", 0, 20, 20, 0, 0, False), ("forward", "phase", 20, 80, 80, 0, 0, False),
            ("aten::mm", "op", 0, 10, 10, 0, 400, True), ("aten::linear", "op", 10, 30, 10, 0, 0, False),
            ("aten::mm", "op", 15, 25, 25, 0, 400, True), ("aten::add", "op", 60, 5, 5, 0, 8, True),
            ("aten::mul", "op", 90, 10, 10, 0, 8, True)]
    return pd.DataFrame(rows, columns=list(profiler.EVENT_COLUMNS))


def test_findings_on_a_synthetic_profile():
    events = synthetic()
    ops = profiler.operator_table(events)
    assert ops.iloc[0]["name"] == "aten::mm" and ops.iloc[0]["calls"] == 2
    assert ops.iloc[0]["share_pct"] == pytest.approx(100 * 35 / 60)
    assert ops.iloc[0]["self_mem_bytes"] == 800
    assert profiler.idle_time(events) == {"idle_us": 45.0, "span_us": 100.0, "num_gaps": 2,
                                          "longest_gap_us": 25.0}
    assert profiler.small_work(events, small_us=10) == (1, 4)  # leaf ops only: the 5 us add
    summary = profiler.summary(events, ops, small_us=10)
    assert summary["data_share_pct"] == 20.0 and summary["idle_gap_pct"] == 45.0
    assert summary["num_ops"] == 4 and summary["num_op_calls"] == 5
    lines = profiler.findings(events, ops, small_us=10)
    assert lines[0].startswith("data loading: 20.0%")
    assert lines[1] == "top operator: aten::mm, 58.3% of self CPU time (2 calls)"
    assert lines[2].startswith("idle: 45.0% of the 0.10 ms timeline runs no operator, in 2 gaps")
    assert lines[3].startswith("small work: 1 of 4 leaf ops (25%) take under 10 us")


def test_kernels_take_over_from_ops_when_present_and_the_top_kernel_gets_an_ncu_command():
    kernels = pd.DataFrame([("gemm<float>(x)", "kernel", 0, 50, 50, 50, 0, True),
                            ("gemm<float>(x)", "kernel", 60, 50, 50, 50, 0, True),
                            ("elementwise", "kernel", 120, 4, 4, 4, 0, True)],
                           columns=list(profiler.EVENT_COLUMNS))
    events = pd.concat([synthetic(), kernels], ignore_index=True)
    assert profiler.idle_time(events)["idle_us"] == 20.0  # 50-60 and 110-120 us
    assert profiler.small_work(events) == (1, 3)
    assert profiler.top_kernel_command(events) == (
        "ncu --target-processes all --kernel-name 'regex:gemm<float>\\(x\\)' --launch-skip 2 "
        "--launch-count 1 --set full -f -o labkit_ncu python -m labkit run profiling --device cuda "
        "--variant plain")
    assert profiler.top_kernel_command(synthetic()) is None


def test_nsys_and_ncu_command_lines():
    assert profiler.nsys_command(preset="small", overrides={"batch_size": 8}) == (
        "nsys profile -t cuda,nvtx,osrt --capture-range=cudaProfilerApi --capture-range-end=stop "
        "-o labkit_nsys --force-overwrite=true python -m labkit run profiling --device cuda "
        "--preset small --variant plain --set batch_size=8")
    assert profiler.nsys_command("kv_cache", variant=None, capture_range=False) == (
        "nsys profile -t cuda,nvtx,osrt -o labkit_nsys --force-overwrite=true "
        "python -m labkit run kv_cache --device cuda")
    assert profiler.ncu_command("ampere_sgemm", launch_skip=5, nvtx_range="forward", output="mm") == (
        "ncu --target-processes all --nvtx --nvtx-include forward/ --kernel-name regex:ampere_sgemm "
        "--launch-skip 5 --launch-count 1 --set full -f -o mm python -m labkit run profiling "
        "--device cuda --variant plain")


def test_phase_ranges_push_nvtx_only_on_cuda_and_capture_one_call(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: calls.append(("start",)))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: calls.append(("stop",)))
    with profiler.phase_range("a", "cpu"), profiler.phase_range("b", "cpu"):
        pass
    assert calls == []
    with profiler.phase_range("a", "cuda"):
        calls.append(("inside",))
    assert calls == [("push", "a"), ("inside",), ("pop",)]
    calls.clear()
    step = profiler.CaptureRange("cuda", at_call=1).wrap(lambda: calls.append(("step",)))
    for _ in range(3):
        step()
    assert calls == [("step",), ("start",), ("step",), ("stop",), ("step",)]
    calls.clear()
    cpu_step = profiler.CaptureRange("cpu").wrap(lambda: calls.append(("step",)))
    cpu_step(), cpu_step()
    assert calls == [("step",), ("step",)]


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="monitor_interval_ms"):
        resolve(profiling.Config, "tiny", {"monitor_interval_ms": 0}, experiment="profiling")
    with pytest.raises(ConfigError, match="valid: plain, profiler, monitor"):
        run_experiment("profiling", variants=["nsys"], overrides=SIZES)
