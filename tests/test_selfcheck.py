"""`labkit selfcheck`: the sizing from the machine's rates (pure: simulated AVX2 and AVX-512-BF16
CPUs), a check for every experiment, the budget planner, families stopped at their share, crashed
or left out, the check arithmetic, one short real run, and the committed H200 record rechecked."""
import json
import math
import sys

import pandas as pd
import pytest

from labkit.config import ConfigError
from labkit.harness import selfcheck
from labkit.cli import main
from labkit.hardware import DATA_DIR, cpu_info
from labkit.measure.pace import measure_pace
from labkit.results import load_runs
from labkit.techniques import EXPERIMENTS

REFERENCE = DATA_DIR / "reference"

# Simulated CPUs for the sizing (inputs, not measurements): one core's calibrated fp32 matmul rate,
# and the other dtypes relative to it. Without native bf16 (AVX2 only) bf16 and fp16 matmuls are
# emulated, ~70x slower than fp32 (docs/PROBES); with AVX-512 BF16, bf16 is about twice fp32.
FP32_TFLOPS = 0.06
AVX2 = {"float32": FP32_TFLOPS, "bfloat16": FP32_TFLOPS / 70, "float16": FP32_TFLOPS / 70}
AVX512_BF16 = {"float32": FP32_TFLOPS, "bfloat16": 2 * FP32_TFLOPS, "float16": FP32_TFLOPS / 70}
DEFAULT = selfcheck.DEFAULT_BUDGET_S["cpu"]


def sized(plan):
    return {s.run.experiment: s for runs in plan.runs.values() for s in runs}


def test_every_experiment_has_a_cpu_check_and_a_cpu_run_behind_it():
    checked = {c.experiment for c in selfcheck.CHECKS["cpu"]}
    assert checked == set(EXPERIMENTS)
    for check in selfcheck.CHECKS["cpu"]:
        runs = selfcheck.FAMILIES[check.family].runs
        assert any(r.experiment == check.experiment and r.sizes("cpu") for r in runs), check.metric


@pytest.mark.parametrize("rates", [AVX2, AVX512_BF16], ids=["avx2", "avx512_bf16"])
def test_at_the_default_budget_every_experiment_runs_on_either_kind_of_cpu(rates):
    plan = selfcheck.plan(DEFAULT, "cpu", rates)
    assert not plan.left and set(sized(plan)) == set(EXPERIMENTS)
    assert sum(plan.estimate_s.values()) <= DEFAULT
    share = selfcheck.RUN_SHARE * DEFAULT
    assert all(s.estimate_s <= share or s.size == s.run.sizes("cpu")[-1] for s in sized(plan).values())


def test_without_native_bf16_the_precision_family_is_sized_down_and_says_why():
    run = next(r for r in selfcheck.FAMILIES["precision"].runs if r.experiment == "mixed_precision")
    default = run.sizes("cpu")[0]
    slow, fast = selfcheck.estimate_s(run, default, AVX2), selfcheck.estimate_s(run, default, AVX512_BF16)
    assert slow > 10 * fast  # the bf16 matmuls at 1/70 of fp32 against twice fp32
    work = selfcheck.work_gflop(run, default)
    assert work["bfloat16"] == pytest.approx(2 * work["float32"])  # bf16 + bf16_weights beside fp32
    avx2, avx512 = sized(selfcheck.plan(DEFAULT, "cpu", AVX2)), sized(selfcheck.plan(DEFAULT, "cpu", AVX512_BF16))
    assert avx512["mixed_precision"].size == default and not avx512["mixed_precision"].why
    small = avx2["mixed_precision"]
    assert small.size != default and small.estimate_s < slow
    assert small.why.startswith("sized down: the default (bf16, bf16_weights)") and "bfloat16" in small.why
    entry = small.entry()  # what the record shows, and what the family's process runs
    assert entry["variants"] == list(small.size.variants) and entry["settings"] == small.size.settings


def test_a_check_that_needs_a_variant_sized_out_is_skipped_with_the_sizing():
    run = next(r for r in selfcheck.FAMILIES["precision"].runs if r.experiment == "mixed_precision")
    smallest = run.sizes("cpu")[-1]
    assert "bf16" not in smallest.variants  # the last resort keeps bf16 weights only
    sizing = [selfcheck.Sized(run, smallest, 1.0, "sized down: the default ...").entry()]
    needs_bf16 = next(c for c in selfcheck.CHECKS["cpu"] if c.needs == ("bf16",))
    outcomes = {"precision": selfcheck.FamilyOutcome()}
    why = selfcheck.skip_reason(needs_bf16, "precision", outcomes, {}, sizing)
    assert why.startswith("bf16 not run at this size (sized down")
    other = next(c for c in selfcheck.CHECKS["cpu"] if c.family == "precision" and not c.needs)
    assert selfcheck.skip_reason(other, "precision", outcomes, {}, sizing) == ""


def test_the_budget_leaves_out_what_does_not_fit_and_says_so():
    plan = selfcheck.plan(60, "cpu", AVX512_BF16)
    assert sum(plan.estimate_s.values()) <= 60 and plan.runs and plan.left
    assert all(why.startswith("left out") and "--budget-s 60" in why for why in plan.left.values())
    plan = selfcheck.plan(1e6, "cuda")
    with_gpu_runs = [n for n, f in selfcheck.FAMILIES.items() if any(r.sizes("cuda") for r in f.runs)]
    assert list(plan.runs) == with_gpu_runs and not plan.left


def test_family_runs_the_families_asked_for_in_that_order_and_names_the_rest():
    asked = selfcheck.chosen_families("serving, hardware")
    plan = selfcheck.plan(1e6, "cuda", families=asked)
    assert asked == ["serving", "hardware"] and list(plan.runs) == asked
    assert set(plan.left) == set(selfcheck.FAMILIES) - set(asked)
    assert all("--family" in why for why in plan.left.values())
    for bad in ("x", "hardware,hardware", " , "):
        with pytest.raises(ConfigError, match="hardware, kernels"):
            selfcheck.chosen_families(bad)


def _fake_family(monkeypatch, scripts: dict[str, str]):
    """Each family's process replaced by a short Python script (no experiment runs)."""
    monkeypatch.setattr(selfcheck, "family_command",
                        lambda family, *_: [sys.executable, "-c", scripts[family]])


@pytest.mark.slow
def test_stopped_at_its_share_skipped_crashed_failed_left_out_skipped(monkeypatch, tmp_path):
    mark = selfcheck.ERROR_MARK + json.dumps({"experiment": "matmul", "error": "RuntimeError: no bf16"})
    _fake_family(monkeypatch, {
        "hardware": f"import sys; print({mark!r}); print('RuntimeError: boom'); sys.exit(1)",
        "kernels": "import time; print('working', flush=True); time.sleep(60)"})
    chosen = ["hardware", "kernels", "precision"]
    fake_plan = selfcheck.Plan(
        {n: [selfcheck.Sized(r, r.sizes("cpu")[0], 0.0) for r in selfcheck.FAMILIES[n].runs if r.sizes("cpu")]
         for n in chosen}, {n: "left out: needs about 1 s, and ..." for n in selfcheck.FAMILIES if n not in chosen},
        {"hardware": 0.0, "kernels": 0.0, "precision": 100.0})  # precision: all of the budget
    monkeypatch.setattr(selfcheck, "plan", lambda *_: fake_plan)
    monkeypatch.setattr(selfcheck, "share_s", lambda cost, remaining: 1.0)
    record = selfcheck.selfcheck("cpu", 100, str(tmp_path / "runs"), str(tmp_path / "r.json"), echo=lambda _: None)
    by_family = {}
    for c in record["checks"]:
        by_family.setdefault(c["family"], []).append(c)
    matmul = [c for c in by_family["hardware"] if c["experiment"] == "matmul"]
    assert all(c["passed"] is False and c["why"] == "RuntimeError: no bf16" for c in matmul)
    rest = [c for c in by_family["hardware"] if c["experiment"] != "matmul"]
    assert all(c["passed"] is False and c["why"] == "exit code 1: RuntimeError: boom" for c in rest)
    assert all(c["passed"] is None and c["skipped"] == "ran out of its 1 s share (stopped there)"
               for c in by_family["kernels"])  # stopped, not failed
    assert all(c["passed"] is None and c["skipped"].startswith("left out: ") and "of --budget-s 100 left" in
               c["skipped"] for c in by_family["precision"])  # left out at run time
    assert all(c["passed"] is None and c["skipped"].startswith("left out") for n in by_family
               if n not in chosen for c in by_family[n])
    assert selfcheck.exit_code(record) == 1  # the crash, and only the crash, failed
    record.pop("checks")
    without_crash = selfcheck.make_record(
        "cpu", str(tmp_path / "runs"), {"kernels": selfcheck.FamilyOutcome(stopped="ran out")},
        {}, 1.0, budget_s=100, env={})
    assert selfcheck.exit_code(without_crash) == 0


@pytest.mark.multiprocess  # its families' processes, and ranks
def test_a_short_real_selfcheck_has_a_run_or_a_reason_behind_every_check(tmp_path):
    out, runs = tmp_path / "selfcheck.json", tmp_path / "runs"
    # 12 s on the reference CPU, this CPU's slowdown times that here: on a CPU five times slower
    # every family needs more than 12 s and none would run
    budget = f"{12 * max(1.0, measure_pace().slowdown):.0f}"
    code = main(["selfcheck", "--device", "cpu", "--budget-s", budget, "--runs-dir", str(runs), "--out", str(out)])
    record = json.loads(out.read_text())
    assert code == int(any(c["passed"] is False for c in record["checks"]))
    assert record["device"] == "cpu" and record["machine"]["native_bf16"] == cpu_info().native_bf16
    assert record["machine"]["tflops"]["float32"] > 0 and record["families"]  # sized from this CPU
    stored = {r["run_id"] for r in load_runs(runs)}
    for check in record["checks"]:
        if check["passed"] is None:
            assert check["skipped"]
        else:
            assert check["run_id"] in stored, check
    # speed-ups are benchmarks (other work on the cores holds them back); mechanisms must pass
    assert all("speed-up" in c["metric"] for c in record["checks"] if c["passed"] is False)
    assert all(f"--budget-s {budget}" in why for why in record["left_out"].values())


def test_checks_compare_ratios_predictions_and_datasheet_shares():
    frame = pd.DataFrame([
        {"experiment": "e", "variant": "a", "metric": "m", "value": 6.0, "predicted": 5.0, "status": "ok"},
        {"experiment": "e", "variant": "b", "metric": "m", "value": 2.0, "predicted": None, "status": "ok"},
        {"experiment": "e", "variant": "c", "metric": "m", "value": 1.0, "predicted": None,
         "status": "error", "message": "off"}])
    at_least = selfcheck.Check("f", "e", "a/b", selfcheck.ratio("e", "m", "a", "b"), ">=", 3.0)
    assert selfcheck.evaluate(at_least, frame, "cpu", {}, {}) == {
        "measured": 3.0, "expected": ">= 3", "limit": 3.0, "percent_of_limit": 100.0, "passed": True}
    within = selfcheck.Check("f", "e", "pred", selfcheck.against_prediction("e", "a", "m"), "within", 0.1)
    assert selfcheck.evaluate(within, frame, "cpu", {}, {})["passed"] is False  # 6 / 5 is 20% off
    missing = selfcheck.Check("f", "e", "gone", selfcheck.of("e", "z", "m"), "<=", 1.0)
    assert selfcheck.evaluate(missing, frame, "cpu", {}, {})["passed"] is False  # no row: a failure
    assert selfcheck.checked_ok("e", "c")(frame) == 0.0 and selfcheck.checked_ok("e", "a")(frame) == 1.0
    assert selfcheck.row_problem(frame, "e").startswith("c:")
    h200 = {"gpus": [{"name": "NVIDIA H200", "memory_total_bytes": 150109880320}]}
    assert selfcheck.datasheet("bfloat16", 670 / 989)("cuda", h200) == pytest.approx(670, rel=2e-3)
    assert selfcheck.datasheet("bandwidth", 0.8)("cuda", h200) == pytest.approx(3840)
    assert math.isnan(selfcheck.datasheet("bandwidth", 0.8)("cuda", {"gpus": [{"name": "?"}]}))


def test_the_h200_record_rechecks_from_its_committed_runs_measuring_nothing(tmp_path):
    committed = json.loads((REFERENCE / "h200.json").read_text())
    assert committed["env"]["gpus"][0]["name"] == "NVIDIA H200"
    before = sorted(p.name for p in (REFERENCE / "h200-runs").iterdir())
    again = selfcheck.recheck(str(REFERENCE / "h200.json"), str(REFERENCE / "h200-runs"),
                              out=str(tmp_path / "again.json"), echo=lambda _: None)
    assert sorted(p.name for p in (REFERENCE / "h200-runs").iterdir()) == before  # nothing measured
    stored = {r["run_id"] for r in load_runs(REFERENCE / "h200-runs")}
    for check in again["checks"]:
        if check["passed"] is not None and check.get("run_id"):
            ids = check["run_id"] if isinstance(check["run_id"], list) else [check["run_id"]]
            assert set(ids) <= stored, check
    assert again["env"] == committed["env"] and again["rechecked"]  # the H200's, not this machine's
    passed = {c["experiment"] for c in again["checks"] if c["passed"]}
    assert {"matmul", "checkpointing", "finetune", "zero"} <= passed


def test_a_recheck_evaluates_the_stored_rows_again(tmp_path):
    """A changed row changes the verdict: the recheck reads rows, it does not copy the record."""
    from labkit.results import RunRecord

    runs = tmp_path / "runs"
    run = RunRecord("matmul", {}, {}, str(runs))
    run.add([{"experiment": "matmul", "variant": v, "metric": "flops", "value": 8.0, "predicted": 8.0,
              "status": "ok", "unit": "flop"} for v in ("fp32", "bf16")])
    run.finish("complete")
    outcomes = {"hardware": selfcheck.FamilyOutcome([{"experiment": "matmul", "run_id": run.run_id}])}
    record = selfcheck.make_record("cpu", str(runs), outcomes, {}, 1.0, budget_s=10, env={"cpu": "simulated"})
    path = tmp_path / "record.json"
    selfcheck.write_record(record, str(path))
    matmul = [c for c in record["checks"] if c["experiment"] == "matmul"]
    assert [c["passed"] for c in matmul] == [True, True]
    run.rows[1]["status"] = "error"  # bf16 now off its reference
    run.add([])
    again = selfcheck.recheck(str(path), echo=lambda _: None)
    assert [c["passed"] for c in again["checks"] if c["experiment"] == "matmul"] == [False, True]
    assert again["env"] == {"cpu": "simulated"} and selfcheck.exit_code(again) == 1


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["selfcheck", "--budget-s", "0"]) == 2
    assert main(["selfcheck", "--device", "cuda:7"]) == 2
    assert main(["selfcheck", "--recheck", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("labkit: error:") for line in err)
