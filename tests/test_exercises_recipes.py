"""The recipe exercises (labkit.study.exercises.recipes), against answers computed here.

For "cpu" and "cuda" (the Run pins CPU ranks, so a GPU machine answers the same): the careful
learner's answer, added up here from the rules and numbers the details state (closed forms in Ψ,
b, s, V, d, N, and the planner's activation bytes and FSDP2's working sets, which the details
print), is graded right; the common mistake, computed here too, equals the exercise's and is
graded wrong. The Run's one launch (the ladder's 4 recipes on two gloo ranks, in conftest's
`shared_runs`, which the tests below only read) then shows the mechanisms: every rank's peak
beside the planner's, the rungs over the budget as oom rows, the first that fits measured under
it; and a doctored measurement is not taken as support."""
import pytest

from labkit import planner
from labkit.study import exercises
from labkit.study.exercises import recipes

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

MiB = 2**20
DEVICES = ("cpu", "cuda")
N = 2  # the Run's ranks (the details say so)
KEYS = ("recipe_peak", "ladder_fit")


def setup(device="cpu"):
    return exercises.Setup(exercises.RUNS["recipe"], device)


def numbers(s, point):
    c = s.cfg("composed", **point)
    m = c.model
    return planner.num_params(m), c.batch_size // c.micro_batches, c.seq_len, m.vocab_size, m.hidden_size


def learner_moments(s, point, gathered_bytes=2):
    """The moments before the optimizer step as the details describe them, from closed forms
    (the activations are the planner's, printed in the details, and so are FSDP2's working
    sets); `gathered_bytes`: per gathered weight (FSDP2's bf16 policy: 2)."""
    psi, b, seq, vocab, d = numbers(s, point)
    accumulating = point["micro_batches"] > 1
    acts = recipes.plan(s, point).activation_bytes
    if point["zero_stage"] == 2:
        states, grads, printed = 4 * psi / N + 8 * psi / N, 4 * psi / N, recipes.moments(s, point)
        return {"backward": states + gathered_bytes * psi + (grads if accumulating else 0) + acts
                + printed["backward"]["temporaries"],
                "reduce": states + grads + printed["reduce"]["temporaries"]}
    casts = recipes.all_casts(s)  # DDP with autocast
    kept = 2 * vocab * d if point["checkpointing"] == "full" else casts
    held = 4 * psi + 8 * psi + 4 * psi + (4 * psi if accumulating else 0)
    return {"forward": held + acts + casts + 6 * b * seq * vocab,  # the logits, bf16 and fp32
            "backward": held + acts + kept + 8 * b * seq * vocab}  # the loss's fp32 gradients


def learner_peak(s, gathered_bytes=2):
    # the step holds less (no activations, no gathered weights)
    return max(learner_moments(s, recipes.TOP, gathered_bytes).values()) / MiB


def learner_ladder(s, forget_accumulated=False):
    budget = s.cfg().budget_gib * 2**30
    for name, point in recipes.RUNGS.items():
        moments = learner_moments(s, point)
        if forget_accumulated and point["zero_stage"] == 0 and point["micro_batches"] > 1:
            moments = {k: v - 4 * numbers(s, point)[0] for k, v in moments.items()}
        if max(moments.values()) <= budget:
            return name
    return recipes.NONE


def test_the_details_print_the_numbers_the_learner_uses():
    s = setup()
    psi, b, seq, vocab, d = numbers(s, recipes.TOP)
    for key in KEYS:
        text = exercises.describe(key)
        assert f"Ψ = {psi:,} parameters" in text and "N = 2 ranks" in text, key
        assert f"{recipes.plan(s, recipes.TOP).activation_bytes:,}" in text
    assert f"b = {b}" in exercises.describe("recipe_peak") and "65 MiB" in exercises.describe("ladder_fit")
    printed = recipes.moments(s, recipes.TOP)  # FSDP2's working sets, which the learner adds
    for moment in ("backward", "reduce"):
        assert f"{printed[moment]['temporaries']:,}" in exercises.describe("recipe_peak"), moment


@pytest.mark.parametrize("device", DEVICES)
def test_the_careful_learner_is_graded_right_and_the_mistake_wrong(device):
    s = setup(device)
    peak, ladder = exercises.get("recipe_peak"), exercises.get("ladder_fit")
    assert exercises.grade(peak, learner_peak(s), exercises.reference_answer("recipe_peak", device))
    assert learner_ladder(s) == exercises.reference_answer("ladder_fit", device) == "+ ZeRO-2"
    # The mistakes: the gathered weights counted in fp32; DDP's accumulated .grad forgotten
    wrong = learner_peak(s, gathered_bytes=4)
    assert wrong == pytest.approx(peak.mistake(s), rel=1e-9)
    assert not exercises.grade(peak, wrong, exercises.reference_answer("recipe_peak", device))
    assert learner_ladder(s, forget_accumulated=True) == ladder.mistake(s) == "+ 2 micro-batches"
    assert not exercises.grade(ladder, ladder.mistake(s), exercises.reference_answer("ladder_fit", device))


def test_the_moments_add_up_to_the_planners_phases():
    """The details' terms sum to the planner's phases (the prediction each row carries), at
    every moment of every rung."""
    s = setup()
    for name, point in recipes.RUNGS.items():
        plan, mine = recipes.plan(s, point), recipes.moments(s, point)
        sums = {phase: sum(terms.values()) for phase, terms in mine.items()}
        assert sums == {phase: plan.phase_bytes[phase] for phase in sums}, name
        assert plan.total_bytes == max(plan.phase_bytes.values())
        assert learner_moments(s, point) == {k: v for k, v in sums.items() if k != "step"}, name


def test_choices_have_feedback_and_a_level_and_hint():
    for key in KEYS:
        ex = exercises.get(key)
        assert ex.level == 3 and ex.hint and ex.supports and ex.mistake_why
    ladder = exercises.get("ladder_fit")
    assert set(ladder.feedback) == set(ladder.choices) and all(ladder.feedback.values())


def test_the_measurement_supports_both_answers(shared_runs):
    s, rows = setup(), exercises.measure(exercises.RUNS["recipe"], "cpu", shared_runs)
    assert "reused" in rows.source
    for key in KEYS:
        assert exercises.get(key).supports(rows, s) is None, key
    budget = s.cfg().budget_gib * 2**30
    for rank in range(N):  # the mechanism itself: rungs over the budget are oom, ZeRO-2 fits
        statuses = [rows.get("composed", rank=rank, **p)["status"] for p in recipes.RUNGS.values()]
        assert statuses == ["oom", "oom", "oom", "ok"], statuses
        assert rows.get("composed", "peak_mem_bytes", rank=rank, **recipes.TOP) <= budget
        assert rows.get("plain", "peak_mem_bytes", rank=rank, **recipes.TOP) > budget  # no budget on plain


def test_a_doctored_measurement_does_not_support_them(shared_runs):
    rows = exercises.measure(exercises.RUNS["recipe"], "cpu", shared_runs)
    huge = exercises.Rows([{**r, "value": 1e12 if r["value"] is not None else None} for r in rows.rows], "doctored")
    all_ok = exercises.Rows([{**r, "status": "ok"} for r in rows.rows], "doctored")
    for bad in (huge, all_ok):
        assert exercises.get("ladder_fit").supports(bad, setup())
    assert exercises.get("recipe_peak").supports(huge, setup())


def test_check_grades_the_key_right_and_a_wrong_answer_wrong(shared_runs):
    for key in KEYS:
        right = exercises.check(key, solution=True, device="cpu", runs_dir=shared_runs)
        report = right.report()
        assert right.correct and "reused" in right.source, report
        assert "{" not in report and "n/a" not in report and "Note:" not in report, report
    wrong = exercises.check("ladder_fit", "+ 2 micro-batches", device="cpu", runs_dir=shared_runs)
    assert not wrong.correct and wrong.mistake and "A common mistake" in wrong.report()
    wrong = exercises.check("recipe_peak", exercises.get("recipe_peak").mistake(setup()), device="cpu",
                            runs_dir=shared_runs)
    assert not wrong.correct and wrong.mistake
