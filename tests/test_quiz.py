"""The question bank, the validator, drawing, scoring, the progress file (with several processes
recording at once) and the quiz widget driven headless through its button handlers."""
import copy
import html
import json
import multiprocessing
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from labkit import quiz
from labkit.config import ConfigError
from labkit.quiz import MAIN_TOPICS, TOPICS, Question, Score

REPO = Path(__file__).resolve().parents[1]
GOOD = {"id": "t-1", "topic": "memory", "question": "How many bytes?", "choices": ["8", "12", "16"],
        "answer": 2, "explanation": "4 + 4 + 8.", "notebook": "notebooks/01_mixed_precision.ipynb"}


def raw_bank() -> list[dict]:
    return json.loads((REPO / "data" / "questions.json").read_text(encoding="utf-8"))["questions"]


def make(qid: str, topic: str = "memory", answer: int = 0) -> Question:
    return Question(id=qid, topic=topic, question="?", choices=("a", "b", "c"), answer=answer,
                    explanation="why", notebook="notebooks/11_zero.ipynb")


# --- The bank ---------------------------------------------------------------------------------------

def test_the_bank_validates_and_covers_every_main_topic():
    bank = quiz.load_bank()
    assert len(bank) >= 60 and len({q.id for q in bank}) == len(bank)
    per_topic = Counter(q.topic for q in bank)
    assert all(per_topic[t] >= 8 for t in MAIN_TOPICS), per_topic
    # checked here directly too, not only through the validator
    for raw in raw_bank():
        assert isinstance(raw["answer"], int) and 0 <= raw["answer"] < len(raw["choices"]), raw["id"]
        assert len(set(raw["choices"])) == len(raw["choices"]) >= 2, raw["id"]
        assert raw["explanation"].strip() and raw["question"].strip() and raw["topic"] in TOPICS
        assert (REPO / raw["notebook"]).is_file(), raw["notebook"]


def test_answers_are_spread_over_the_positions():
    """A bank whose answer is nearly always B teaches the letter, not the topic."""
    positions = Counter(q.answer for q in quiz.load_bank())
    assert max(positions.values()) <= 0.5 * sum(positions.values()), positions


BAD = [
    ({"answer": 3}, "answer 3 is out of range; valid: 0..2"),
    ({"answer": -1}, "out of range"),
    ({"answer": [0, 2]}, "exactly one choice index"),
    ({"answer": True}, "exactly one choice index"),
    ({"choices": ["8", "16", "16"]}, "two choices are the same"),
    ({"choices": ["16"], "answer": 0}, "at least 2 options"),
    ({"explanation": ""}, "missing explanation"),
    ({"explanation": None}, "missing explanation"),
    ({"topic": "cooking"}, "unknown topic 'cooking'; valid: memory, parallelism"),
    ({"topic": None}, "missing topic"),
    ({"notebook": "notebooks/98_missing.ipynb"}, "does not exist"),
    ({"notebook": "README.md"}, "must be a notebooks/*.ipynb path"),
    ({"hint": "x"}, "unknown field 'hint'"),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m for _, m in BAD])
def test_the_validator_names_the_question_and_the_problem(change, message):
    bad = {**GOOD, **change}
    with pytest.raises(ConfigError, match="question 't-1'") as e:
        quiz.check_bank({"questions": [GOOD | {"id": "t-0"}, bad]}, REPO)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_validator_refuses_duplicate_ids_and_a_malformed_file(tmp_path):
    with pytest.raises(ConfigError, match="question 't-1': duplicate id"):
        quiz.check_bank({"questions": [GOOD, copy.deepcopy(GOOD)]}, REPO)
    missing = {k: v for k, v in GOOD.items() if k != "explanation"}
    with pytest.raises(ConfigError, match="missing explanation"):
        quiz.check_bank({"questions": [missing]}, REPO)
    path = tmp_path / "bank.json"
    path.write_text("[1, 2")
    with pytest.raises(ConfigError, match="cannot read the question bank"):
        quiz.load_bank(path)
    path.write_text("[]")
    with pytest.raises(ConfigError, match='"questions"'):
        quiz.load_bank(path)


# --- Drawing and scoring ------------------------------------------------------------------------

def test_draw_by_topic_is_reproducible_with_a_seed():
    bank = quiz.load_bank()
    drawn = quiz.draw("inference", 5, seed=7, bank=bank)
    assert len(drawn) == 5 and {q.topic for q in drawn} == {"inference"}
    assert [q.id for q in quiz.draw("inference", 5, seed=7, bank=bank)] == [q.id for q in drawn]
    everything = quiz.draw(None, 20, seed=1, bank=bank)
    assert len({q.id for q in everything}) == 20 and len({q.topic for q in everything}) > 1
    assert [q.id for q in quiz.draw("all", 20, seed=2, bank=bank)] != [q.id for q in everything]
    # more asked than there are: every question of the topic, once
    small = [make("a"), make("b"), make("c", topic="profiling")]
    assert sorted(q.id for q in quiz.draw("memory", 10, seed=0, bank=small)) == ["a", "b"]
    with pytest.raises(ConfigError, match="unknown topic 'kernels'; valid: all, memory"):
        quiz.draw("kernels", bank=bank)
    with pytest.raises(ConfigError, match="positive integer"):
        quiz.draw("memory", 0, bank=bank)


def test_scoring_counts_only_answered_questions():
    qs = [make("a", answer=0), make("b", answer=1), make("c", answer=2), make("d")]
    s = quiz.score(qs, {"a": 0, "b": 1, "c": 0, "d": None})
    assert (s.answered, s.correct, s.percent) == (3, 2, 66.7)
    assert s.line() == "score: 2 of 3 correct (66.7%)"
    assert Score(0, 0).percent is None and quiz.score(qs, {}).line() == "score: 0 of 0 correct"


# --- Progress -----------------------------------------------------------------------------------

def test_progress_summary_per_topic_and_in_total(tmp_path):
    path = tmp_path / "progress.json"
    answers = [(make("a", "memory", 0), 0), (make("b", "memory", 1), 0), (make("c", "memory", 2), 2),
               (make("d", "inference", 0), 1), (make("a", "memory", 0), 0)]
    assert [quiz.record_answer(q, pick, path) for q, pick in answers] == [True, False, True, False, True]
    table = quiz.progress_summary(path).set_index("topic")
    assert list(table.loc["memory", ["answered", "correct", "percent"]]) == [4, 3, 75.0]
    assert list(table.loc["inference", ["answered", "correct", "percent"]]) == [1, 0, 0.0]
    assert table.loc["parallelism", "answered"] == 0 and pd.isna(table.loc["parallelism", "percent"])
    assert list(table.loc["total", ["answered", "correct", "percent"]]) == [5, 3, 60.0]
    assert set(table.index) == {*TOPICS, "total"}
    assert quiz.load_progress(path)["questions"]["a"] == {"answered": 2, "correct": 2}
    assert not list(tmp_path.glob(".*.tmp"))  # the atomic write left no temporary behind


def test_the_progress_path_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_QUIZ_PROGRESS", str(tmp_path / "mine.json"))
    quiz.record_answer(make("a"), 0)
    assert quiz.progress_summary().set_index("topic").loc["memory", "answered"] == 1
    assert (tmp_path / "mine.json").is_file() and quiz.progress_path("x.json") == Path("x.json")
    for broken in ("{half", "[1, 2]"):
        (tmp_path / "mine.json").write_text(broken)
        with pytest.raises(ConfigError, match="not a progress record; delete it"):
            quiz.load_progress()


def _record_many(path: str, worker: int, count: int) -> None:
    for i in range(count):
        quiz.record_answer(make(f"w{worker}-{i}", answer=i % 2), 0, path)


def test_several_processes_record_at_once_without_losing_an_answer(tmp_path):
    path, workers, count = str(tmp_path / "progress.json"), 4, 25
    ctx = multiprocessing.get_context("fork")  # torch is already imported: no second import
    procs = [ctx.Process(target=_record_many, args=(path, w, count)) for w in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * workers
    data = quiz.load_progress(path)
    assert data["topics"]["memory"] == {"answered": workers * count, "correct": workers * 13}
    assert len(data["questions"]) == workers * count


# --- The widget, headless -----------------------------------------------------------------------

def test_the_quiz_widget_grades_right_and_wrong_and_explains(tmp_path):
    W = pytest.importorskip("ipywidgets")
    progress = tmp_path / "progress.json"
    panel = quiz.QuizPanel("parallelism", n=2, seed=3, progress=progress)
    assert isinstance(panel.box, W.VBox) and len(panel.questions) == 2
    first = panel.current
    assert first.topic == "parallelism" and "Question 1 of 2" in panel.question.value
    assert [label for label, _ in panel.choices.options] == list(first.choices)
    assert panel.choices.value is None and panel.next_button.disabled

    panel.submit_button.click()  # nothing picked: asks for an answer, records nothing
    assert "Pick an answer" in panel.feedback.value and not progress.exists()

    panel.choices.value = (first.answer + 1) % len(first.choices)
    panel.submit_button.click()
    assert "Wrong." in panel.feedback.value and first.choices[first.answer] in panel.feedback.value
    assert html.escape(first.explanation, quote=False) in panel.feedback.value
    assert f"href='{Path(first.notebook).name}'" in panel.feedback.value
    assert panel.submit_button.disabled and not panel.next_button.disabled
    assert panel.score_line.value == "score: 0 of 1 correct (0%)"

    panel.next_button.click()
    second = panel.current
    assert second.id != first.id and panel.feedback.value == "" and panel.choices.value is None
    panel.choices.value = second.answer
    panel.submit_button.click()
    assert "Right." in panel.feedback.value and panel.next_button.description == "New quiz"
    assert panel.score_line.value.startswith("score: 1 of 2 correct (50%)")
    assert quiz.progress_summary(progress).set_index("topic").loc["parallelism", "answered"] == 2
    assert "Parallelism techniques" in panel.table.value

    panel.next_button.click()  # after the last question: a new quiz, the score starts again
    assert panel.position == 0 and panel.score_line.value == "score: 0 of 0 correct"
    panel.topic.value = "inference"
    assert {q.topic for q in panel.questions} == {"inference"}


def test_quiz_panel_refuses_an_unknown_topic(tmp_path):
    W = pytest.importorskip("ipywidgets")
    with pytest.raises(ConfigError, match="unknown topic 'gpus'; valid: all, memory"):
        quiz.quiz_panel("gpus", progress=tmp_path / "p.json")
    assert isinstance(quiz.quiz_panel(n=3, progress=tmp_path / "p.json"), W.VBox)
