"""pipeline_parallel on two gloo ranks: the pipeline's loss and gradients are one process's, the
measured bubble follows (p-1)/(m+p-1), and a slow stage raises it. One launch for all of it."""
import pytest
from conftest import TINY_DIST

from labkit.config import ConfigError
from labkit.experiment import run_experiment
from labkit.techniques.pipeline_parallel import balance, bubble_metrics

# Not m = 8: a micro-batch of one sequence computes for ~3 ms, and on a 2-core host a rank's wake-up
# after a receive (outside the compute spans that `stall_fraction` watches) can then double the bubble.
MICRO_BATCHES = [1, 2, 4]
DELAY_MS = 30.0  # per micro-batch forward of stage 1
# Three blocks and a 3072-word head: the measured split is embedding + 2 blocks | 1 block + head,
# two stages within ~10% of each other (the formula assumes equal stages); 8 sequences of 128
# tokens keep a stage's compute per micro-batch (>= 15 ms) far above a handoff (~0.3 ms).
# The bubble is read from the fastest of 10 timed steps (the least disturbed by other processes).
SIZES = {**TINY_DIST, "num_layers": 3, "vocab_size": 3072, "seq_len": 128, "batch_size": 8,
         "warmup": 1, "timed_steps": 10, "delay_stage": 1}
BUBBLE_TOLERANCE = 0.10
QUIET_STALL = 0.05  # compute spans off the CPU at most 5% of their time (an idle host: ~1%)


def launch(tmp_path_factory, overrides, sweep, variants=None):
    result = run_experiment("pipeline_parallel", preset="tiny", overrides=overrides, sweep=sweep,
                            variants=variants, runs_dir=str(tmp_path_factory.mktemp("runs")),
                            progress=False)
    df = result.frame()
    df["m"] = df["params"].map(lambda p: p["micro_batches"])
    return df


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    return launch(tmp_path_factory, SIZES, {"micro_batches": MICRO_BATCHES})


@pytest.fixture(scope="module")
def delayed(tmp_path_factory):
    """GPipe at m = 4 with stage 1 sleeping in every forward (a second, small launch)."""
    overrides = {**SIZES, "timed_steps": 4, "micro_batches": 4, "stage_delay_ms": DELAY_MS}
    return launch(tmp_path_factory, overrides, None, variants=["gpipe"])


def values(df, metric, **where):
    rows = df[df.metric == metric]
    for key, value in where.items():
        rows = rows[rows[key] == value]
    return rows


def test_every_point_ran_and_1f1b_skips_fewer_micro_batches_than_stages(frame):
    bad = frame[~frame.status.isin(["ok", "skipped"])]
    assert bad.empty, bad[["variant", "m", "status", "message"]].to_string()
    skipped = frame[frame.status == "skipped"]
    assert set(zip(skipped.variant, skipped.m)) == {("1f1b", 1)}
    assert "m=1 < p=2" in skipped.message.iloc[0]
    assert set(frame["rank"]) == {0, 1}


def test_pipeline_loss_and_gradients_equal_the_single_process_step(frame):
    pipe = frame[frame.variant != "single"]
    assert (values(pipe, "loss_rel_diff").value <= 1e-6).all()
    assert (values(pipe, "grad_max_rel_diff").value <= 1e-5).all()
    for m in MICRO_BATCHES:  # the last stage's loss, broadcast: the same on both ranks
        reference = values(frame, "loss", variant="single", m=m).value.iloc[0]
        losses = values(pipe, "loss", m=m).value
        assert losses.sub(reference).abs().max() <= 1e-6 * reference


def test_measured_bubble_follows_the_formula(frame):
    """Asserted where the host left the ranks alone: where another process stole their cores
    (`stall_fraction_max`), the bubble measures the host, and the point is reported instead."""
    undelayed = values(frame[frame.variant != "single"], "bubble_fraction_mean")
    assert len(undelayed) == 2 * (2 * len(MICRO_BATCHES) - 1)  # two ranks, 7 (variant, m) points
    undelayed = undelayed[undelayed["rank"] == 0]  # the mean over ranks: the same on each
    stalls = values(frame, "stall_fraction_max")
    busy_host = []
    for _, row in undelayed.iterrows():
        assert row.predicted == pytest.approx(1 / (row.m + 1))
        stall = stalls[(stalls.variant == row.variant) & (stalls.m == row.m)].value.max()
        if stall > QUIET_STALL:
            busy_host.append(f"{row.variant} m={row.m}: stall {stall:.2f}, bubble {row.value:.3f}")
            continue
        assert abs(row.value - row.predicted) <= BUBBLE_TOLERANCE, (row.variant, row.m, row.value)
    if busy_host:
        pytest.skip("host too busy to time the bubble at " + "; ".join(busy_host))


def test_a_slow_stage_raises_the_bubble(frame, delayed):
    """Stage 1 sleeps 30 ms in every forward (about 2x its compute at m = 4): stage 0 waits.
    With equal stages of c and a sleep of 2c, stage 0's bubble goes from 1/5 to 1 - 4/13 ~ 0.7
    and the mean from 0.2 to ~0.38; stage 0's is the robust signal on a shared host."""
    base = values(frame, "bubble_fraction", variant="gpipe", m=4, rank=0).value.iloc[0]
    slow = values(delayed, "bubble_fraction", variant="gpipe", rank=0).value.iloc[0]
    assert slow >= base + 0.2
    means = [values(f, "bubble_fraction_mean", variant="gpipe", **kw).value.iloc[0]
             for f, kw in ((frame, {"m": 4}), (delayed, {}))]
    assert means[1] > means[0]
    per_rank = values(delayed, "bubble_fraction", variant="gpipe").set_index("rank").value
    assert per_rank[0] > per_rank[1] + 0.2


def test_stages_hold_their_share_of_the_parameters(frame):
    rows = values(frame, "param_bytes", variant="gpipe", m=4)
    assert (rows.value == rows.predicted).all()
    single = values(frame, "param_bytes", variant="single", m=4)
    assert rows.value.sum() == single.value.iloc[0] == single.predicted.iloc[0]
    note = values(frame, "stage_cost_ms", variant="gpipe", m=4).message.iloc[0]
    assert "stage 0: embedding + blocks 0..1" in note and "stage 1: blocks 2..2 + head" in note


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
])
def test_bad_settings_are_refused_before_any_rank_starts(overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_experiment("pipeline_parallel", preset="tiny", overrides={**TINY_DIST, **overrides},
                       progress=False)
