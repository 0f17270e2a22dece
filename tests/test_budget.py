"""Sizes from a seconds target: the pace's arithmetic, the choice of a size for a run and for each
notebook of a report, and the report's schedule on core slots. Paces are given, not measured, so
every figure here is exact on any machine."""
import dataclasses
import json
import math
import os

import pytest

from labkit.config import resolve
from labkit.harness import budget
from labkit.harness.experiment import checked
from labkit.measure import pace as pace_module
from labkit.measure.pace import REFERENCE, Pace
from labkit.report import NOTEBOOKS_DIR, plan
from labkit.techniques import REGISTRY, record

from conftest import FAST


def slower(factor: float, bf16: float | None = None) -> Pace:
    """A CPU `factor` times slower than the reference, its bf16 matmuls at `bf16` GFLOP/s."""
    gflops = {d: g / factor for d, g in REFERENCE.gflops.items()}
    if bf16 is not None:
        gflops["bfloat16"] = bf16
    return Pace(REFERENCE.step_s * factor, gflops)


def test_the_rate_scale_slows_the_measured_pace_by_exactly_its_factor(monkeypatch):
    monkeypatch.setattr(pace_module, "mean_seconds", lambda fn, spans=1: 0.002)
    monkeypatch.delenv(pace_module.PACE_ENV, raising=False)
    for scale, expected_step in ((1.0, 0.002), (0.2, 0.01)):
        monkeypatch.setenv(pace_module.SCALE_ENV, str(scale))
        pace_module.measure_pace.cache_clear()
        measured = pace_module.measure_pace()
        assert measured.step_s == pytest.approx(expected_step) and measured.scale == scale
        assert measured.gflops["float32"] == pytest.approx(2 * 512**3 / 0.002 / 1e9 * scale)
        # what this CPU really took, the scale taken back out: how its seconds become reference ones
        assert measured.measured_slowdown == pytest.approx(0.002 / REFERENCE.step_s)
    pace_module.measure_pace.cache_clear()


@pytest.mark.parametrize("text", ["0", "-1", "fast", "nan"])
def test_a_bad_rate_scale_is_one_line_naming_what_is_valid(monkeypatch, text):
    monkeypatch.setenv(pace_module.SCALE_ENV, text)
    with pytest.raises(ValueError, match="a number above 0"):
        pace_module.rate_scale()


def test_a_pace_handed_down_as_json_is_the_same_pace(monkeypatch):
    given = slower(3.0, bf16=2.0)
    monkeypatch.setenv(pace_module.PACE_ENV, given.to_json())
    pace_module.measure_pace.cache_clear()
    assert pace_module.measure_pace() == given and given.slowdown == pytest.approx(3.0)
    pace_module.measure_pace.cache_clear()


@pytest.mark.slow
def test_the_processes_a_report_starts_get_its_pace_and_the_environment_is_restored(monkeypatch):
    import subprocess
    import sys

    monkeypatch.delenv(pace_module.PACE_ENV, raising=False)
    ours = slower(4.0)
    monkeypatch.setattr(pace_module, "measure_pace", lambda: ours)
    child = [sys.executable, "-c", "from labkit.measure.pace import measure_pace; "
                                   "print(measure_pace().to_json())"]
    with pace_module.handed_down():
        seen = Pace(**json.loads(subprocess.run(child, capture_output=True, text=True, check=True).stdout))
    assert seen == ours and pace_module.PACE_ENV not in os.environ
    given = slower(2.0)
    monkeypatch.setenv(pace_module.PACE_ENV, given.to_json())
    with pace_module.handed_down():  # a pace the caller gave stands
        assert Pace(**json.loads(os.environ[pace_module.PACE_ENV])) == given


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_rung_is_a_valid_smaller_setting_measured_in_the_costs(name):
    exp = record(name)
    measured = budget.costs()["experiments"][name]
    assert len(measured) == len(budget.ladder(exp)) >= 2  # the defaults and every rung, measured
    for rung in exp.cpu_rungs:
        checked(exp, resolve(exp.Config, "tiny", {**rung, "device": "cpu"}, experiment=name))


def test_a_run_keeps_its_defaults_where_they_fit_and_steps_down_where_they_do_not():
    exp = record("kv_cache")
    seconds = budget.costs()["experiments"]["kv_cache"]
    variants = list(exp.variants)
    fast = budget.fit_run("kv_cache", None, {"device": "cpu"}, variants, seconds[0] + 1, pace=REFERENCE)
    assert fast.settings == {} and fast.note == "" and fast.predicted_s == pytest.approx(seconds[0])
    # five times slower: the first rung whose 5x fits the target
    target = 5 * seconds[2] + 0.1
    slow = budget.fit_run("kv_cache", None, {"device": "cpu"}, variants, target, pace=slower(5.0))
    expected = next(i for i, s in enumerate(seconds) if 5 * s <= target)
    assert slow.settings == budget.ladder(exp)[expected] and slow.predicted_s == pytest.approx(5 * seconds[expected])
    assert "sized down to" in slow.note and f"about {5 * seconds[0]:.0f} s" in slow.note
    # a setting given by hand is never overridden; nor sized off the CPU or at another preset
    for preset, overrides in ((None, {"device": "cpu", "new_tokens": 128}), ("reference", {"device": "cpu"})):
        kept = budget.fit_run("kv_cache", preset, overrides, variants, 1.0, pace=slower(50.0))
        assert kept.settings == {} and math.isnan(kept.predicted_s)
    hopeless = budget.fit_run("kv_cache", None, {"device": "cpu"}, variants, 0.01, pace=slower(50.0))
    assert hopeless.settings == budget.ladder(exp)[-1] and "still over it" in hopeless.note


@pytest.mark.slow
def test_emulated_bf16_adds_its_matmuls_at_the_measured_rate():
    exp = record("mixed_precision")
    cfg = resolve(exp.Config, "tiny", {"device": "cpu"}, experiment="mixed_precision")
    native = budget.low_precision_s(exp, cfg, ["fp32", "bf16"], REFERENCE)
    assert native == 0.0  # the reference CPU's own rate: its seconds already hold it
    emulated = slower(1.0, bf16=1.0)  # 1 GFLOP/s: an AVX2 CPU's bf16
    step = exp.expected(dataclasses.replace(cfg, variant="bf16"))["flops"]
    expected = budget.CALLS * step * (1 / 1e9 - 1 / REFERENCE.rate("bfloat16"))
    assert budget.low_precision_s(exp, cfg, ["fp32", "bf16"], emulated) == pytest.approx(expected)
    both = budget.low_precision_s(exp, cfg, ["fp32", "bf16", "bf16_weights"], emulated)
    assert both == pytest.approx(2 * expected)  # bf16_weights' matmuls are bf16 too; fp32 adds nothing


@pytest.mark.slow
def test_a_sized_run_says_so_in_its_rows_and_keeps_checking_against_its_reference(monkeypatch, tmp_path):
    from labkit.harness.experiment import run_experiment

    monkeypatch.setenv(pace_module.PACE_ENV, slower(1000.0).to_json())  # a hopelessly slow CPU
    pace_module.measure_pace.cache_clear()
    try:
        rows = run_experiment("memory_access", overrides={**FAST, "device": "cpu"}, variants=["strided"],
                              budget_s=budget.RUN_TARGET_S, runs_dir=str(tmp_path), progress=False).rows
    finally:
        pace_module.measure_pace.cache_clear()
    smallest = record("memory_access").cpu_rungs[-1]
    assert all(r["params"]["size_mib"] == smallest["size_mib"] for r in rows)
    assert all("sized down to size_mib=16" in r["params"]["sizing"] for r in rows)
    steps = [r for r in rows if r["metric"] == "step_ms"]
    assert len(steps) == 2 and all(r["status"] == "ok" and "sized down" in r["message"] for r in steps)


def fake_costs(monkeypatch, notebooks, experiments=None):
    costs = {"startup_s": 2.0, "kernel_s": 3.0, "experiments": experiments or {}, "notebooks": notebooks}
    monkeypatch.setattr(budget, "costs", lambda: costs)


def test_a_notebook_steps_down_its_experiments_rungs_scaled_as_the_run_scales(monkeypatch):
    # checkpointing: defaults 22 s, rungs 12 s and 7 s as runs (2 s of start); its notebook 23 s at
    # its report size (3 s of kernel start)
    fake_costs(monkeypatch, {"03_checkpointing": {"0": 23.0}, "20_matmul": {"0": 10.0}},
               {"checkpointing": [22.0, 12.0, 7.0], "matmul": [10.0, 6.0]})
    params = {"03_checkpointing": {"overrides": {}}, "20_matmul": {"overrides": {"size": 512}}}
    known = {s: {"overrides": {}} for s in params}
    plans = plan.plan_notebooks(params, {"03_checkpointing": "checkpointing", "20_matmul": "matmul"}, known,
                                {s: 1 for s in params}, {"03_checkpointing": set(), "20_matmul": {"size"}},
                                slower(4.0), cores=2, budget_s=30.0)
    checkpointing, matmul = plans
    # shares: 30 s x 2 cores over (92 + 40) core-seconds of both at level 0, times each one's own
    scale = 60.0 / (4 * 23.0 + 4 * 10.0)
    level_s = [23.0, 3 + 20 * (12 - 2) / 20, 3 + 20 * (7 - 2) / 20]  # kernel kept, the rest as the run
    at = next(i for i, s in enumerate(level_s) if 4 * s <= scale * 4 * 23.0)
    assert checkpointing.level == at and checkpointing.predicted_s == pytest.approx(4 * level_s[at])
    assert checkpointing.settings == {"overrides": dict(record("checkpointing").cpu_rungs[at - 1])}
    assert "sized down" in checkpointing.note
    # a swept or hand-given setting is kept: matmul's only rung changes `size`, which was given,
    # so it has no smaller size and runs its report size, predicted as such
    assert matmul.settings == {} and matmul.level == 0 and matmul.predicted_s == pytest.approx(40.0)


def test_a_parameter_the_caller_gave_is_never_sized_over(monkeypatch):
    # 29_sla's smallest level draws the Pareto figure at two batch limits; the caller gave its own
    fake_costs(monkeypatch, {"29_sla": {"0": 100.0}}, {"sla": [10.0, 8.0, 6.0, 5.0]})
    stem, own = "29_sla", {"overrides": {}, "pareto_batch_sizes": [1, 2]}
    for given, smallest in ((set(), {"pareto_batch_sizes": [2, 8]}), ({"pareto_batch_sizes"}, {})):
        (p,) = plan.plan_notebooks({stem: own}, {stem: "sla"}, {stem: {}}, {stem: 1},
                                   {stem: given}, slower(50.0), cores=2)
        assert {k: v for k, v in p.settings.items() if k != "overrides"} == smallest
        assert p.settings["overrides"] == dict(record("sla").cpu_rungs[-1])


def test_a_level_past_the_experiments_rungs_is_scaled_as_its_last_rung(monkeypatch):
    # 29_sla's level 4 is sla's last rung with the notebook's smaller Pareto figure: at least as
    # quick as level 3, never back at the report size's seconds (3 s of kernel kept)
    fake_costs(monkeypatch, {"29_sla": {"0": 100.0}}, {"sla": [10.0, 8.0, 6.0, 5.0]})
    seconds = plan.reference_s("29_sla", "sla", 5)
    assert seconds[3] == seconds[4] == pytest.approx(3 + 97 * (5 - 2) / (10 - 2))


def test_where_no_level_fits_the_quickest_runs_not_the_smallest(monkeypatch):
    # a smallest level measured slower than the report size (30_finetune's, once, first in a
    # fresh kernel beside a compile): level 1, scaled from level 0 as the run scales (3 s of
    # kernel kept), is the quickest, and runs
    fake_costs(monkeypatch, {"30_finetune": {"0": 15.0, "2": 42.0}}, {"finetune": [11.0, 9.0, 7.0]})
    stem = "30_finetune"
    (p,) = plan.plan_notebooks({stem: {"overrides": {}}}, {stem: "finetune"}, {stem: {}}, {stem: 1},
                               {stem: set()}, slower(50.0), cores=2)
    assert p.level == 1 and p.predicted_s == pytest.approx(50 * (3 + 12 * (9 - 2) / (11 - 2)))
    assert "still over it at its quickest size" in p.note


def test_a_level_that_changes_only_a_swept_setting_is_its_size_before_it_not_a_smaller_one(monkeypatch):
    # attention's first rung changes seq_len, which 17_attention sweeps: that level is level 0
    # again (at level 0's seconds, never "sized down to" nothing); its second rung's batch_size
    # and the notebook's smaller sweep are still reached
    fake_costs(monkeypatch, {"17_attention": {"0": 30.0}}, {"attention": [30.0, 10.0, 8.0]})
    stem, own = "17_attention", {"overrides": {}, "sweep": {"seq_len": [256, 1024]}}
    for factor, level in ((1.6, 2), (50.0, 3)):
        known = {stem: {"sweep": {"default": "{}"}}}
        (p,) = plan.plan_notebooks({stem: own}, {stem: "attention"}, known, {stem: 1},
                                   {stem: {"seq_len"}}, slower(factor), cores=2)
        assert p.level == level and p.settings["overrides"] == {"batch_size": 2}
        assert ("sweep" in p.settings) == (level == 3) and "to :" not in p.note


def test_a_notebook_never_measured_is_unplanned_not_guessed(monkeypatch):
    fake_costs(monkeypatch, {})
    (p,) = plan.plan_notebooks({"25_quiz": {}}, {"25_quiz": None}, {"25_quiz": {}}, {"25_quiz": 1},
                               {"25_quiz": set()}, REFERENCE, cores=2)
    assert math.isnan(p.predicted_s) and p.level == 0 and p.settings == {}


def test_multi_rank_notebooks_never_share_the_cores_and_the_last_ones_wait():
    nb = plan.NotebookPlan
    two_rank = [nb("10_a", 2, predicted_s=10.0), nb("11_b", 2, predicted_s=10.0)]
    singles = [nb("01_c", 1, predicted_s=4.0), nb("02_d", 1, predicted_s=6.0)]
    assert plan.schedule_s(two_rank, cores=2) == 20.0  # one after the other, not side by side
    assert plan.schedule_s(singles, cores=2) == 6.0  # side by side
    assert plan.schedule_s(two_rank + singles, cores=2) == 26.0  # the pair first, then both singles
    last = nb("99_compare", 1, predicted_s=1.0)
    assert plan.schedule_s(singles + [last], cores=2) == 7.0  # after every other notebook
    assert plan.schedule_s([nb("14_h", 4, predicted_s=5.0), nb("13_p", 2, predicted_s=5.0)], cores=2) == 10.0
    # the longest first: 03 beside 01 then 02 (4 s), not 01 beside 02 then 03 alone (6 s)
    short_first = [nb("01_e", 1, predicted_s=2.0), nb("02_f", 1, predicted_s=2.0), nb("03_g", 1, predicted_s=4.0)]
    assert plan.schedule_s(short_first, cores=2) == 4.0


def test_the_threads_notebook_holds_every_core_slot():
    """24_threads times its work on every core: no notebook may run beside it."""
    from labkit.report import notebook_ranks

    assert notebook_ranks("24_threads", {}, {}, cores=3) == 3
    assert notebook_ranks("20_matmul", {}, {}, cores=3) == 1


@pytest.mark.slow
def test_report_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys):
    from labkit.cli import main

    out = tmp_path / "never-written"
    assert main(["report", "--dry-run", "--out", str(out), "--only", "matmul,25_quiz", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "20_matmul" in text and "25_quiz" in text and "predicted wall time" in text
    assert not out.exists()
    assert main(["report", "--dry-run", "--budget-s", "-1"]) == 2


def test_run_budget_must_not_be_negative(capsys):
    from labkit.cli import main

    assert main(["run", "matmul", "--budget-s", "-5"]) == 2
    assert "--budget-s" in capsys.readouterr().err


def test_notebook_costs_come_from_the_reports_given_in_reference_seconds(tmp_path):
    """Reports (one unsized, one at the smallest sizes, more) make the notebooks' table: each level
    a report ran, over the slowdown of the CPU it ran on (the median of several); failed
    notebooks and anything older are left out."""
    def report(name, pace, notebooks):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "timings.json").write_text(json.dumps({"pace": dataclasses.asdict(pace),
                                                         "notebooks": notebooks}))
        return str(folder)

    full = report("full", slower(2.0), {"01_a": {"status": "ok", "level": 0, "seconds": 30.0},
                                        "02_b": {"status": "failed", "level": 0, "seconds": 5.0}})
    small = report("small", slower(4.0), {"01_a": {"status": "ok", "level": 2, "seconds": 20.0},
                                          "02_b": {"status": "ok", "level": 1, "seconds": 6.0}})
    assert budget.report_costs([full, small]) == {
        "notebooks": {"01_a": {"0": 15.0, "2": 5.0}, "02_b": {"1": 1.5}}, "kernel_s": 1.5}
    # where several reports ran a notebook at one level: their median, not the last one's
    again = [report(f"again{i}", slower(1.0), {"01_a": {"status": "ok", "level": 2, "seconds": s}})
             for i, s in enumerate((9.0, 6.0))]
    assert budget.report_costs([full, small, *again])["notebooks"]["01_a"] == {"0": 15.0, "2": 6.0}
    # a report that measured its pace again at the end: the mean of both slowdowns (2x and 4x)
    timings = json.loads((tmp_path / "small" / "timings.json").read_text())
    timings["pace_after"] = dataclasses.asdict(slower(2.0))
    (tmp_path / "small" / "timings.json").write_text(json.dumps(timings))
    assert budget.report_costs([small])["notebooks"]["01_a"] == {"2": pytest.approx(20.0 / 3.0, abs=0.01)}


def test_the_costs_hold_every_notebook_at_its_report_size():
    from labkit.report import find_notebooks

    measured = budget.costs()["notebooks"]
    assert sorted(measured) == sorted(find_notebooks())
    assert all("0" in levels and all(s > 0 for s in levels.values()) for levels in measured.values())
    assert json.loads(budget.COSTS_PATH.read_text())["reference"] == REFERENCE.source


@pytest.mark.slow
def test_the_worked_examples_smaller_size_keeps_its_story():
    """08_memory_planner's smaller ladder: every rung at the whole batch is predicted over the
    budget the notebook computes, the accumulated one under it (as at its report size)."""
    import papermill

    from labkit.harness import ladder

    known = papermill.inspect_notebook(str(NOTEBOOKS_DIR / "08_memory_planner.ipynb"))
    story = {"precision": "bf16", "checkpointing": "full",
             "micro_batches": int(known["measured_micro_batches"]["default"])}
    for level in plan.levels("08_memory_planner", None, known):
        sizes = {**plan._default(known, "measured"), **level.get("measured", {}), "nproc": 2}
        rungs = ladder.ladder_rungs(story, preset="tiny", overrides=sizes)
        peaks = ladder.predicted_peaks(rungs, preset="tiny", overrides=sizes)
        budget_gib = ladder.budget_between(peaks[rungs[-1].label], min(peaks[r.label] for r in rungs[1:-1]))
        assert peaks[rungs[-1].label] < budget_gib * 2**30 < min(peaks[r.label] for r in rungs[1:-1])
