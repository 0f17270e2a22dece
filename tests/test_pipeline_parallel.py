"""pipeline_parallel on two gloo ranks: every schedule's loss and gradients are one process's, a
corrupted handoff or a dropped weight-gradient step fails that check, the micro-batches held and
the bytes saved for backward are the planner's, and the bubble's prediction is the schedule
replayed on the run's own calibration. One launch for all of it; the replay and the planner's
formulas are checked on known durations against torch's own action lists. No test reads a
wall-clock bubble: speed is for benchmarks and `selfcheck`."""
from fractions import Fraction

import pytest
from conftest import TINY_DIST

from labkit.blocks.pipeline_schedule import (bubbles, in_flight, rank_of, replay, replay_actions,
                                             replayed_bubbles, schedule_order, stages_per_rank,
                                             torch_orders)
from labkit.blocks.pipeline_stages import CORRUPTION, balance, bubble_metrics
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.planner import pipeline as plan
from labkit.techniques.pipeline_parallel import (GRAD_TOLERANCE, LOSS_TOLERANCE, SCHEDULES,
                                                 VARIANTS, Config, skip_reason)

pytestmark = pytest.mark.multiprocess  # this module starts ranks (one launch)

M = 3  # micro-batches of one sequence each: ZBV fills its V from 2p-1 = 3
# the handoff faults share one mechanism (`TimedStage._maybe_corrupt`): "gradient" stands for both,
# its error's size predicted; "activation" would add a third of this file's CPU time
CORRUPT = ["none", "gradient", "skip_w"]
DELAY_MS = 1.0  # rank 1 sleeps in every micro-batch forward: its calibrated forward holds it
# gloo ranks on the CPU: on a GPU host the default device is cuda, one NCCL rank per GPU
SIZES = {**TINY_DIST, "device": "cpu", "batch_size": M, "micro_batches": M, "delay_stage": 1, "timed_steps": 1,
         "stage_delay_ms": DELAY_MS}
SPLIT = ("zero_bubble", "zbv")


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


def clean(frame):
    return frame[frame.corrupt == "none"]


def test_every_clean_variant_ran_on_both_ranks(frame):
    rows = clean(frame)
    bad = rows[rows.status != "ok"]
    assert bad.empty, bad[["variant", "status", "message"]].to_string()
    assert set(zip(rows.variant, rows["rank"])) == {(v, r) for v in VARIANTS for r in (0, 1)}


def test_every_schedule_trains_the_single_process_step(frame):
    rows = clean(frame)
    pipe = rows[rows.variant != "single"]
    assert (values(pipe, "loss_rel_diff").value <= LOSS_TOLERANCE).all()
    assert (values(pipe, "grad_max_rel_diff").value <= GRAD_TOLERANCE).all()
    reference = values(rows, "loss", variant="single").value.iloc[0]
    losses = values(pipe, "loss").value  # the last module's rank's, broadcast: the same on both
    assert losses.sub(reference).abs().max() <= LOSS_TOLERANCE * reference


def test_a_corrupted_handoff_fails_the_check_on_every_rank(frame):
    rows = frame[frame.corrupt == "gradient"]
    assert (rows[rows.variant == "single"].status == "ok").all()
    pipe = rows[rows.variant != "single"]
    assert set(zip(pipe.variant, pipe["rank"])) == {(v, r) for v in SCHEDULES for r in (0, 1)}
    assert (pipe.status == "error").all()
    assert pipe.message.str.contains("does not match single").all()
    assert values(pipe, "bubble_fraction").empty  # nothing is timed after a failed check
    assert values(pipe, "loss_rel_diff").value.max() <= LOSS_TOLERANCE  # the forward is intact
    # One module per rank: rank 1's input gradient, 0.1% large, scales all of rank 0's, and the
    # head's own are right; a looped rank receives a gradient for some module, each handoff
    # compounding the error (ZBV's rank 1 holds the V's turn, whose handoff stays on the rank).
    grads = values(pipe, "grad_max_rel_diff")
    one = grads[grads.variant.isin(["gpipe", "1f1b"])].sort_values(["variant", "rank"])
    assert one.value.tolist() == pytest.approx([CORRUPTION, 0, CORRUPTION, 0], abs=1e-6, rel=1e-2)
    looped = grads[~grads.variant.isin(["gpipe", "1f1b"])]
    assert (looped.value > GRAD_TOLERANCE).all(), looped[["variant", "rank", "value"]]


def test_a_dropped_weight_gradient_step_fails_the_check(frame):
    """skip_w: micro-batch 0's W never runs on any module; the other schedules have no W."""
    rows = frame[(frame.corrupt == "skip_w") & (frame.variant != "single")]
    split = rows[rows.variant.isin(SPLIT)]
    assert set(zip(split.variant, split["rank"])) == {(v, r) for v in SPLIT for r in (0, 1)}
    assert (split.status == "error").all()
    assert (values(split, "loss_rel_diff").value <= LOSS_TOLERANCE).all()  # the forward is intact
    assert (values(split, "grad_max_rel_diff").value > 10 * GRAD_TOLERANCE).all()
    others = rows[~rows.variant.isin(SPLIT)]
    assert (others.status == "skipped").all() and others.message.str.contains("split").all()


def test_micro_batches_held_are_the_planners_count(frame):
    rows = values(clean(frame), "in_flight_micro_batches")
    assert set(rows.variant) == set(SCHEDULES)
    assert (rows.value == rows.predicted).all(), rows[["variant", "rank", "value", "predicted"]]


def test_bytes_sent_are_the_planners_handoffs(frame):
    """A step's sends (counted by CommCounter in the step after the check): 1F1B m tensors a
    rank, looped 2v - 1 of them, ZBV 2 (the V's turn stays on rank p-1)."""
    rows = clean(frame)
    for metric in ("comm_bytes", "send_count"):
        pipe = values(rows, metric)
        assert set(pipe.variant) == set(SCHEDULES)
        assert (pipe.value == pipe.predicted).all(), pipe[["variant", "rank", "value", "predicted"]]
    sends = values(rows, "send_count", rank=0).set_index("variant").value
    assert sends.to_dict() == {"gpipe": M, "1f1b": M, "interleaved_1f1b": 3 * M,
                               "zero_bubble": 3 * M, "zbv": 2 * M}


def test_saved_bytes_are_the_planners_per_micro_batch_bytes_held_by_the_schedule(frame):
    rows = values(clean(frame), "activation_bytes")
    pipe = rows[rows.variant != "single"]
    assert (pipe.value == pipe.predicted).all(), pipe[["variant", "rank", "value", "predicted"]]
    gpipe, zbv = (pipe[pipe.variant == v].set_index("rank").value for v in ("gpipe", "zbv"))
    assert zbv.max() < gpipe.max()  # zbv holds p of a module pair's micro-batches, gpipe all m


@pytest.mark.parametrize("variant", list(SCHEDULES))
def test_the_predicted_bubble_is_the_schedule_replayed_on_the_calibration(frame, variant):
    pipe = clean(frame)[clean(frame).variant == variant]
    per_rank = {k: values(pipe, k).sort_values("rank").value.tolist()
                for k in ("stage_fwd_ms", "stage_bwd_ms", "handoff_ms")}
    assert per_rank["stage_fwd_ms"][1] >= DELAY_MS  # the injected sleep is timed with it
    assert per_rank["handoff_ms"][0] == per_rank["handoff_ms"][1] > 0
    busy = values(pipe, "stage_busy_ms").sort_values("rank").predicted.tolist()
    assert busy == pytest.approx([M * (f + b) for f, b in zip(per_rank["stage_fwd_ms"],
                                                              per_rank["stage_bwd_ms"])])
    if variant in ("gpipe", "1f1b"):  # one module per rank: the rows hold every duration
        wall, bubble = replayed_bubbles(variant, M, [f / 1e3 for f in per_rank["stage_fwd_ms"]],
                                        [b / 1e3 for b in per_rank["stage_bwd_ms"]],
                                        per_rank["handoff_ms"][0] / 1e3)
        rows = values(pipe, "bubble_fraction").sort_values("rank")
        assert rows.predicted.tolist() == pytest.approx(bubble, rel=1e-9)
        assert values(pipe, "schedule_wall_ms").predicted.tolist() == pytest.approx(
            [wall * 1e3] * 2, rel=1e-9)
    # the idle time's split: the replay with free handoffs, plus the handoffs, is the prediction
    idle = values(pipe, "idle_ms").sort_values("rank")
    parts = [values(pipe, k).sort_values("rank").value.to_numpy()
             for k in ("idle_schedule_ms", "idle_handoff_ms", "idle_host_ms")]
    assert (parts[0] + parts[1]).tolist() == pytest.approx(idle.predicted.tolist())
    assert (parts[0] + parts[1] + parts[2]).tolist() == pytest.approx(idle.value.tolist())
    ideal = values(pipe, "ideal_bubble_fraction")
    assert ideal.value.tolist() == ideal.predicted.tolist() == pytest.approx(
        [plan.ideal_bubble_fraction(variant, 2, M, stages_per_rank(variant, 2))] * 2)


def test_ranks_hold_their_share_of_the_parameters(frame):
    rows = clean(frame)
    single = values(rows, "param_bytes", variant="single")
    for variant in SCHEDULES:
        held = values(rows, "param_bytes", variant=variant)
        assert (held.value == held.predicted).all()
        assert held.value.sum() == single.value.iloc[0] == single.predicted.iloc[0]


@pytest.mark.parametrize("variant, overrides, message", [
    ("1f1b", {"micro_batches": 1}, "m=1 < 2"),
    ("interleaved_1f1b", {"micro_batches": 1}, "m=1 < 2"),
    ("zbv", {"micro_batches": 2}, "2p-1"),
    ("zero_bubble", {"micro_batches": 5, "batch_size": 10}, "multiple of max(1, m // p) = 2"),
    ("zbv", {"num_layers": 1}, "num_layers >= 2"),
    ("interleaved_1f1b", {"corrupt": "skip_w"}, "only zero_bubble and zbv"),
])
def test_schedules_skip_settings_they_cannot_run(variant, overrides, message):
    sizes = {"device": "cpu", "nproc": 2, "micro_batches": 4, "batch_size": 12, "num_layers": 2}
    cfg = resolve(Config, "tiny", {**sizes, **overrides, "variant": variant})
    assert message in skip_reason(cfg)
    assert skip_reason(resolve(Config, "tiny", {**sizes, "variant": variant})) is None


# --- the replay and the planner's formulas, on known durations ---------------------------------

@pytest.mark.parametrize("variant", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_equal_stages_and_free_handoffs_replay_to_the_formula(variant, p):
    for m in range(p if variant == "1f1b" else 1, 9):
        wall, bubble = replayed_bubbles(variant, m, [Fraction(1)] * p, [Fraction(2)] * p, 0)
        assert wall == (m + p - 1) * 3
        assert bubble == [Fraction(p - 1, m + p - 1)] * p  # exact: durations are Fractions


def equal_modules(variant, p, v):
    """Each module's F, I and W take 1/n of a stage's third (B = I + W), n modules per rank."""
    n = stages_per_rank(variant, v)
    return lambda s, kind: Fraction(2 if kind == "B" else 1, n)


@pytest.mark.parametrize("variant", ["interleaved_1f1b", "zero_bubble", "zbv"])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_torchs_looped_schedules_replay_to_the_planners_bubble_and_in_flight(variant, p):
    for v in (2,) if variant == "zbv" else (1, 2, 3):
        for m in range(2 * p - 1 if variant == "zbv" else p, 3 * p + 1):
            if variant != "zbv" and m % max(1, m // p):
                continue  # torch refuses it
            orders = torch_orders(variant, p, m, v)
            _, bubble = bubbles(replay_actions(orders, equal_modules(variant, p, v), 0,
                                               rank_of(variant, p)))
            n = stages_per_rank(variant, v)
            assert bubble == [pytest.approx(plan.ideal_bubble_fraction(variant, p, m, n))] * p
            assert in_flight(orders) == [plan.in_flight_micro_batches(variant, p, m, r, v)
                                         for r in range(p)]


@pytest.mark.parametrize("times", [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, Fraction(3, 2), Fraction(1, 2)),
                                   (Fraction(1, 2), 1, 1), (1, 1, 2)])
def test_zero_bubble_idles_the_larger_of_the_papers_term_and_one_chain(times):
    """ZB1P: (p-1)·max(t_F, t_B, t_F + t_B - t_W) per rank (t_B: the input-gradient pass)."""
    t_f, t_i, t_w = map(Fraction, times)
    seconds = {"F": t_f, "I": t_i, "W": t_w}
    for p, v, m in [(2, 1, 4), (3, 1, 6), (4, 2, 8), (3, 3, 3)]:
        wall, bubble = bubbles(replay_actions(torch_orders("zero_bubble", p, m, v),
                                              lambda s, kind: seconds[kind], 0, rank_of("zero_bubble", p)))
        assert [b * wall for b in bubble] == [plan.zero_bubble_idle(p, t_f, t_i, t_w)] * p
        assert bubble[0] == pytest.approx(plan.zero_bubble_fraction(p, m, v, t_f, t_i, t_w))


def test_zero_bubble_is_a_third_of_1f1b_and_interleaving_divides_by_v():
    p, m = 4, 8
    ratio = lambda f: f / (1 - f)  # fraction of the step -> ratio to the ideal time
    assert ratio(plan.zero_bubble_fraction(p, m)) == pytest.approx(ratio(plan.gpipe_bubble_fraction(p, m)) / 3)
    assert ratio(plan.interleaved_bubble_fraction(p, m, 2)) == pytest.approx((p - 1) / (2 * m))
    assert plan.zb_h2_in_flight(p) == 2 * p - 1 > plan.in_flight_micro_batches("zero_bubble", p, m, 0)


def test_zbv_places_two_modules_per_rank_in_a_v():
    assert [rank_of("zbv", 4)(s) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [rank_of("interleaved_1f1b", 4)(s) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


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
        wall, bubble = replayed_bubbles(variant, 2, fwd, bwd, 1)
        assert (wall, bubble) == (15, [Fraction(3, 5), Fraction(1, 3)])


def test_zb1p_on_two_ranks_fills_the_wait_with_w():
    """p = 2, m = 2, every F, I and W 1: rank 0 runs F0 F1 I0 W0 I1 W1, its I0 waiting for rank
    1's (which ends at 3); rank 1, from 1, F0 I0 F1 I1 and its Ws last. Each idles 1 of 7, where
    1F1B's full backwards (B = I + W = 2) idle 3 of 9: (p-1)(t_F + t_B - t_W) against
    (p-1)(t_F + t_B + t_W)."""
    orders = torch_orders("zero_bubble", 2, 2, 1)
    assert [[k + str(i) for _, k, i in order] for order in orders] == [
        ["F0", "F1", "I0", "W0", "I1", "W1"], ["F0", "I0", "F1", "I1", "W0", "W1"]]
    spans = replay_actions(orders, lambda s, k: Fraction(1), 0, rank_of("zero_bubble", 2))
    assert spans == [[(0, 1), (1, 2), (3, 4), (4, 5), (5, 6), (6, 7)],
                     [(1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7)]]
    assert bubbles(spans) == (7, [Fraction(1, 7)] * 2)
    assert bubbles(replay_actions(torch_orders("1f1b", 2, 2), lambda s, k: Fraction(1 + (k == "B")),
                                  0, rank_of("1f1b", 2))) == (9, [Fraction(1, 3)] * 2)


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
    assert balance({"embed": 3.0, "block": 1.0, "head": 3.0}, 2, 4) == [0, 0, 1, 2, 2]  # ends alone


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
    ({"corrupt": "bits"}, "none, activation, gradient, skip_w"),
])
def test_bad_settings_are_refused_before_any_rank_starts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_experiment("pipeline_parallel", preset="tiny",
                       overrides={**SIZES, **overrides}, progress=False)
