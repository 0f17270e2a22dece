"""Two recipes' memory over one step (labkit.measure.timeline, labkit.harness.timeline,
labkit.views.memory): the categorising replay on synthetic events, then ONE recording of plain
against full checkpointing (tiny preset, 2 layers, batch 4 x 128 tokens, fp32: about 3 s)
held to the tracker's totals, the planner's terms and its predicted peaks, and the figure."""
import math

import pandas as pd
import pytest
import torch

from labkit import planner
from labkit.blocks.recipe import Recipe
from labkit.config import ConfigError, RunConfig, resolve
from labkit.blocks.recipe import planner_kwargs
from labkit.harness.timeline import compare_timelines, step_timeline
from labkit.model import build_model
from labkit.measure.timeline import CATEGORIES, PHASES, categorise, cuda_events
from labkit.views.memory import aligned_x, timeline_figure

SHAPE = {"batch_size": 4, "seq_len": 128, "num_layers": 2, "device": "cpu"}
PLAIN, FULL = Recipe(), Recipe(checkpointing="full")


def config(**overrides) -> RunConfig:
    return resolve(RunConfig, "tiny", {**SHAPE, **overrides})


# --- the replay, on events written by hand ---------------------------------------------------------

EVENTS = [
    ("alloc", 1, 100), ("claim", 1, "parameters"), ("alloc", 2, 50), ("claim", 2, "optimizer_state"),
    ("mark", "forward", None),
    ("alloc", 3, 10), ("alloc", 4, 20), ("free", 3, 0),  # 3 dies in the forward, 4 outlives it
    ("mark", "backward", None),
    ("free", 4, 0), ("alloc", 3, 30),  # address 3 again: a new storage, the gradient
    ("alloc", 5, 7), ("resize", 5, 9), ("free", 5, 0),
    ("mark", "optimizer", None), ("claim", 3, "gradients"),
    ("free", 3, 0), ("free", 99, 0),  # 99 was never allocated here: ignored
    ("mark", "end", None),
]


def test_the_replay_categorises_by_identity_and_lifetime():
    samples, marks = categorise(EVENTS)
    rows = samples[list(CATEGORIES)].to_dict("records")
    zero = dict.fromkeys(CATEGORIES, 0)
    assert rows[0] == {**zero, "parameters": 100, "optimizer_state": 50}  # the resident state
    resident = rows[0]
    expected = [{"temporaries": 10}, {"temporaries": 10, "activations": 20}, {"activations": 20},
                {}, {"gradients": 30}, {"gradients": 30, "temporaries": 7},
                {"gradients": 30, "temporaries": 9}, {"gradients": 30}, {}]
    assert rows[1:] == [{**resident, **e} for e in expected]
    assert marks == [("forward", 1), ("backward", 4), ("optimizer", 9), ("end", 10)]
    assert list(samples["phase"]) == ["start"] + ["forward"] * 3 + ["backward"] * 5 + ["optimizer"]
    assert (samples["total_bytes"] == samples[list(CATEGORIES)].sum(axis=1)).all()


def test_the_cuda_history_becomes_the_same_events():
    trace = [{"action": "alloc", "addr": 16, "size": 512}, {"action": "snapshot"},
             {"action": "alloc", "addr": 32, "size": 1024},
             {"action": "free_requested", "addr": 32, "size": 1024},
             {"action": "free_completed", "addr": 32, "size": 1024},
             {"action": "segment_alloc", "addr": 4096, "size": 2**21}, {"action": "snapshot"},
             {"action": "snapshot"}]  # the closing snapshot: no mark left
    claims = [[("mark", "forward", None)], [("mark", "optimizer", None), ("claim", 16, "gradients")]]
    assert cuda_events(trace, claims) == [
        ("alloc", 16, 512), ("mark", "forward", None), ("alloc", 32, 1024), ("free", 32, 0),
        ("mark", "optimizer", None), ("claim", 16, "gradients")]


def test_phases_are_rescaled_to_the_same_width():
    samples, _ = categorise(EVENTS)
    x = aligned_x(samples["sample"], samples["phase"])
    # forward: samples 1-3 over [0, 1); backward 4-8 over [1, 2); optimizer 9 over [2, 3)
    assert list(x[:4]) == pytest.approx([0, 0, 1 / 3, 2 / 3])
    assert list(x[4:9]) == pytest.approx([1, 1.2, 1.4, 1.6, 1.8])
    assert x[9] == 2


# --- one recording of plain against full checkpointing ------------------------------------------------

@pytest.fixture(scope="module")
def frame():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return compare_timelines(config(), [PLAIN, FULL])
    finally:
        torch.set_num_threads(threads)


def wide(frame, recipe: str):
    """One recipe's samples, one column per category."""
    rows = frame[frame["recipe"] == recipe]
    out = rows.pivot(index="sample", columns="category", values="bytes")
    return out.join(rows.drop_duplicates("sample").set_index("sample")[["phase", "total_bytes",
                                                                       "predicted_peak_bytes"]])


@pytest.mark.slow
def test_the_categories_add_up_to_the_trackers_total_at_every_sample(frame):
    for recipe in ("plain", "checkpointing=full"):
        samples = wide(frame, recipe)
        assert len(samples) > 100
        assert (samples[list(CATEGORIES)].sum(axis=1) == samples["total_bytes"]).all()


@pytest.mark.slow
def test_the_step_starts_with_the_weights_and_adamws_state(frame):
    cfg = config()
    num_tensors = len(list(build_model(cfg.model, device="meta").parameters()))
    for recipe in ("plain", "checkpointing=full"):
        samples = wide(frame, recipe)
        start = samples.iloc[0]
        assert start["parameters"] == planner.param_bytes(cfg.model, "float32")
        # m and v (the planner's AdamW state) and one fp32 step counter per parameter tensor
        assert start["optimizer_state"] == planner.adamw_state_bytes(cfg.model) + 4 * num_tensors
        assert start["gradients"] == 0
        # AdamW updates its state in place: the category holds still through the step
        assert (samples["optimizer_state"] == start["optimizer_state"]).all()
        assert (samples["parameters"] == start["parameters"]).all()


@pytest.mark.slow
def test_gradients_exist_from_the_backward_until_the_update_frees_them(frame):
    samples = wide(frame, "plain")
    by_phase = samples.groupby("phase", sort=False)["gradients"].max()
    assert by_phase["forward"] == 0
    assert by_phase["optimizer"] == planner.param_bytes(config().model, "float32")
    assert samples["gradients"].iloc[-1] == 0  # zero_grad(set_to_none=True)


@pytest.mark.slow
def test_marks_are_ordered(frame):
    for recipe, marks in frame.attrs["marks"].items():
        assert [p for p, _ in marks] == [*PHASES, "end"]
        positions = [i for _, i in marks]
        assert positions == sorted(positions) and len(set(positions)) == len(positions)
        phases = list(wide(frame, recipe)["phase"])
        assert phases == sorted(phases, key=["start", *PHASES, "end"].index)


@pytest.mark.slow
def test_full_checkpointing_holds_fewer_activations_and_both_peaks_match_the_planner(frame):
    plain, full = wide(frame, "plain"), wide(frame, "checkpointing=full")
    assert full["activations"].max() < plain["activations"].max()
    for samples, recipe in ((plain, PLAIN), (full, FULL)):
        kwargs, _ = planner_kwargs(config(), recipe)
        plan = planner.training_memory(config().model, **kwargs)
        measured = samples["total_bytes"].max()
        assert samples["predicted_peak_bytes"].iloc[0] == plan.total_bytes
        assert plan.total_bytes == pytest.approx(measured, rel=0.10)
        # what the forward leaves: the planner's activations, plus the batch and the loss
        held = samples.loc[samples["phase"] == "forward", "activations"].max()
        assert plan.activation_bytes == pytest.approx(held, rel=0.01)


def test_the_figure_draws_each_category_of_each_recipe_and_both_predicted_peaks(frame):
    fig = timeline_figure(frame)
    areas = [t for t in fig.data if t.stackgroup]
    assert sorted((t.stackgroup, t.name) for t in areas) == sorted(
        (f"recipe{row}", c) for row in (1, 2) for c in CATEGORIES)
    peaks = [t for t in fig.data if not t.stackgroup]
    assert len(fig.data) == 2 * len(CATEGORIES) + 2
    predicted = frame.drop_duplicates("recipe")["predicted_peak_bytes"]
    for line, value in zip(peaks, predicted):
        assert line.y[0] == line.y[1] == pytest.approx(value / 2**20)
        assert f"{value / 2**20:.2f} MiB" in line.name
    # the panels share one x axis, on which each recipe's phases line up
    assert all(max(t.x) == len(PHASES) and min(t.x) == 0 for t in areas)


def test_a_recipe_without_a_planner_case_is_drawn_without_a_line(frame):
    unplanned = frame[frame["recipe"] == "plain"].assign(predicted_peak_bytes=math.nan,
                                                         recipe="precision=bf16")
    fig = timeline_figure(unplanned)
    assert len(fig.data) == len(CATEGORIES)
    assert "no prediction" in fig.layout.annotations[0].text


def test_autocast_is_planned_as_autocast_in_the_recipes_own_words():
    kwargs, _ = planner_kwargs(config(), Recipe(precision="bf16"))
    assert kwargs["precision"] == "bf16"  # one vocabulary: no translation on the way
    used = planner.precision_bytes(kwargs["precision"])
    assert (used.weight, used.cast, used.act) == (4, 2, 2)  # fp32 weights, 16-bit casts, not pure


def test_bad_input_is_one_line():
    with pytest.raises(ConfigError, match="different recipes"):
        compare_timelines(config(), [PLAIN, Recipe()])
    with pytest.raises(ConfigError, match="lacks"):
        timeline_figure(pd.DataFrame({"recipe": ["plain"]}))


def test_accumulation_marks_each_micro_batch_and_holds_the_first_ones_gradients():
    timeline = step_timeline(config(batch_size=2, seq_len=16), Recipe(micro_batches=2))
    phases = [p for p, _ in timeline.marks]
    assert phases == ["forward", "backward", "forward", "backward", "optimizer", "end"]
    samples = timeline.timeline.samples
    second = samples[(samples["micro_batch"] == 1) & (samples["phase"] == "forward")]
    assert (second["gradients"] == planner.param_bytes(config().model, "float32")).all()
    assert timeline.predicted_peak_bytes == pytest.approx(timeline.timeline.peak_bytes(), rel=0.10)


def test_a_long_step_is_drawn_thinned_with_its_peak_and_phase_edges_kept():
    from labkit.views.memory import thinned

    samples = 5000
    phases = ["forward"] * 2000 + ["backward"] * 2000 + ["optimizer"] * 1000
    total = [i % 97 for i in range(samples)]
    total[3333] = 10_000  # the peak, off the stride
    rows = pd.DataFrame({"sample": range(samples), "phase": phases, "total_bytes": total})
    kept = thinned(rows, most=500)
    assert len(kept) <= 500 + 7 and 3333 in set(kept["sample"])
    assert {0, 1999, 2000, 3999, 4000, 4999} <= set(kept["sample"])
    assert thinned(rows.head(400), most=500).equals(rows.head(400))  # short steps drawn whole
