"""The ladder (labkit.harness.ladder, labkit.views.ladder): its rungs follow the composition
root and add one technique each; ONE 2-rank launch measures a small ladder (tiny preset, 2
layers, batch 4 x 32 tokens), whose every rank has its peak beside the planner's on every rung;
a rung over its budget is an oom row beside its prediction; the figure draws what it says."""
from __future__ import annotations

import dataclasses
import inspect

import pandas as pd
import pytest

from conftest import FAST
from labkit.blocks import recipe as recipes
from labkit.config import ConfigError
from labkit.harness import ladder
from labkit.techniques import recipe
from labkit.views.ladder import TRACES, ladder_figure

pytestmark = pytest.mark.multiprocess  # this module starts ranks (6-12 s a launch)

SIZES = {**FAST, "device": "cpu", "nproc": 2, "timed_steps": 1, "steps": 1, "batch_size": 4,
         "seq_len": 32, "num_layers": 2, "timeout_s": 60}
STEPS = {"micro_batches": 2, "checkpointing": "full", "precision": "bf16"}  # any order in


def test_rungs_follow_the_composition_roots_order():
    calls = {"packing": "packing.apply_packing", "precision": "transforms.apply_precision",
             "loss": "transforms.apply_loss", "checkpointing": "transforms.apply_checkpointing",
             "compile": "transforms.apply_compile", "zero_stage": "transforms.apply_data_parallel",
             "grad_compression": "compression.apply_grad_compression",
             "micro_batches": "transforms.apply_accumulation", "offload": "transforms.apply_offload",
             "optimizer": "transforms.apply_optimizer"}
    source = inspect.getsource(recipes.compose)
    assert sorted(calls, key=lambda k: source.index(f"{calls[k]}(")) == list(ladder.ORDER)
    every = {"precision": "bf16", "offload": "activations", "micro_batches": 2, "zero_stage": 1,
             "compile": True, "checkpointing": "selective", "loss": "chunked"}
    labels = [r.label for r in ladder.build_rungs(every, nproc=2)]
    assert labels == ["plain", "+ ddp", "+ bf16", "+ loss=chunked", "+ checkpointing=selective", "+ compile",
                      "+ zero_stage=1", "+ micro_batches=2", "+ offload=activations"]
    assert [r.label for r in ladder.build_rungs({"precision": "fp16"}, nproc=1)] == ["plain", "+ fp16"]


def _techniques(rung: ladder.Rung) -> set[str]:
    """What a rung computes: plain is the plain step on one process (no transform), a composed
    rung its knobs on the 2 ranks' replicas."""
    if rung.variant == ladder.PLAIN:
        return {"replicas=1"}
    return {"replicas=2", *recipe.recipe_of(recipe.Config(nproc=2, **rung.knobs)).techniques()}


def test_each_rung_differs_from_the_one_below_by_one_technique():
    rungs = ladder.build_rungs({**STEPS, "zero_stage": 2}, nproc=2)
    for below, rung in zip(rungs, rungs[1:]):
        before, after = _techniques(below), _techniques(rung)
        changed = {t.split("=")[0] for t in before ^ after}
        assert len(changed) == 1, (below.label, rung.label, before, after)
        assert set(below.knobs.items()) <= set(rung.knobs.items())  # it keeps the rungs below


def test_a_rung_that_changes_nothing_or_is_no_knob_is_refused():
    with pytest.raises(ConfigError, match="default"):
        ladder.build_rungs({"zero_stage": 0}, nproc=2)
    with pytest.raises(ConfigError, match="precision, loss, checkpointing"):
        ladder.build_rungs({"batch_size": 6}, nproc=2)
    with pytest.raises(ConfigError, match="give them as its steps"):
        ladder.ladder_rungs({"checkpointing": "full"}, preset="tiny", overrides={**SIZES, "precision": "bf16"})
    with pytest.raises(ConfigError, match="plain first"):
        ladder.rung_points([ladder.Rung("+ bf16", {"precision": "bf16"})], "tiny", SIZES)


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    rungs = ladder.build_rungs(STEPS, nproc=2)
    return ladder.run_ladder(rungs, preset="tiny", overrides=SIZES,
                             runs_dir=str(tmp_path_factory.mktemp("runs")))


def test_every_rung_has_every_ranks_peak_beside_its_prediction(frame):
    peaks = frame[frame["metric"] == "peak_mem_bytes"]
    labels = [r.label for r in ladder.build_rungs(STEPS, nproc=2)]
    assert list(dict.fromkeys(peaks["rung"])) == labels  # in the ladder's order
    assert sorted(zip(peaks["rung"], peaks["rank"])) == sorted((r, k) for r in labels for k in (0, 1))
    assert (peaks["status"] == "ok").all() and (peaks["measured"] > 0).all()
    assert peaks["ratio"].tolist() == pytest.approx((peaks["measured"] / peaks["predicted"]).tolist())
    assert peaks["ratio"].between(0.9, 1.1).all(), peaks  # the recipe experiment's 10% goal
    # plain once: the reference's rows on the first rung only, every other rung composed
    assert set(frame[frame["variant"] == "plain"]["rung"]) == {"plain"}
    checked = frame[frame["metric"] == "loss_rel_diff"]
    assert len(checked) == 2 * len(labels) and (checked["status"] == "ok").all()
    # DDP halves each rank's sequences: its activations are plain's / 2 (to the byte, as planned)
    acts = frame[(frame["metric"] == "activation_bytes") & (frame["rank"] == 0)].set_index("rung")
    assert acts.loc["+ ddp", "predicted"] == pytest.approx(acts.loc["plain", "predicted"] / 2, rel=0.01)


def test_throughput_and_balance_come_from_the_same_rows(frame):
    rates = ladder.job_throughput(frame).set_index("rung")
    per_rank = frame[frame["metric"] == "tokens_per_s"]
    ddp = per_rank[per_rank["rung"] == "+ ddp"]
    assert rates.loc["+ ddp", "measured_tokens_per_s"] == pytest.approx(ddp["measured"].sum())
    plain = per_rank[per_rank["rung"] == "plain"]
    assert rates.loc["plain", "measured_tokens_per_s"] == pytest.approx(plain["measured"].mean())
    spread = ladder.balance(frame)
    assert len(spread) == len(rates) and (spread["num_ranks"] == 2).all()
    assert (spread["spread_pct"] >= 0).all() and spread["balanced"].all()  # DDP: the same work


def test_an_oom_rung_is_a_row_beside_its_prediction():
    rungs = [ladder.Rung("plain", {}, "plain"), ladder.Rung("+ ddp")]
    points = ladder.rung_points(rungs, "tiny", {**SIZES, "steps": 2, "budget_gib": 0.01})
    row = {"variant": "composed", "params": {"sweep": {"rung": "+ ddp"}}, "metric": None,
           "value": None, "predicted": None, "status": "oom", "message": "over the budget"}
    frame = ladder.ladder_frame([{**row, "rank": k} for k in (0, 1)], points)
    expected = recipe.expected(dataclasses.replace(points[1][1]))
    assert set(frame["metric"]) == set(ladder.PREDICTED_WHEN_NOT_RUN)
    assert (frame["status"] == "oom").all() and frame["measured"].isna().all()
    peak = frame[frame["metric"] == "peak_mem_bytes"]["predicted"]
    assert (peak == expected["peak_mem_bytes"]).all()
    verdict = ladder.verdicts(frame).iloc[0]
    assert (verdict["planner"], verdict["run"], verdict["agree"]) == ("does not fit", "oom", True)
    figure = ladder_figure(frame)
    assert [t.name for t in figure.data] == [TRACES[0], TRACES[1], TRACES[2], TRACES[3], TRACES[4]]
    assert list(figure.data[2].text) == ["oom", "oom"]


def test_the_figure_draws_every_rank_measured_and_predicted(frame):
    figure = ladder_figure(frame)
    assert [t.name for t in figure.data] == [TRACES[0], TRACES[1], TRACES[3], TRACES[4]]  # all ran
    peaks = frame[frame["metric"] == "peak_mem_bytes"]
    bars, markers = figure.data[0], figure.data[1]
    assert [list(level) for level in bars.x] == [peaks["rung"].tolist(), [f"rank {k}" for k in peaks["rank"]]]
    scale = peaks["measured"].iloc[0] / bars.y[0]  # one byte unit for both traces
    assert scale in (2**10, 2**20, 2**30)
    assert list(markers.y) == pytest.approx((peaks["predicted"] / scale).tolist())
    rates = ladder.job_throughput(frame)
    assert list(figure.data[3].y) == pytest.approx(rates["predicted_tokens_per_s"].tolist())
    with pytest.raises(ConfigError, match="run_ladder"):
        ladder_figure(pd.DataFrame({"rung": []}))


def test_a_budget_between_two_predicted_peaks_separates_them():
    rungs = ladder.build_rungs(STEPS, nproc=2)
    peaks = ladder.predicted_peaks(rungs, preset="tiny", overrides=SIZES)
    assert list(peaks) == [r.label for r in rungs]
    low, high = min(peaks.values()), max(peaks.values())
    budget = ladder.budget_between(low, high) * 2**30
    assert low < budget < high and budget / low == pytest.approx(high / budget)
    with pytest.raises(ConfigError, match="smaller"):
        ladder.budget_between(high, low)
