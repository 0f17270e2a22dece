"""What every exercise rests on: references for a GPU computed without one (a simulated device's
datasheet ceilings and GPU implementations), hints before answers, attempts stored like runs, and
the words of every exercise and lab in notebooks/exercises/text/ (one file per key, the format's
sections, every placeholder filled by labkit)."""
import string

import pytest
import torch

from labkit import hardware
from labkit.config import ConfigError
from labkit.study.exercises import (DIAGNOSES, EXERCISES, LABS, RUNS, Rows, Setup, attempts, check,
                                    describe, get, hint, measure, text)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU answers for itself")
def test_a_simulated_gpu_answers_with_its_datasheet_only_inside_the_block():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        hardware.ceilings("cuda")
    with hardware.simulated_gpu("NVIDIA H200"):
        ceil = hardware.ceilings("cuda")
    spec = hardware.gpu_spec("NVIDIA H200")
    assert ceil.bandwidth_gbps == spec["bandwidth_gbps"] and not ceil.measured
    assert ceil.peak_tflops["bfloat16"] == spec["peak_tflops"]["bfloat16"]
    assert ceil.memory_bytes == int(spec["memory_gib"] * 2**30)
    with pytest.raises(ValueError, match="not in data/gpus.json"):
        with hardware.simulated_gpu("Imaginary GPU 9000"):
            pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="a real GPU answers for itself")
def test_a_setup_for_cuda_uses_the_gpus_optimizer_and_is_never_measured():
    from labkit import planner

    cpu, gpu = Setup(RUNS["mp"], "cpu"), Setup(RUNS["mp"], "cuda")
    assert gpu.simulated and gpu.device == "cuda" and not cpu.simulated
    psi = planner.num_params(cpu.cfg().model)
    with gpu.formulas():
        extra = gpu.expected("fp32")["peak_mem_bytes"] - cpu.expected("fp32")["peak_mem_bytes"]
    # torch's CPU AdamW loops over parameters (two temporaries of the largest tensor); CUDA's
    # foreach AdamW copies every moment v (4 bytes x psi): more, by less than the whole copy.
    assert 0 < extra < 4 * psi
    with pytest.raises(ConfigError, match="not present here"):
        measure(RUNS["mp"], "cuda")
    pinned = Setup(RUNS["zero"], "cuda")  # a run that pins its device keeps it
    assert not pinned.simulated and pinned.device == "cpu"


def test_describe_names_the_level_and_the_hint_does_not_give_the_answer():
    key = next(iter(EXERCISES))
    ex = get(key)
    assert describe(key, "cpu").startswith(f"Level {ex.level} ")
    assert hint(key).startswith("Hint: ") and len(hint(key)) > len("Hint: ")


@pytest.mark.slow
def test_an_attempt_is_stored_with_its_person_team_and_verdict(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PARTICIPANT", "ana")
    runs = str(tmp_path / "runs")
    key = "bf16_param_bytes"  # one single-process run (the mixed-precision step)
    wrong = check(key, 1.0, device="cpu", runs_dir=runs, team="blue")
    right = check(key, solution=True, device="cpu", runs_dir=runs)  # an answer key: not an attempt
    table = attempts.load_attempts(runs)
    assert len(table) == 1 and not right.mistake
    row = table.iloc[0]
    assert (row["exercise"], row["participant"], row["team"], bool(row["correct"])) == (key, "ana", "blue", False)
    assert row["reference"] == pytest.approx(wrong.reference) and row["run_id"] == wrong.run_id
    assert row["kind"] == "exercise" and row["level"] == get(key).level and row["measured"]
    # The attempts folder sits inside the runs folder but never reads as a run.
    from labkit.results import load_runs

    assert all(r["experiment"] == "mixed_precision" for r in load_runs(runs))


def test_a_bad_name_is_refused_in_one_line_and_an_empty_store_is_an_empty_table(tmp_path):
    with pytest.raises(ConfigError, match="not a valid name"):
        attempts.who("ana/../../etc")
    assert attempts.load_attempts(tmp_path).empty
    assert list(attempts.load_attempts(tmp_path).columns) == list(attempts.COLUMNS)


def test_attempts_stored_under_a_labs_old_key_count_under_its_new_one(tmp_path):
    """Every old lab key (they named the cause) maps to a lab there is now, none of them still a
    key or a text file; an attempt stored under an old key and one under the new key are one
    exercise's two attempts in the table and on the leaderboard."""
    from labkit.study import leaderboard

    assert set(attempts.RENAMED.values()) == set(LABS) and not set(attempts.RENAMED) & set(LABS)
    assert not any((text.TEXT_DIR / f"{old}.md").exists() for old in attempts.RENAMED)
    new = attempts.RENAMED["lab_healthy"]
    for i, key in enumerate(("lab_healthy", new)):
        attempts.record_attempt(kind="diagnosis", exercise=key, topic="lab", level=LABS[new].level,
                                prediction=DIAGNOSES[0], reference=LABS[new].diagnosis, correct=bool(i),
                                measured={}, device="cpu", run_id=None, folder=tmp_path, participant="ana")
    table = attempts.load_attempts(tmp_path)
    assert list(table.exercise) == [new, new]
    hardest = leaderboard.hardest_exercises(table)
    assert list(hardest.exercise) == [new] and list(hardest.attempts) == [2]


def test_exercise_numbers_use_the_one_number_formatter():
    from labkit.study.exercises.core import show
    from labkit.results import format_number
    for x in (0.0, 12345.0, 1234567.0, 0.0001234, 60.03, float("inf")):
        assert show(x, "bytes") == f"{format_number(x)} bytes"
    assert show(12345.0) == "12,345" and show(None) == "none" and show("x") == "'x'"


class AnyRows(Rows):
    """Measured rows that answer 1.0 for every metric (a status-ok row without one): enough for an
    exercise's evidence to name its keys without measuring."""

    def __init__(self):
        super().__init__([], "no measurement", None)

    def get(self, variant, metric=None, *, rank=0, **point):
        return 1.0 if metric else {"variant": variant, "status": "ok", "message": "", "value": 1.0}


def placeholders(template: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}


def test_every_exercise_and_lab_has_one_text_file_and_every_file_one_key():
    files = sorted(p.stem for p in text.TEXT_DIR.iterdir())
    assert all(p.suffix == ".md" for p in text.TEXT_DIR.iterdir())
    assert files == sorted([*EXERCISES, *LABS])


def test_every_text_has_the_sections_its_format_requires_and_no_other():
    """The loader refuses unknown or repeated sections; here each file has exactly its kind's."""
    for key, ex in EXERCISES.items():
        want = {"title", "scenario", "question", "hint", "why", *(["mistake_why"] if ex.mistake else []),
                *(f"{text.FEEDBACK}{c}" for c in ex.choices), *(["cpu"] if ex.cpu else [])}
        assert set(text.sections(key)) == want, key
    for key, lab in LABS.items():
        named = set(text.sections(key)) - {"title", "symptoms", "hint", "why", "cpu"}
        assert {n[len(text.FEEDBACK):] for n in named} <= set(DIAGNOSES), key
        assert f"{text.FEEDBACK}{lab.diagnosis}" in named, key
        assert all(n.startswith(text.FEEDBACK) for n in named), key
        assert {"title", "symptoms", "hint", "why"} <= set(text.sections(key)), key


@pytest.mark.parametrize("key", list(EXERCISES))
def test_every_placeholder_of_an_exercise_is_filled_by_labkit(key):
    """Every section formatted at the exercise's default setup on the CPU (the why with its
    evidence, answer and prediction): a placeholder nothing supplies is a KeyError, and every
    `words` entry is used and never shadows an evidence key."""
    ex = get(key)
    setup = Setup(RUNS[ex.run], "cpu")
    with setup.formulas():
        values = {**ex.evidence(AnyRows(), setup), "answer": "A", "prediction": "P"}
    assert not set(ex.words) & set(values), key
    why = ex.why.format(**values)
    said = [ex.title, ex.scenario, ex.question, ex.hint, why, *ex.feedback.values(), *filter(None, [ex.cpu])]
    said += [ex.mistake_why] if ex.mistake else []
    assert all(s and "{" not in s and "}" not in s for s in said), key
    used = set().union(*(placeholders(t) for t in text.sections(key).values()))
    assert set(ex.words) <= used, f"{key}: words no text uses: {set(ex.words) - used}"


def test_every_placeholder_of_a_lab_is_filled_by_labkit():
    for key, lab in LABS.items():
        said = [lab.title, lab.symptoms, lab.hint, lab.why, *lab.feedback.values(), *filter(None, [lab.cpu])]
        assert all(s and "{" not in s and "}" not in s for s in said), key
        used = set().union(*(placeholders(t) for t in text.sections(key).values()))
        assert set(lab.words) <= used, key


@pytest.mark.parametrize("content, error", [
    ("Hello\n\n## title\n\nA", "text before its first"),
    ("## title\n\nA\n\n## scenery\n\nB", "unknown section 'scenery'"),
    ("## title\n\nA\n\n## title\n\nB", "section 'title' twice"),
])
def test_the_text_format_is_strict(content, error, tmp_path, monkeypatch):
    (tmp_path / "odd.md").write_text(content)
    monkeypatch.setattr(text, "TEXT_DIR", tmp_path)
    text.sections.cache_clear()
    try:
        with pytest.raises(ValueError, match=error):
            text.sections("odd")
    finally:
        text.sections.cache_clear()


def test_a_section_is_its_text_without_the_surrounding_blank_lines(tmp_path, monkeypatch):
    (tmp_path / "ok.md").write_text("\n## title\n\nOne {n:,}\n\n\n## feedback: a: b\n\nTwo\nlines\n")
    monkeypatch.setattr(text, "TEXT_DIR", tmp_path)
    text.sections.cache_clear()
    try:
        assert text.sections("ok") == {"title": "One {n:,}", "feedback: a: b": "Two\nlines"}
    finally:
        text.sections.cache_clear()
