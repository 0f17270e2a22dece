"""Load balance: with one rank made slower, a split proportional to the measured speeds gives it
fewer sequences, and both splits train on the same global-batch gradient. Shares are asserted,
not timings (the CPU is shared); one launch serves every test."""
import pytest

from conftest import TINY_DIST
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import load_balance as lb

# G = 2 x 4 sequences; rank 1 sleeps 3 x its compute time: about 4 x slower, robust to noise.
OVERRIDES = {**TINY_DIST, "batch_size": 4, "slowdown": 4.0, "slow_rank": 1, "device": "cpu"}  # gloo ranks


def by(rows, variant, metric, rank):
    hits = [r for r in rows if r["variant"] == variant and r["metric"] == metric and r["rank"] == rank]
    assert len(hits) == 1, (variant, metric, rank, hits)
    return hits[0]


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    result = run_experiment("load_balance", preset="tiny", overrides=OVERRIDES,
                            runs_dir=str(tmp_path_factory.mktemp("runs")), progress=False)
    return result.rows


def test_both_splits_run_on_both_ranks_and_pass_the_check(rows):
    assert {(r["variant"], r["rank"]) for r in rows} == {(v, k) for v in lb.VARIANTS for k in (0, 1)}
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"][:2]


def test_the_slow_rank_is_measured_slower_and_gets_fewer_sequences(rows):
    for variant in lb.VARIANTS:
        fast, slow = (by(rows, variant, "sequences_per_s", r)["value"] for r in (0, 1))
        assert slow < fast
    even = [by(rows, "even", "num_sequences", r)["value"] for r in (0, 1)]
    proportional = [by(rows, "proportional", "num_sequences", r)["value"] for r in (0, 1)]
    assert even == [4, 4]
    assert sum(proportional) == 8 and 1 <= proportional[1] < proportional[0]


def test_the_proportional_split_lowers_the_predicted_step(rows):
    # both predictions from the same calibrated speeds, one per variant's own calibration
    even, proportional = (by(rows, v, "step_ms", 0)["predicted"] for v in lb.VARIANTS)
    assert proportional < even


def test_weighted_shares_give_the_even_split_gradients(rows):
    for rank in (0, 1):
        assert by(rows, "proportional", "grad_max_rel_diff", rank)["value"] <= lb.TOLERANCE
        assert by(rows, "proportional", "loss", rank)["value"] == pytest.approx(
            by(rows, "even", "loss", rank)["value"], rel=lb.TOLERANCE)


def test_per_rank_compute_and_wait_are_reported(rows):
    for variant in lb.VARIANTS:
        for rank in (0, 1):
            assert by(rows, variant, "compute_ms", rank)["value"] > 0
            assert by(rows, variant, "wait_ms", rank)["value"] >= 0
            assert by(rows, variant, "step_ms", rank)["value"] > 0


def test_split_is_whole_sequences_in_proportion_and_at_least_one_each():
    assert lb.split(8, [3.0, 1.0]) == [6, 2]
    assert lb.split(4, [1.0, 2.0]) == [1, 3]
    assert lb.split(2, [1.0, 100.0]) == [1, 1]  # nobody left out
    assert lb.split(3, [1.0, 100.0, 100.0]) == [1, 1, 1]
    assert lb.split(5, [1.0, 1.0, 1.0]) == [2, 2, 1]
    assert lb.predicted_step_s([4, 4], [40.0, 10.0]) == 0.4  # the slow rank's 4 / 10
    assert lb.predicted_step_s([8, 2], [40.0, 10.0]) == 0.2


def test_slow_rank_must_exist():
    cfg = resolve(lb.Config, "tiny", {**OVERRIDES, "nproc": 2, "slow_rank": 2},
                  experiment="load_balance")
    with pytest.raises(ConfigError, match="valid: 0..1"):
        lb.validate(cfg)
