"""`labkit selfcheck`: the whole check on this CPU (every family, each in its own process), the
budget planner, the check arithmetic, and the committed H200 reference re-evaluated."""
import json
import math

import pandas as pd
import pytest

from labkit import selfcheck
from labkit.cli import main
from labkit.hardware import DATA_DIR
from labkit.results import load_runs

REFERENCE = DATA_DIR / "reference"


def test_selfcheck_on_this_cpu_passes_with_a_stored_run_behind_every_family(tmp_path):
    out, runs = tmp_path / "selfcheck.json", tmp_path / "runs"
    code = main(["selfcheck", "--device", "cpu", "--budget-s", "600", "--runs-dir", str(runs),
                 "--out", str(out)])
    record = json.loads(out.read_text())
    failed = [c for c in record["checks"] if c["passed"] is False]
    assert code == 0, failed
    assert record["env"]["cpu"] and record["device"] == "cpu" and not record["left_out"]
    stored = {r["run_id"] for r in load_runs(runs)}
    families = {c["family"] for c in record["checks"]}
    assert families == set(selfcheck.FAMILIES)  # a check for every family
    for check in record["checks"]:
        assert check["passed"] is True and check["run_id"] in stored, check


def test_the_budget_leaves_out_what_does_not_fit_and_says_so():
    chosen, left = selfcheck.plan(60, "cpu")
    costs = {n: f.cost_s["cpu"] for n, f in selfcheck.FAMILIES.items()}
    assert sum(costs[n] for n in chosen) <= 60 and chosen and left
    assert all("left out" in why and "--budget-s 60" in why for why in left.values())
    chosen, left = selfcheck.plan(1e6, "cuda")
    assert chosen == list(selfcheck.FAMILIES) and not left


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


def test_the_h200_reference_rechecks_to_itself_from_its_committed_runs(tmp_path):
    committed = json.loads((REFERENCE / "h200.json").read_text())
    assert committed["env"]["gpus"][0]["name"] == "NVIDIA H200"
    again = selfcheck.recheck(str(REFERENCE / "h200.json"), str(REFERENCE / "h200-runs"),
                              out=str(tmp_path / "again.json"), echo=lambda _: None)
    def comparable(checks):  # NaN (a check with no measurement) never equals itself
        return [{k: v for k, v in c.items() if k not in ("measured", "percent_of_limit")} for c in checks]

    assert comparable(again["checks"]) == comparable(committed["checks"])
    assert [c.get("measured") for c in again["checks"]] == pytest.approx(
        [c.get("measured") for c in committed["checks"]], nan_ok=True)
    stored = {r["run_id"] for r in load_runs(REFERENCE / "h200-runs")}
    assert all(c["run_id"] in stored for c in committed["checks"] if c.get("run_id"))
    assert {"matmul", "attention", "mixed_precision"} <= {c["experiment"] for c in committed["checks"]
                                                          if c["passed"]}


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["selfcheck", "--budget-s", "0"]) == 2
    assert main(["selfcheck", "--device", "cuda:7"]) == 2
    assert main(["selfcheck", "--recheck", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("labkit: error:") for line in err)
