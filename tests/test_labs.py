"""The troubleshooting labs: keys, notebooks, titles and symptoms that never name the cause and
show no knob (labs whose symptoms overlap told apart by a letter only), evidence that really shows
the fault (measured in the broken run) in figures, one knob table for every lab shown after the
diagnosis, a reference fix graded fixed and the broken settings graded not fixed (the
out-of-memory lab's three fixes on the re-measured peak; the labs whose figure is read off the
wall clock, on given figures either side of their margin), feedback for every diagnosis,
one-line errors, decoys, stored attempts, what a CPU cannot show said at the top (the GEMM lab
and the GPU drills, with the H200 record's figure), and the labs played through in notebooks
executed by papermill.

Each Run behind the labs is measured once per session (`lab_runs`, into the exercises' shared
folder, so the pipeline Run is the exercises' one), and each reference fix is measured once."""
import math
from pathlib import Path

import pytest

from conftest import execute_notebooks
from labkit import planner
from labkit.study import exercises
from labkit.config import ConfigError
from labkit.study.exercises import attempts, h200, labs
from labkit.study.exercises.core import Setup
from labkit.study.exercises.text import sections

pytestmark = pytest.mark.slow  # this module's fixtures measure for seconds

ROOT = Path(__file__).resolve().parents[1] / "notebooks" / "exercises"
DEVICE = "cpu"
# Words that would give each cause away in a symptom.
GIVEAWAYS = {
    labs.DIAGNOSES[0]: ("out of memory", "oom", "activation", "checkpoint"),
    labs.DIAGNOSES[1]: ("loader", "loading", "worker", "data", "starv"),
    labs.DIAGNOSES[2]: ("overflow", "inf", "nan", "65504", "range"),
    labs.DIAGNOSES[3]: ("underflow", "scal", "zero", "gradient"),
    labs.DIAGNOSES[4]: ("padding", "pad", "static", "continuous", "waste"),
    labs.DIAGNOSES[5]: ("unbalanced", "balance", "slow stage", "delay", "stage 0"),
    labs.DIAGNOSES[6]: ("align", "255", "4095", "multiple", "tensor core", "shape"),
    labs.DIAGNOSES[7]: ("checkpoint", "recomput"),
    labs.DIAGNOSES[8]: ("cache", "kv", "prefix"),
    labs.HEALTHY: ("nothing", "healthy", "as planned"),
}
# The labs by cause (the tests' names for them: their keys name only what is reported).
CAUSE = {lab.diagnosis: key for key, lab in labs.LABS.items()}
(OOM_LAB, LOADER_LAB, OVERFLOW_LAB, UNDERFLOW_LAB, PADDING_LAB, PIPELINE_LAB, SHAPE_LAB, RECOMPUTE_LAB,
 KV_LAB, HEALTHY_LAB) = (CAUSE[d] for d in labs.DIAGNOSES)


@pytest.fixture(scope="session")
def lab_runs(shared_runs):
    """Every lab Run measured once, into the exercises' folder (RUNS["pipe"] is already there)."""
    for run in labs.LAB_RUNS.values():
        exercises.measure(run, DEVICE, shared_runs, reuse=False)
    return shared_runs


@pytest.fixture(scope="session")
def evidence(lab_runs):
    return {key: labs.investigate(key, DEVICE, lab_runs) for key in labs.LABS}


@pytest.fixture(scope="session")
def fixed(lab_runs):
    """Each lab's reference fix, measured again once (a stored run of its settings is reused)."""
    return {key: labs.apply_fix(key, labs.reference_fix(key), device=DEVICE, runs_dir=lab_runs)
            for key in labs.LABS}


def reading(evidence, key):
    ev = evidence[key]
    return ev.reading, Setup(ev.reading.trial.run, DEVICE)


def test_ten_labs_by_level_with_shared_diagnoses():
    assert len(labs.LABS) >= 10
    levels = [lab.level for lab in labs.LABS.values()]
    assert set(levels) <= {2, 3} and levels == sorted(levels)
    assert all(lab.key.startswith("lab_") and lab.diagnosis in labs.DIAGNOSES for lab in labs.LABS.values())
    assert set(exercises.LABS) == set(labs.LABS) and not set(labs.LABS) & set(exercises.EXERCISES)
    assert len(exercises.EXERCISES) + len(labs.LABS) >= 40


def test_lab_runs_are_single_process():
    from labkit.techniques import get_experiment

    assert not any(getattr(get_experiment(r.experiment), "DISTRIBUTED", False) for r in labs.LAB_RUNS.values())


@pytest.mark.parametrize("key", list(labs.LABS))
def test_symptoms_never_name_the_cause(key):
    lab = labs.LABS[key]
    said = lab.symptoms.lower()
    assert not any(d.lower() in said for d in labs.DIAGNOSES)
    assert not [w for w in GIVEAWAYS[lab.diagnosis] if w in said], said
    assert lab.symptoms in labs.symptoms(key, DEVICE)


def named_causes(name, diagnosis):
    """The words of GIVEAWAYS[diagnosis] in a key, a file name or a title."""
    said = name.lower().replace("_", " ")
    return [w for w in GIVEAWAYS[diagnosis] if w in said]


def test_no_key_notebook_or_title_names_the_cause():
    """A lab's key, notebook file and title say what is reported, never a word of its cause; the
    same check finds the cause in the old keys (all but lab_pipeline, which named the setup only,
    as the new key does: the diagnoses' words are the fault's, not the setup's)."""
    for key, lab in labs.LABS.items():
        for name in (key, lab_path(key).name, lab.title):
            assert not named_causes(name, lab.diagnosis), (key, name)
    caught = {old for old, new in attempts.RENAMED.items() if named_causes(old, labs.LABS[new].diagnosis)}
    assert caught == set(attempts.RENAMED) - {"lab_pipeline"}, caught
    assert not [p.name for p in ROOT.glob("[0-9][0-9]_lab_*.ipynb") if p.stem[3:] not in labs.LABS]


def fix_words(lab):
    """What would give a fix away: every knob's name, and the reference fix as a report says it."""
    return [*labs.KNOBS, *(f"{k}={v!r}" for k, v in lab.solution.items())]


def lab_path(key):
    return next(ROOT.glob(f"[0-9][0-9]_{key}.ipynb"))


def first_cells(key):
    """The lab notebook's cells up to its diagnosis cell: what a learner reads before diagnosing."""
    import nbformat

    cells = nbformat.read(lab_path(key), as_version=4).cells
    last = next(i for i, c in enumerate(cells) if "labs.diagnose(" in c.source)
    return "\n".join(c.source for c in cells[:last + 1])


@pytest.mark.parametrize("key", list(labs.LABS))
def test_nothing_before_the_diagnosis_shows_a_knob_or_a_fix(key, evidence):
    """symptoms(), the notebook's first cells and the evidence name no knob and no fix; the
    diagnosis report (right or wrong) lists every knob, and knobs() is that table."""
    lab = labs.LABS[key]
    for text in (labs.symptoms(key, DEVICE), first_cells(key), evidence[key].report()):
        text = text.replace("; ".join(labs.DIAGNOSES), "")  # the choices name causes on purpose
        assert not [w for w in fix_words(lab) if w in text], (key, text)
    wrong = next(d for d in labs.DIAGNOSES if d != lab.diagnosis)
    for outcome in (labs.diagnose(key, solution=True), labs.DiagnosisOutcome(lab, wrong, False, "")):
        assert labs.knob_table() in outcome.report() and all(k in outcome.report() for k in labs.KNOBS)
    assert labs.knobs(key) == labs.knob_table()


def test_every_lab_accepts_the_same_knobs_and_maps_its_own():
    """Every value of every knob is a valid fix for every lab (none refused); a lab maps the knobs
    its setup has (its broken settings), and any other knob measures the broken setup again."""
    for key, lab in labs.LABS.items():
        assert set(lab.broken) == set(lab.fixes) <= set(labs.KNOBS), key
        assert lab.trial_for(labs.parse_fix(key, {})) == lab.trial
        assert lab.trial_for(labs.parse_fix(key, dict(lab.broken))) == lab.trial
        assert len(lab.changed(labs.parse_fix(key, lab.solution))) == (lab.diagnosis != labs.HEALTHY)
        for knob, values in labs.KNOBS.items():
            for value in values:
                trial = lab.trial_for(labs.parse_fix(key, {knob: value}))
                assert isinstance(trial, labs.Trial), (key, knob, value)
                if knob not in lab.fixes:
                    assert trial == lab.trial, (key, knob, value)
    mapped = {k for lab in labs.LABS.values() for k in lab.fixes}
    assert mapped == set(labs.KNOBS)  # every knob is some lab's fix: no knob is there for show


def test_decoys_a_healthy_lab_and_overlapping_symptoms():
    """Labs whose symptoms overlap differ by a letter only before the evidence: one key and title
    but the letter, one symptoms text (the setup's numbers filled in), one level; their letters'
    order is not DIAGNOSES' order."""
    healthy = [lab for lab in labs.LABS.values() if lab.diagnosis == labs.HEALTHY]
    assert len(healthy) == 1 and healthy[0].key == HEALTHY_LAB
    overlaps = {"does not learn": (OVERFLOW_LAB, UNDERFLOW_LAB),
                "longer than the planner": (LOADER_LAB, HEALTHY_LAB, RECOMPUTE_LAB)}
    for phrase, keys in overlaps.items():
        found = [k for k, lab in labs.LABS.items() if phrase in lab.symptoms]
        assert set(keys) <= set(found), (phrase, found)
        assert len({labs.LABS[k].diagnosis for k in keys}) == len(keys)
        group = [labs.LABS[k] for k in sorted(keys)]
        assert len({lab.key[:-1] for lab in group}) == 1 and len({lab.level for lab in group}) == 1
        stem = group[0].title[:-len(" (A)")]
        assert [lab.title for lab in group] == [f"{stem} ({k[-1].upper()})" for k in sorted(keys)]
        assert len({sections(lab.key)["symptoms"] for lab in group}) == 1
        order = [labs.DIAGNOSES.index(lab.diagnosis) for lab in group]
        assert order != sorted(order), keys


def _evidence_oom(r, s):
    c = s.cfg("none")
    assert r.status == "oom" and "budget" in r.message
    assert s.expected("none")["peak_mem_bytes"] > c.memory_budget_gib * 2**30
    assert r.get("peak_mem_bytes", variant="full") < c.memory_budget_gib * 2**30  # a fix exists


def _evidence_data(r, s):
    c = s.cfg("baseline")
    assert r.trial.variant == "baseline" and r.get("flops") == s.expected("baseline")["flops"]
    # the step blocks in next() for the batch's injected storage latency at least (a sleep is
    # never shorter), and data_wait_pct is that wait's share of the step, from the same records
    assert r.get("data_ms") >= c.batch_size * c.io_latency_us / 1e3
    data, compute = r.get("data_ms"), r.get("compute_ms")
    assert r.get("data_wait_pct") == pytest.approx(100 * data / (data + compute), rel=1e-9)


def _evidence_overflow(r, s):
    steps = s.cfg().steps
    assert r.get("loss_first") is None and "nan" in r.message  # the first forward, before any update
    assert r.get("nonfinite_losses") == steps and math.isfinite(r.get("loss_first", variant="fp32"))


def _evidence_underflow(r, s):
    assert r.get("nonfinite_losses") == 0 and r.get("zero_grad_pct") == 100.0 and r.get("grad_norm") == 0
    assert r.get("loss") == pytest.approx(r.get("loss_first"), rel=1e-4)  # nothing moved
    assert r.reference("zero_grad_pct") < 50 and r.reference("loss") < r.reference("loss_first")


def _evidence_padding(r, s):
    assert r.get("padding_waste_pct") > 20 and r.get("padding_waste_pct", variant="continuous") == 0


def _evidence_pipeline(r, s):
    c = s.cfg("gpipe", **r.trial.point)
    assert c.stage_layers == labs.STAGE_LAYERS[0] == "2,0" and c.block_cost_ms == labs.BLOCK_COST_MS
    assert c.stage_delay_ms == 0.0  # no stage sleeps as such: the work follows the blocks
    # stage 0 holds both blocks, each sleeping in every micro-batch's forward (counted as busy,
    # never shorter); stage 1 holds the head alone: busy under half as long. (Not under one
    # block's sleeps: a CPU quota stretched the head's compute alone to 101 ms of the 100.)
    busy = r.get("stage_busy_ms", rank=0)
    assert busy >= c.micro_batches * 2 * labs.BLOCK_COST_MS
    assert r.get("stage_busy_ms", rank=1) < busy / 2


def _evidence_shape(r, s):
    assert not exercises.tensor_core_friendly(*labs._shape_dims(s, "off_by_one"))
    assert exercises.tensor_core_friendly(*labs._shape_dims(s, "aligned"))
    assert r.trial.variant == "fp16" and r.get("tflops") is not None  # measured in fp16


def _evidence_kv(r, s):
    c = s.cfg()
    no_cache = planner.generate_flops(c.model, batch=c.batch_size, prompt_len=c.prompt_len,
                                      new_tokens=c.new_tokens, cached=False)
    assert r.get("flops") == pytest.approx(no_cache, rel=0.01)


def _evidence_healthy(r, s):
    assert r.status == "ok" and r.get("flops") == pytest.approx(labs._plain_flops(s), rel=0.01)


def _evidence_recompute(r, s):
    assert r.get("flops") > 1.1 * labs._plain_flops(s)
    assert r.get("activation_bytes") < 0.5 * r.get("activation_bytes", variant="none")


MECHANISM = {OOM_LAB: _evidence_oom, LOADER_LAB: _evidence_data,
             OVERFLOW_LAB: _evidence_overflow, UNDERFLOW_LAB: _evidence_underflow,
             PADDING_LAB: _evidence_padding, PIPELINE_LAB: _evidence_pipeline,
             SHAPE_LAB: _evidence_shape, KV_LAB: _evidence_kv,
             HEALTHY_LAB: _evidence_healthy, RECOMPUTE_LAB: _evidence_recompute}


@pytest.mark.parametrize("key", list(labs.LABS))
def test_evidence_really_shows_the_fault(key, evidence):
    assert set(MECHANISM) == set(labs.LABS)
    MECHANISM[key](*reading(evidence, key))
    text = evidence[key].report()
    assert text.startswith("Evidence (") and "reused" in text and "{" not in text


# What the evidence said before: conclusions, not figures (issue 30).
CONCLUSIONS = ("= 16 x", "built in the training process", "ends with its longest request",
               "no GradScaler", "scheduler", "num_workers")


@pytest.mark.parametrize("key", list(labs.LABS))
def test_evidence_lines_are_figures(key, evidence):
    """Every evidence line holds a measured or planned figure (a digit), none a conclusion."""
    figures = evidence[key].figures
    assert figures and all(any(ch.isdigit() for ch in v) for v in figures.values()), figures
    text = evidence[key].report()
    assert not [c for c in CONCLUSIONS if c in text], text


@pytest.mark.parametrize("key", list(labs.LABS))
def test_reference_fix_fixed_and_broken_settings_not(key, fixed, lab_runs):
    """A verdict on the re-measured figure; the verdict itself where that figure is not read off
    the wall clock (the TIMED labs' rule is held to given figures below: under a 0.4-core quota
    with a 10 ms period the loader fix measured 24.7% waiting against the broken 17.2%)."""
    lab = labs.LABS[key]
    assert "graded " in fixed[key].report() and "Rule: " in fixed[key].report()
    noop = labs.apply_fix(key, dict(lab.broken), device=DEVICE, runs_dir=lab_runs)
    assert "reused" in noop.source  # the broken run itself
    if key not in TIMED:
        assert fixed[key].passed and "graded fixed" in fixed[key].report(), fixed[key].report()
        assert noop.passed == (lab.diagnosis == labs.HEALTHY), noop.report()


@pytest.mark.parametrize("fix, experiment", [({"checkpointing": "full"}, "checkpointing"),
                                             ({"micro_batches": 4}, "grad_accumulation"),
                                             ({"offload": "activations"}, "offload")])
def test_lab_oom_three_fixes_each_pass_on_the_remeasured_peak(fix, experiment, lab_runs):
    """Checkpointing, 4 micro-batches of 2 accumulating, and activations offloaded (on the CPU kept
    outside the virtual budget's tracker): each measured under the same budget, each peak within
    it by the margin, the same 8 x 64 tokens a step; the broken setting's run is an oom."""
    lab = labs.LABS[OOM_LAB]
    trial = lab.trial_for(labs.parse_fix(OOM_LAB, fix))
    setup = Setup(trial.run, DEVICE)
    c = setup.cfg(trial.variant)
    assert trial.run.experiment == experiment and c.memory_budget_gib == labs.OOM_BUDGET_GIB
    assert c.batch_size * getattr(c, "micro_batches", 1) * c.seq_len == 8 * 64
    out = labs.apply_fix(OOM_LAB, fix, device=DEVICE, runs_dir=lab_runs)
    after = labs.Reading(exercises.measure(trial.run, DEVICE, lab_runs), trial)
    budget = labs.OOM_BUDGET_GIB * 2**30
    assert after.status == "ok" and after.get("peak_mem_bytes") <= (1 - labs.HEADROOM) * budget
    assert out.passed and "before: oom" in out.grade.figure, out.report()


def test_lab_pipeline_moves_layers_between_stages(evidence, fixed):
    """The broken split puts both blocks on stage 0, the fix one on each: the same model, loss and
    gradients as one process (the run's check), each block at the same injected cost, and both
    measured with every stage's busy time (the verdicts on those times: the given figures below)."""
    lab = labs.LABS[PIPELINE_LAB]
    broken, fix = (lab.trial_for(labs.parse_fix(lab.key, f)) for f in (lab.broken, lab.solution))
    assert labs.parse_fix(lab.key, lab.solution) == {"stage_layers": "1,1"}
    for trial, layers in ((broken, "2,0"), (fix, "1,1")):
        c = Setup(trial.run, DEVICE).cfg("gpipe", **trial.point)
        assert c.stage_layers == layers and c.block_cost_ms == labs.BLOCK_COST_MS
    before = evidence[lab.key].reading
    assert before.get("loss_rel_diff") <= 1e-6  # the split trains the one-process step
    assert all(before.get("stage_busy_ms", rank=i) > 0 for i in (0, 1)) and "1,1" in fixed[lab.key].report()
    assert "slowest stage's busy time / fastest's" in fixed[lab.key].report()


def given(trial, figures, status="ok"):
    """A Reading of `trial` whose rows hold `figures` ({(metric, rank): value}), as measured."""
    rows = [{"variant": trial.variant, "metric": metric, "rank": rank, "value": value,
             "status": status, "params": {"sweep": dict(trial.point)}}
            for (metric, rank), value in figures.items()]
    return labs.Reading(exercises.Rows(rows, "given"), trial)


def busy(stage0_ms, stage1_ms):
    return {("stage_busy_ms", 0): stage0_ms, ("stage_busy_ms", 1): stage1_ms}


def wait(pct):
    return {("data_wait_pct", 0): pct}


# Labs whose figure is derived from wall-clock time (a stage's busy time, the share of the step
# spent waiting for data): their rule is held on given figures, either side of the margin.
GIVEN = [(PIPELINE_LAB, busy(420.0, 42.0), [(busy(30.0, 20.0), True), (busy(40.0, 20.0), True),
                                              (busy(20.0, 41.0), False), (busy(420.0, 42.0), False)]),
         (LOADER_LAB, wait(80.0), [(wait(2.0), True), (wait(40.0), True), (wait(41.0), False),
                                           (wait(80.0), False)])]
TIMED = {key for key, _, _ in GIVEN}


@pytest.mark.parametrize("key, broken, cases", GIVEN, ids=[g[0] for g in GIVEN])
def test_timed_labs_grade_the_figures_they_are_given(key, broken, cases):
    lab = labs.LABS[key]
    fix = lab.trial_for(labs.parse_fix(key, labs.reference_fix(key)))
    setup = Setup(fix.run, DEVICE)
    before = given(lab.trial, broken)
    for figures, passed in cases:
        grade = lab.grade_fix(before, given(fix, figures), setup)
        assert grade.passed == passed, (figures, grade)
    if key == LOADER_LAB:  # a fix whose run failed is not fixed, whatever it measured
        assert not lab.grade_fix(before, given(fix, wait(2.0), status="error"), setup).passed


def test_the_loader_fix_runs_the_loader_in_workers():
    from labkit.techniques import dataloading

    lab = labs.LABS[LOADER_LAB]
    assert lab.trial_for(labs.parse_fix(lab.key, lab.broken)).variant == "baseline"  # in-process
    trial = lab.trial_for(labs.parse_fix(lab.key, lab.solution))
    assert trial.variant in dataloading.WORKERS
    assert Setup(trial.run, DEVICE).cfg(trial.variant).num_workers == 2


def test_the_healthy_lab_made_worse_is_graded_not_fixed(lab_runs):
    worse = labs.apply_fix(HEALTHY_LAB, {"checkpointing": "full"}, device=DEVICE, runs_dir=lab_runs)
    assert not worse.passed and "reused" in worse.source


def test_a_knob_the_setup_lacks_is_measured_again_and_graded_not_fixed(lab_runs):
    out = labs.apply_fix(KV_LAB, {"scheduler": "continuous"}, device=DEVICE, runs_dir=lab_runs)
    assert not out.passed and "reused" in out.source, out.report()
    assert "nothing in this setup is set by scheduler" in out.report() and "Figure: FLOPs" in out.report()


def test_loss_scaling_does_not_fix_a_forward_overflow(lab_runs):
    """GradScaler multiplies the loss after the forward: every step is skipped, the loss stays nan."""
    out = labs.apply_fix(OVERFLOW_LAB, {"loss_scaling": True}, device=DEVICE, runs_dir=lab_runs)
    assert not out.passed and "GradScaler skipped 3" in out.grade.figure, out.report()


@pytest.mark.parametrize("key", list(labs.LABS))
def test_every_diagnosis_has_feedback_and_only_the_cause_is_right(key, lab_runs):
    lab = labs.LABS[key]
    for choice in labs.DIAGNOSES:
        text = lab.feedback_for(choice)
        assert text and "{" not in text
    plausible = [d for d in lab.feedback if d != lab.diagnosis]
    assert plausible and labs.HEALTHY in lab.feedback or lab.diagnosis == labs.HEALTHY
    wrong = plausible[0]
    out = labs.diagnose(key, wrong, device=DEVICE, runs_dir=lab_runs)
    assert not out.correct and out.feedback == lab.feedback[wrong]
    assert out.report().startswith(f"Diagnosis {wrong!r}: wrong")
    right = labs.diagnose(key, lab.diagnosis.upper(), device=DEVICE, runs_dir=lab_runs)
    assert right.correct and "Why: " in right.report()
    assert labs.diagnose(key, solution=True).diagnosis == lab.diagnosis


def test_bad_input_is_one_line_naming_the_valid():
    cases = [(lambda: labs.apply_fix(LOADER_LAB, {"workers": 2}),
              "valid knobs: checkpointing: 'none', 'full', 'selective'; micro_batches"),
             (lambda: labs.apply_fix(LOADER_LAB, {"num_workers": 8}), "valid: 0, 1, 2"),
             (lambda: labs.apply_fix(OOM_LAB, None), "valid knobs: checkpointing"),
             (lambda: labs.apply_fix(OOM_LAB, {"checkpointing": "full", "micro_batches": 4}),
              "change one knob at a time .* valid knobs: checkpointing, micro_batches"),
             (lambda: labs.diagnose(OOM_LAB, "gremlins"), "valid: out of memory"),
             (lambda: labs.symptoms("lab_nope"), "valid: " + ", ".join(labs.LABS))]
    for call, words in cases:
        with pytest.raises(ConfigError, match=words) as e:
            call()
        assert "\n" not in str(e.value)
    assert labs.parse_fix(UNDERFLOW_LAB, {"loss_scaling": "true"})["loss_scaling"] is True
    # a knob set at the broken setting is no change: one change beside it is still one
    assert labs.given_fix(OOM_LAB, {"checkpointing": "none", "micro_batches": 4}) == {
        "checkpointing": "none", "micro_batches": 4}


def test_attempts_are_stored_with_participant_and_team(lab_runs):
    labs.diagnose(PADDING_LAB, labs.HEALTHY, device=DEVICE, runs_dir=lab_runs, participant="ada", team="red")
    labs.apply_fix(PADDING_LAB, {"scheduler": "continuous"}, device=DEVICE, runs_dir=lab_runs,
                   participant="ada", team="red")
    table = exercises.load_attempts(lab_runs)
    mine = table[(table.participant == "ada") & (table.exercise == PADDING_LAB)]
    assert list(mine.kind) == ["diagnosis", "fix"] and list(mine.correct) == [False, True]
    assert set(mine.team) == {"red"} and all(mine.run_id) and mine.iloc[1].measured["figure"]
    assert mine.iloc[1].prediction == {"scheduler": "continuous"}


def test_widget_shows_the_knobs_after_the_diagnosis_and_grades_the_fix(lab_runs, capsys):
    pytest.importorskip("ipywidgets")
    panel = labs.widget(KV_LAB, device=DEVICE, runs_dir=lab_runs)
    (choice, ask), fix_row = panel.children[0].children, panel.children[1]
    knob, value, apply_ = fix_row.children
    assert fix_row.layout.display == "none" and list(knob.options) == list(labs.KNOBS)
    choice.value = labs.HEALTHY
    ask.click()
    assert fix_row.layout.display != "none"
    knob.value = "kv_cache"
    value.value = "dynamic"
    apply_.click()
    out = capsys.readouterr().out
    assert "wrong" in out and "graded fixed" in out


# --- what a CPU cannot show: said at the top, the formula graded, the H200 record's figure -------

GPU_DRILLS = {"tensor_core_shape": h200.matmul_words, "decode_bandwidth_bound": h200.copy_words,
              "int4_speedup_bound": h200.int4_words}


def test_what_a_cpu_cannot_show_is_said_at_the_top_with_the_h200_figure():
    """Exactly the GPU drills and the GEMM lab have a `cpu` text; on a CPU describe() / symptoms()
    start with it, graded on the formula, citing the H200 record's figure (where it has one)."""
    import nbformat

    assert {k for k, ex in exercises.EXERCISES.items() if ex.cpu} == set(GPU_DRILLS)
    assert {k for k, lab in labs.LABS.items() if lab.cpu} == {SHAPE_LAB}
    assert all(exercises.get(k).graded_against == "formula" for k in GPU_DRILLS)
    tops = {k: exercises.describe(k, DEVICE) for k in GPU_DRILLS}
    tops[SHAPE_LAB] = labs.symptoms(SHAPE_LAB, DEVICE)
    figures = {**{k: f() for k, f in GPU_DRILLS.items()}, SHAPE_LAB: h200.matmul_words()}
    for key, top in tops.items():
        assert top.startswith("On this machine, which has no GPU: ") and figures[key] in top, key
        assert "formula" in top.split("\n\n")[0], key
    measured = h200.check("matmul", "bf16 matmul TFLOP/s")["measured"]
    assert exercises.show(measured, "TFLOP/s") in figures[SHAPE_LAB]
    for key in (*GPU_DRILLS, SHAPE_LAB):
        intro = nbformat.read(lab_path(key) if key in labs.LABS else
                              next(ROOT.glob(f"[0-9][0-9]_{key}.ipynb")), as_version=4).cells[0].source
        assert "**What a CPU cannot show.**" in intro, key


def test_lab_shape_grades_the_formula_on_a_cpu_and_the_rate_on_a_gpu(monkeypatch):
    lab = labs.LABS[SHAPE_LAB]
    fix, setup = lab.trial_for(labs.parse_fix(lab.key, lab.solution)), Setup(lab.trial.run, DEVICE)
    rate = lambda tflops: {("tflops", 0): tflops}  # noqa: E731
    before = given(lab.trial, rate(100.0))
    cpu = lab.grade_fix(before, given(fix, rate(50.0)), setup)  # a CPU's rate is not graded
    assert cpu.passed and "formula" in cpu.margin and h200.matmul_words() in cpu.figure
    assert not lab.grade_fix(before, given(lab.trial, rate(100.0)), setup).passed
    monkeypatch.setattr(labs, "on_gpu", lambda device: True)
    assert lab.grade_fix(before, given(fix, rate(150.0)), setup).passed
    assert not lab.grade_fix(before, given(fix, rate(100.0)), setup).passed  # within the margin
    assert not lab.grade_fix(before, given(lab.trial, rate(150.0)), setup).passed  # still unaligned


@pytest.fixture(scope="module")
def lab_notebooks(lab_runs, notebook_kernel, tmp_path_factory):
    """On one warm kernel: a lab played through (OVERFLOW_LAB: a wrong diagnosis, the right one,
    the reference fix), then every lab notebook in solution mode; {"played" or key: its text}."""
    pytest.importorskip("papermill")
    folder = tmp_path_factory.mktemp("lab-notebooks")
    played = (lab_path(OVERFLOW_LAB), folder / "played.ipynb", {
        "diagnosis": [labs.DIAGNOSES[3], labs.LABS[OVERFLOW_LAB].diagnosis],
        "fix": labs.reference_fix(OVERFLOW_LAB), "interactive": False, "device": DEVICE, "runs_dir": lab_runs})
    params = {"solution": True, "interactive": False, "device": DEVICE, "runs_dir": lab_runs}
    jobs = [played] + [(lab_path(k), folder / f"{k}.ipynb", params) for k in labs.LABS]
    return dict(zip(["played", *labs.LABS], execute_notebooks(notebook_kernel, jobs)))


@pytest.mark.notebook
def test_a_lab_played_through_in_a_notebook(lab_notebooks, lab_runs):
    """Symptoms, evidence, a wrong diagnosis and its feedback, the right one, the knobs after it,
    the reference fix applied and the re-measurement that grades it."""
    key, lab = OVERFLOW_LAB, labs.LABS[OVERFLOW_LAB]
    wrong = labs.DIAGNOSES[3]
    text = lab_notebooks["played"]
    assert lab.symptoms in text and "Evidence (" in text and "inf/nan" in text
    assert f"Diagnosis {wrong!r}: wrong" in text and lab.feedback[wrong] in text
    assert f"Diagnosis {lab.diagnosis!r}: correct" in text
    assert text.index("Evidence (") < text.index("Fix knobs") < text.index("graded fixed")
    assert "steps with an inf/nan loss: 3 before, 0 after" in text
    played = exercises.load_attempts(lab_runs)
    assert {"diagnosis", "fix"} <= set(played[played.exercise == key].kind)


@pytest.mark.notebook
def test_every_lab_notebook_in_solution_mode(lab_notebooks):
    for key in labs.LABS:
        text = lab_notebooks[key]
        verdict = "graded " if key in TIMED else "graded fixed"  # TIMED: a verdict, whichever
        assert "Solution mode: the reference diagnosis" in text and ": correct." in text, (key, text[-1500:])
        assert "Solution mode: the reference fix" in text and verdict in text, (key, text[-1500:])


def test_lab_notebooks_committed_clean_with_one_parameters_cell():
    import nbformat

    for key in labs.LABS:
        nb = nbformat.read(lab_path(key), as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1 and "diagnosis = None  #" in tagged[0].source
        assert "fix = None  #" in tagged[0].source and "solution = False  #" in tagged[0].source
        assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), key
