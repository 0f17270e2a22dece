"""Load balance: with one rank made slower, a split proportional to the measured speeds gives it
fewer sequences, and both splits train on the same global-batch gradient. Shares and predictions
are asserted as the formulas on the speeds the run measured, never which rank was faster (the CPU
is shared); the slowdown itself is checked on a fake clock. One launch serves every test."""
import pytest

from conftest import TINY_DIST
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.techniques import load_balance as lb

pytestmark = pytest.mark.multiprocess  # this module starts ranks (6-12 s a launch)

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


def speeds_and_shares(rows, variant):
    """The calibrated sequences/s every rank reported and the sequences each got."""
    return ([by(rows, variant, "sequences_per_s", r)["value"] for r in (0, 1)],
            [by(rows, variant, "num_sequences", r)["value"] for r in (0, 1)])


def test_the_proportional_split_follows_the_measured_speeds(rows):
    """Whatever this machine measured: the shares are split() of the speeds in the rows."""
    _, even = speeds_and_shares(rows, "even")
    assert even == [4, 4]
    speeds, proportional = speeds_and_shares(rows, "proportional")
    assert proportional == lb.split(8, speeds)
    for r in (0, 1):  # predicted: the exact share, before rounding to whole sequences
        assert by(rows, "proportional", "num_sequences", r)["predicted"] == pytest.approx(
            8 * speeds[r] / sum(speeds), rel=1e-9)


def test_the_predicted_step_is_the_slowest_share_over_its_speed(rows):
    for variant in lb.VARIANTS:
        speeds, shares = speeds_and_shares(rows, variant)
        step_ms = 1e3 * lb.predicted_step_s(shares, speeds)
        for r in (0, 1):
            compute_ms = 1e3 * shares[r] / speeds[r]
            assert by(rows, variant, "step_ms", r)["predicted"] == pytest.approx(step_ms, rel=1e-9)
            assert by(rows, variant, "compute_ms", r)["predicted"] == pytest.approx(compute_ms, rel=1e-9)
            assert by(rows, variant, "wait_ms", r)["predicted"] == pytest.approx(
                step_ms - compute_ms, rel=1e-9, abs=1e-9)


def test_every_ranks_peak_is_its_share_or_the_all_reduce_as_predicted(rows):
    """The planner's step on the rank's share, or (a small share) the hand-written all-reduce
    after the backward, which holds the gradients twice: within 1% on every rank and split."""
    for variant in lb.VARIANTS:
        for r in (0, 1):
            row = by(rows, variant, "peak_mem_bytes", r)
            assert row["value"] == pytest.approx(row["predicted"], rel=0.01), row


def test_the_slow_rank_sleeps_its_slowdown_less_one_times_its_compute(monkeypatch):
    """The rank's meter on a fake clock: 0.5 s of forward and backward, then a sleep of (4 - 1) x
    0.5 s on the slow rank (slowdown 4), none on the others; its compute counts the sleep."""
    slept = []
    monkeypatch.setattr(lb.time, "sleep", slept.append)
    for delay, want in ((3.0, 1.5), (0.0, 0.0)):
        ticks = iter([10.0, 10.5, 10.5 + want])
        monkeypatch.setattr(lb, "clock", lambda device: next(ticks))
        meter = lb.RankClock("cpu", delay)
        with meter.phase("forward"):
            pass
        with meter.phase("backward"):
            pass
        assert slept.pop() == pytest.approx(want)
        assert meter.compute_s == [pytest.approx(0.5 + want)]


def test_the_sum_leaves_no_buffer_behind_that_the_collective_still_holds(monkeypatch):
    """The flat buffer is freed when the sum returns, even while the all-reduce (gloo's worker
    thread) still holds it: it must not sit under the optimizer's step and raise the peak."""
    from labkit.blocks.training import Trainer
    from labkit.measure.memory import MemoryMeter

    trainer = Trainer(resolve(lb.Config, "tiny", OVERRIDES, experiment="load_balance"))
    trainer.accumulate(sync=False)
    held = []  # the "worker thread": keeps the tensor it summed
    monkeypatch.setattr(lb.dist, "all_reduce", held.append)
    with MemoryMeter("cpu") as meter:
        lb.RankClock("cpu", 0.0).reduce(trainer)
        assert meter.current_bytes == 0 and held[0].untyped_storage().nbytes() == 0
    assert meter.peak_bytes == 4 * sum(p.numel() for p in trainer.model.parameters())


def test_the_proportional_split_never_predicts_a_longer_step_than_the_even_one():
    for speeds in ([40.0, 10.0], [10.0, 40.0], [1.0, 1.01], [3.0, 2.0], [1.0, 100.0]):
        even = lb.predicted_step_s([4, 4], speeds)
        assert lb.predicted_step_s(lb.split(8, speeds), speeds) <= even, speeds
    assert lb.predicted_step_s(lb.split(8, [40.0, 10.0]), [40.0, 10.0]) == 0.2  # [6, 2]: 2 / 10


def test_weighted_shares_give_the_even_split_gradients(rows):
    for rank in (0, 1):
        assert by(rows, "proportional", "grad_max_rel_diff", rank)["value"] <= lb.TOLERANCE
        assert by(rows, "proportional", "loss", rank)["value"] == pytest.approx(
            by(rows, "even", "loss", rank)["value"], rel=lb.TOLERANCE)


def test_per_rank_compute_and_wait_are_predicted_from_each_ranks_share_and_speed(rows):
    for variant in lb.VARIANTS:
        compute = {}
        for rank in (0, 1):
            n = by(rows, variant, "num_sequences", rank)["value"]
            speed = by(rows, variant, "sequences_per_s", rank)["value"]
            compute[rank] = by(rows, variant, "compute_ms", rank)["predicted"]
            assert compute[rank] == pytest.approx(1e3 * n / speed)  # its share at its speed
        for rank in (0, 1):  # the step waits for the slower rank; the rest of it is waiting
            step = by(rows, variant, "step_ms", rank)["predicted"]
            assert step == pytest.approx(max(compute.values()))
            assert by(rows, variant, "wait_ms", rank)["predicted"] == pytest.approx(step - compute[rank])


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
