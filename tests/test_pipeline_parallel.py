"""pipeline_parallel on two gloo ranks: the pipeline's loss and gradients are one process's, a
corrupted handoff between the stages fails that check, and the bubble's prediction is the schedule
replayed on the run's own calibration. One launch for all of it; the replay itself is checked on
known durations. No test reads a wall-clock bubble: speed is for benchmarks and `selfcheck`."""
from fractions import Fraction

import pytest
from conftest import TINY_DIST

from labkit.config import ConfigError
from labkit.harness.experiment import run_experiment
from labkit.techniques.pipeline_parallel import (CORRUPTION, GRAD_TOLERANCE, LOSS_TOLERANCE,
                                                 SCHEDULES, VARIANTS, Config, balance,
                                                 bubble_metrics, skip_reason)
from labkit.blocks.pipeline_schedule import replay, replayed_bubbles, schedule_order

pytestmark = pytest.mark.multiprocess  # this module starts ranks (6-12 s a launch)

M = 2  # micro-batches of one sequence each
CORRUPT = ["none", "activation", "gradient"]
DELAY_MS = 1.0  # stage 1 sleeps in every forward: its calibrated forward holds the sleep
# gloo ranks on the CPU: on a GPU host the default device is cuda, one NCCL rank per GPU
SIZES = {**TINY_DIST, "device": "cpu", "micro_batches": M, "delay_stage": 1,
         "stage_delay_ms": DELAY_MS}


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    result = run_experiment("pipeline_parallel", preset="tiny", overrides=SIZES,
                            sweep={"corrupt": CORRUPT},
                            runs_dir=str(tmp_path_factory.mktemp("runs")), progress=False)
    df = result.frame()
    df["corrupt"] = df["params"].map(lambda p: p["corrupt"])
    return df


def values(df, metric, **where):
    rows = df[df.metric == metric]
    for key, value in where.items():
        rows = rows[rows[key] == value]
    return rows


def test_every_clean_variant_ran_on_both_ranks(frame):
    clean = frame[frame.corrupt == "none"]
    bad = clean[clean.status != "ok"]
    assert bad.empty, bad[["variant", "status", "message"]].to_string()
    assert set(zip(clean.variant, clean["rank"])) == {(v, r) for v in VARIANTS for r in (0, 1)}


def test_pipeline_loss_and_gradients_equal_the_single_process_step(frame):
    clean = frame[frame.corrupt == "none"]
    pipe = clean[clean.variant != "single"]
    assert (values(pipe, "loss_rel_diff").value <= LOSS_TOLERANCE).all()
    assert (values(pipe, "grad_max_rel_diff").value <= GRAD_TOLERANCE).all()
    reference = values(clean, "loss", variant="single").value.iloc[0]
    losses = values(pipe, "loss").value  # the last stage's, broadcast: the same on both ranks
    assert losses.sub(reference).abs().max() <= LOSS_TOLERANCE * reference


@pytest.mark.parametrize("corrupt", ["activation", "gradient"])
def test_a_corrupted_handoff_fails_the_check_on_every_rank(frame, corrupt):
    rows = frame[frame.corrupt == corrupt]
    assert (rows[rows.variant == "single"].status == "ok").all()
    pipe = rows[rows.variant != "single"]
    assert set(zip(pipe.variant, pipe["rank"])) == {(v, r) for v in SCHEDULES for r in (0, 1)}
    assert (pipe.status == "error").all()
    assert pipe.message.str.contains("does not match single").all()
    assert values(pipe, "bubble_fraction").empty  # nothing is timed after a failed check
    grads = values(pipe, "grad_max_rel_diff")
    if corrupt == "gradient":  # stage 1's input gradient, 0.1% large, scales all of stage 0's
        assert values(pipe, "loss_rel_diff").value.max() <= LOSS_TOLERANCE
        assert grads[grads["rank"] == 0].value.tolist() == pytest.approx(
            [CORRUPTION] * len(SCHEDULES), rel=1e-2)
    else:  # stage 1 computes on a shifted activation: both stages' gradients move (the loss of
        # an untrained model, near ln(vocab) whatever its input, may move by less than the check)
        assert (grads.value > GRAD_TOLERANCE).all(), grads[["variant", "rank", "value"]]


@pytest.mark.parametrize("variant", ["gpipe", "1f1b"])
def test_the_predicted_bubble_is_the_schedule_replayed_on_the_calibration(frame, variant):
    pipe = frame[(frame.corrupt == "none") & (frame.variant == variant)]
    per_rank = {k: values(pipe, k).sort_values("rank").value.tolist()
                for k in ("stage_fwd_ms", "stage_bwd_ms", "handoff_ms")}
    assert per_rank["stage_fwd_ms"][1] >= DELAY_MS  # the injected sleep is timed with it
    assert per_rank["handoff_ms"][0] == per_rank["handoff_ms"][1] > 0
    wall, bubbles = replayed_bubbles(variant, M, [f / 1e3 for f in per_rank["stage_fwd_ms"]],
                                     [b / 1e3 for b in per_rank["stage_bwd_ms"]],
                                     per_rank["handoff_ms"][0] / 1e3)
    rows = values(pipe, "bubble_fraction").sort_values("rank")
    assert rows.predicted.tolist() == pytest.approx(bubbles, rel=1e-9)
    assert values(pipe, "schedule_wall_ms").predicted.tolist() == pytest.approx(
        [wall * 1e3] * 2, rel=1e-9)
    assert "ideal_bubble_fraction" in rows.message.iloc[0]
    ideal = values(pipe, "ideal_bubble_fraction")
    assert ideal.value.tolist() == ideal.predicted.tolist() == pytest.approx([1 / (M + 1)] * 2)


def test_stages_hold_their_share_of_the_parameters(frame):
    clean = frame[frame.corrupt == "none"]
    rows = values(clean, "param_bytes", variant="gpipe")
    assert (rows.value == rows.predicted).all()
    single = values(clean, "param_bytes", variant="single")
    assert rows.value.sum() == single.value.iloc[0] == single.predicted.iloc[0]


def test_1f1b_skips_fewer_micro_batches_than_stages():
    cfg = Config(variant="1f1b", nproc=2, micro_batches=1)
    assert "m=1 < p=2" in skip_reason(cfg)
    assert skip_reason(Config(variant="1f1b", nproc=2, micro_batches=2)) is None
    assert skip_reason(Config(variant="gpipe", nproc=2, micro_batches=1)) is None


# --- the replay, on known durations ------------------------------------------------------------

@pytest.mark.parametrize("variant", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_equal_stages_and_free_handoffs_replay_to_the_formula(variant, p):
    for m in range(p if variant == "1f1b" else 1, 9):
        wall, bubbles = replayed_bubbles(variant, m, [Fraction(1)] * p, [Fraction(2)] * p, 0)
        assert wall == (m + p - 1) * 3
        assert bubbles == [Fraction(p - 1, m + p - 1)] * p  # exact: durations are Fractions


def test_a_slow_stage_and_a_handoff_replay_to_the_hand_computed_bubble():
    """p = 2, m = 2; stage 1's forward takes 3, every backward 2, stage 0's forward 1, a handoff
    1. GPipe: stage 1 runs F0 [2, 5], F1 [5, 8], B0 [8, 10], B1 [10, 12]; stage 0 B0 [11, 13],
    B1 [13, 15]. Busy 6 and 10 of 15."""
    fwd, bwd = [Fraction(1), Fraction(3)], [Fraction(2), Fraction(2)]
    orders = [schedule_order("gpipe", s, 2, 2) for s in range(2)]
    assert replay(orders, fwd, bwd, 1) == [[(0, 1), (1, 2), (11, 13), (13, 15)],
                                          [(2, 5), (5, 8), (8, 10), (10, 12)]]
    # 1F1B: stage 1 alternates, F0 [2, 5], B0 [5, 7], F1 [7, 10], B1 [10, 12]; stage 0's B0
    # starts at 8, not 11, and the step still ends at 15: the same bubbles.
    orders = [schedule_order("1f1b", s, 2, 2) for s in range(2)]
    assert replay(orders, fwd, bwd, 1) == [[(0, 1), (1, 2), (8, 10), (13, 15)],
                                          [(2, 5), (5, 7), (7, 10), (10, 12)]]
    for variant in ("gpipe", "1f1b"):
        wall, bubbles = replayed_bubbles(variant, 2, fwd, bwd, 1)
        assert (wall, bubbles) == (15, [Fraction(3, 5), Fraction(1, 3)])


def test_schedule_orders_are_torchs():
    assert schedule_order("gpipe", 1, 2, 3) == [("F", 0), ("F", 1), ("F", 2),
                                                ("B", 0), ("B", 1), ("B", 2)]
    f, b = (lambda i: ("F", i)), (lambda i: ("B", i))
    assert schedule_order("1f1b", 0, 2, 4) == [f(0), f(1), b(0), f(2), b(1), f(3), b(2), b(3)]
    assert schedule_order("1f1b", 1, 2, 4) == [f(0), b(0), f(1), b(1), f(2), b(2), f(3), b(3)]


def test_a_schedule_that_waits_on_itself_is_refused():
    with pytest.raises(ValueError, match="no op can start"):
        replay([[("B", 0), ("F", 0)]], [1], [1], 0)


def test_balance_cuts_where_the_slowest_stage_is_fastest():
    assert balance({"embed": 0.0, "block": 1.0, "head": 2.0}, 4, 2) == [0, 3, 4]
    assert balance({"embed": 0.0, "block": 1.0, "head": 5.0}, 2, 2) == [0, 2, 2]  # head alone
    assert balance({"embed": 0.0, "block": 1.0, "head": 0.0}, 6, 3) == [0, 2, 4, 6]
    assert balance({"embed": 0.5, "block": 1.0, "head": 3.0}, 5, 3) == [0, 2, 5, 5]


def test_bubble_of_a_textbook_gpipe_timeline_is_the_formula():
    """p = 2, m = 4, t_f = 1, t_b = 2: the schedule of the textbook, as timestamps."""
    m, tf, tb = 4, 1.0, 2.0
    rank0 = [(i * tf, (i + 1) * tf) for i in range(m)]
    rank1 = [((i + 1) * tf, (i + 2) * tf) for i in range(m)]
    rank1 += [((m + 1) * tf + i * tb, (m + 1) * tf + (i + 1) * tb) for i in range(m)]
    rank0 += [((m + 1) * tf + (i + 1) * tb, (m + 1) * tf + (i + 2) * tb) for i in range(m)]
    on_cpu = [[(a, b, b - a) for a, b in rank] for rank in (rank0, rank1)]  # never stalled
    out = bubble_metrics([[on_cpu[0]], [on_cpu[1]]], 0)
    assert out["bubble_fraction"] == pytest.approx(1 / (m + 1))
    assert out["bubble_fraction_mean"] == pytest.approx(1 / (m + 1))
    assert out["schedule_wall_ms"] == pytest.approx((m + 1) * (tf + tb) * 1e3)
    assert out["stall_fraction_max"] == 0


@pytest.mark.parametrize("overrides, message", [
    ({"batch_size": 6, "micro_batches": 4}, "valid: 1, 2, 3, 6"),
    ({"delay_stage": 2}, "valid: 0..1"),
    ({"tie_embeddings": True}, "tie_embeddings=False"),
    ({"corrupt": "bits"}, "none, activation, gradient"),
])
def test_bad_settings_are_refused_before_any_rank_starts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_experiment("pipeline_parallel", preset="tiny",
                       overrides={**TINY_DIST, "device": "cpu", **overrides}, progress=False)
