"""The question bank, the validator, drawing (shuffled choices, review order, the mock exam's topic
counts and clock), scoring, the progress file (with several processes recording at once), the bank's
fairness statistics and the quiz widget driven headless through its button handlers."""
import copy
import html
import json
import multiprocessing
import random
from collections import Counter
from pathlib import Path

import pandas as pd
import pytest

from labkit.study import quiz
from labkit.config import ConfigError
from labkit.study.quiz import MAIN_TOPICS, TOPICS, Question, Score

REPO = Path(__file__).resolve().parents[1]
GOOD = {"id": "t-1", "topic": "memory", "question": "How many bytes?", "choices": ["8", "12", "16"],
        "answer": 2, "explanation": "4 + 4 + 8.", "feedback": ["too few", "one moment", "right"],
        "notebook": "notebooks/01_mixed_precision.ipynb"}


def raw_bank() -> list[dict]:
    return json.loads((REPO / "data" / "questions.json").read_text(encoding="utf-8"))["questions"]


def make(qid: str, topic: str = "memory", answer: int = 0) -> Question:
    return Question(id=qid, topic=topic, question="?", choices=("a", "b", "c"), answer=answer,
                    explanation="why", feedback=("fa", "fb", "fc"), notebook="notebooks/11_zero.ipynb")


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
        assert len(raw["feedback"]) == len(raw["choices"]) and all(f.strip() for f in raw["feedback"])


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
    ({"feedback": None}, "missing feedback (a list with one text per choice)"),
    ({"feedback": ["a", "b"]}, "one text per choice (3 choices, got 2)"),
    ({"feedback": "right"}, "one text per choice (3 choices, got str)"),
    ({"feedback": ["a", " ", "c"]}, "every feedback must be non-empty text"),
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
    # per question: counts plus what review needs (the last verdict and when, as the answer's number)
    assert quiz.load_progress(path)["questions"]["a"] == {"answered": 2, "correct": 2,
                                                          "last_correct": True, "last_seen": 5}
    assert quiz.load_progress(path)["questions"]["b"]["last_correct"] is False
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

    wrong = (first.answer + 1) % len(first.choices)
    panel.choices.value = wrong
    panel.submit_button.click()
    shown = panel.feedback.value
    assert "Wrong." in shown and first.choices[first.answer] in shown
    # the picked choice's feedback, the right one's, the explanation; no other choice's feedback
    for text in (first.feedback[wrong], first.feedback[first.answer], first.explanation):
        assert html.escape(text, quote=False) in shown
    others = set(range(len(first.choices))) - {wrong, first.answer}
    assert not any(html.escape(first.feedback[i], quote=False) in shown for i in others)
    assert f"href='{Path(first.notebook).name}'" in panel.feedback.value
    assert panel.submit_button.disabled and not panel.next_button.disabled
    assert panel.score_line.value == "score: 0 of 1 correct (0%)"

    panel.next_button.click()
    second = panel.current
    assert second.id != first.id and panel.feedback.value == "" and panel.choices.value is None
    panel.choices.value = second.answer
    panel.submit_button.click()
    assert "Right." in panel.feedback.value and panel.next_button.description == "New quiz"
    assert html.escape(second.feedback[second.answer], quote=False) in panel.feedback.value
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


# --- Shuffling at draw time -----------------------------------------------------------------------

def test_draw_shuffles_choices_reproducibly_and_keeps_the_answer_text():
    bank = quiz.load_bank()
    stored = {q.id: q for q in bank}
    before = (REPO / "data" / "questions.json").read_bytes()
    drawn = quiz.draw("all", 30, seed=11, bank=bank)
    again = quiz.draw("all", 30, seed=11, bank=bank)
    assert [(q.id, q.choices, q.answer) for q in drawn] == [(q.id, q.choices, q.answer) for q in again]
    other = quiz.draw("all", 30, seed=12, bank=bank)
    assert [(q.id, q.choices) for q in other] != [(q.id, q.choices) for q in drawn]
    for q in drawn:
        s = stored[q.id]
        assert sorted(q.choices) == sorted(s.choices) and q.choices[q.answer] == s.choices[s.answer]
        # each choice keeps its own feedback
        assert dict(zip(q.choices, q.feedback)) == dict(zip(s.choices, s.feedback))
    assert any(q.choices != stored[q.id].choices for q in drawn)  # something did move
    assert (REPO / "data" / "questions.json").read_bytes() == before  # the file is never rewritten


def test_scoring_uses_the_drawn_order_not_the_stored_one(tmp_path):
    q = make("a", answer=0)
    moved = next(m for m in (q.shuffled(random.Random(seed)) for seed in range(50)) if m.answer != q.answer)
    assert quiz.score([moved], {"a": moved.answer}).correct == 1
    assert quiz.score([moved], {"a": q.answer}).correct == 0
    assert quiz.record_answer(moved, moved.answer, tmp_path / "p.json")
    assert quiz.load_progress(tmp_path / "p.json")["questions"]["a"]["correct"] == 1


def test_answer_positions_after_shuffling_are_near_uniform_over_the_bank():
    """Pooled over 10 seeded shuffles of the whole bank; the band follows from the choice count."""
    bank = quiz.load_bank()
    num_choices = Counter(len(q.choices) for q in bank).most_common(1)[0][0]
    share = 1 / num_choices
    positions = Counter()
    for seed in range(10):
        positions.update(quiz.bank_stats(bank, seed)["answer_positions"])
    total = sum(positions.values())
    for p in range(num_choices):
        assert 0.6 * share <= positions[p] / total <= 1.4 * share, positions  # 15%-35% for 4


def test_the_longest_choice_is_rarely_the_answer():
    bank = quiz.load_bank()
    stats = quiz.bank_stats(bank)
    assert stats["longest_is_answer_share"] <= 0.35, stats["longest_answer_offenders"]
    # in every topic and every family of ids too (issue 30): new questions must not bring it back
    for group in ("longest_by_topic", "longest_by_prefix"):
        assert {k: v for k, v in stats[group].items() if v > 0.35} == {}, group
    assert stats["num_questions"] == len(bank) and sum(stats["by_topic"].values()) == len(bank)
    assert set(stats["by_topic"]) == set(TOPICS) and sum(stats["answer_positions"].values()) == len(bank)


def test_no_rank_of_four_numeric_choices_is_the_answer_too_often():
    """A guesser who picks the middle numbers must not win (issue 30's goal: each rank 15-35%)."""
    ranks = quiz.bank_stats()["numeric_answer_ranks"]
    total = sum(ranks.values())
    assert total >= 40 and all(0.15 <= c / total <= 0.35 for c in ranks.values()), ranks


def test_a_hedging_choice_is_sometimes_the_answer():
    """"Both...", "Neither...", "None..." choices: never the answer is a cue (issue 30: 15-35%)."""
    hedged, answered = quiz.bank_stats()["hedge"]
    assert 0.15 <= answered / hedged <= 0.35, (answered, hedged)


def test_the_cue_statistics_parse_numbers_units_and_hedges():
    def q(choices, answer, qid="x-01"):
        return quiz.Question(id=qid, topic="memory", question="?", choices=tuple(choices), answer=answer,
                             explanation="", feedback=tuple("f" for _ in choices), notebook="")
    assert quiz.numeric_values(q(["1 GiB", "512 MiB", "2 GiB", "3,072 MiB"], 0)) == [2**30, 2**29, 2**31, 3 * 2**30]
    assert quiz.numeric_values(q(["1 GB", "2 requests/s", "3", "4"], 0)) is None  # units differ
    assert quiz.numeric_answer_ranks([q(["4", "1", "3", "2"], 0), q(["4", "1", "3", "2"], 3)]) == {3: 1, 1: 1}
    assert quiz.hedge_counts([q(["Both a and b", "a", "b", "c"], 0), q(["a", "None of these", "b", "c"], 0),
                              q(["a", "b", "c", "d"], 0)]) == (2, 1)
    assert quiz.id_prefix(q(["a", "b"], 0, "finetune-12")) == "finetune"
    assert quiz.longest_share_by([q(["aaaa", "b"], 0), q(["aaaa", "b"], 1)], quiz.id_prefix) == {"x": 0.5}


def test_longest_choice_hit_splits_ties():
    def q(choices, answer):
        return Question("x", "memory", "?", tuple(choices), answer, "why", tuple("f" * len(choices)),
                        "notebooks/11_zero.ipynb")
    assert quiz.longest_choice_hit(q(["aaaa", "b", "c"], 0)) == 1.0
    assert quiz.longest_choice_hit(q(["aaaa", "bbbb", "c"], 0)) == 0.5
    assert quiz.longest_choice_hit(q(["aaaa", "b", "c"], 1)) == 0.0
    assert quiz.longest_answer_offenders([q(["aaaa", "b"], 0), q(["aa", "bb"], 0)]) == ["x"]
    text = quiz.format_stats(quiz.bank_stats([q(["aaaa", "b"], 0)], seed=0))
    assert "not the whole exam" in text and "100% of questions" in text


def test_the_stats_command_prints_the_statistics(capsys):
    assert quiz.main(["--stats", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "answer positions after one seeded shuffle" in out and "longest choice is the answer" in out


# --- Review -----------------------------------------------------------------------------------

def test_review_puts_wrong_answers_first_then_unseen_then_the_rest(tmp_path):
    path = tmp_path / "p.json"
    bank = [make(x) for x in "abcdef"]
    for qid, pick in [("a", 1), ("b", 0), ("c", 1), ("a", 0), ("d", 1)]:  # a: wrong, then right
        quiz.record_answer(make(qid), pick, path)
    order = [q.id for q in quiz.review(6, progress=path, bank=bank, seed=0)]
    assert order[:2] == ["c", "d"]  # last answered wrong, longest ago first
    assert sorted(order[2:4]) == ["e", "f"]  # unseen
    assert order[4:] == ["b", "a"]  # last answered right, longest ago first
    assert [q.id for q in quiz.draw(None, 3, 0, bank, order="review", progress=path)] == order[:3]
    with pytest.raises(ConfigError, match="unknown order 'oldest'; valid: random, review"):
        quiz.draw(None, 3, bank=bank, order="oldest")


def test_review_reads_an_old_progress_file_with_counts_only(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"topics": {"memory": {"answered": 3, "correct": 2}},
                                "questions": {"a": {"answered": 2, "correct": 2},
                                              "b": {"answered": 1, "correct": 0}}}))
    order = [q.id for q in quiz.review(3, progress=path, bank=[make("a"), make("b"), make("c")])]
    assert order == ["b", "c", "a"]  # ever wrong counts as wrong
    quiz.record_answer(make("c"), 0, path)
    data = quiz.load_progress(path)
    assert data["num_answers"] == 4 and data["questions"]["c"]["last_seen"] == 4


# --- Mock exam --------------------------------------------------------------------------------

def test_largest_remainder_follows_the_formula():
    # quotas 10·3/8 = 3.75, 3.75, 2.5: floors 3, 3, 2, and the 2 seats left go to a and b
    assert quiz.largest_remainder(10, {"a": 3, "b": 3, "c": 2}) == {"a": 4, "b": 4, "c": 2}
    weights = quiz.TOPIC_WEIGHTS
    total = sum(weights.values())
    full = {t: 100 for t in weights}
    assert quiz.topic_counts(total, full) == dict(weights)  # n = Σw: exactly the weights
    for n in (7, 20, 45):
        counts = quiz.topic_counts(n, full)
        assert sum(counts.values()) == n
        assert all(abs(counts[t] - n * w / total) < 1 for t, w in weights.items()), counts


def test_topic_counts_skip_empty_topics_and_cap_short_ones():
    weights = {"a": 1, "b": 1, "c": 2}
    assert quiz.topic_counts(4, {"a": 5, "b": 0, "c": 5}, weights) == {"a": 1, "b": 0, "c": 3}
    # c has only 1: it gives that, and the remaining 5 split between a and b
    assert quiz.topic_counts(6, {"a": 5, "b": 5, "c": 1}, weights) == {"a": 3, "b": 2, "c": 1}
    with pytest.raises(ConfigError, match="more than the bank's 2 questions"):
        quiz.topic_counts(3, {"a": 1, "b": 1}, weights)


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_mock_exam_draws_by_weight_and_stops_counting_at_the_deadline():
    bank = quiz.load_bank()
    clock = FakeClock()
    exam = quiz.mock_exam(n=20, minutes=10, seed=5, bank=bank, clock=clock)
    expected = quiz.topic_counts(20, Counter(q.topic for q in bank))
    assert Counter(q.topic for q in exam.questions) == Counter({t: c for t, c in expected.items() if c})
    assert [q.id for q in quiz.mock_exam(20, 10, 5, bank, clock).questions] == [q.id for q in exam.questions]
    first, second, third = exam.questions[:3]
    assert exam.time_left_s() == 600 and exam.answer(first, first.answer)
    clock.now += 599
    assert exam.answer(second, (second.answer + 1) % len(second.choices))
    clock.now += 1  # the deadline
    assert exam.over and not exam.answer(third, third.answer) and exam.num_late == 1
    total = exam.result()[-1]
    assert (total["questions"], total["answered"], total["correct"], total["percent"]) == (20, 2, 1, 5.0)
    assert quiz.mock_exam(n=10, bank=bank, clock=clock).seconds == 10 * quiz.SECONDS_PER_QUESTION


def test_the_mock_panel_hides_feedback_and_times_out(tmp_path):
    pytest.importorskip("ipywidgets")
    clock = FakeClock()
    panel = quiz.QuizPanel(n=4, seed=2, progress=tmp_path / "p.json", mode="mock", minutes=1, clock=clock)
    assert len(panel.questions) == 4 and "time left: 1:00" in panel.timer.value
    q = panel.current
    panel.choices.value = q.answer
    panel.submit_button.click()
    assert "Answer saved" in panel.feedback.value and "Right." not in panel.feedback.value
    assert q.feedback[q.answer] not in panel.feedback.value
    panel.next_button.click()
    clock.now += 61  # past the deadline: this answer does not count
    panel.choices.value = panel.current.answer
    panel.submit_button.click()
    assert panel.finished and "not counted" in panel.timer.value
    assert panel.score_line.value == "exam score: 1 of 4 (25%)"
    result = panel.feedback.value
    assert "Result per topic" in result and html.escape(q.explanation, quote=False) in result
    assert html.escape(q.feedback[q.answer], quote=False) in result  # feedback at the end
    assert "Not answered" in result  # the late answer and the unseen questions
    assert quiz.progress_summary(tmp_path / "p.json").set_index("topic").loc["total", "answered"] == 1
    panel.next_button.click()  # a new exam
    assert not panel.finished and panel.position == 0


def test_the_mock_panel_ends_when_the_clock_ticks_past_the_deadline(tmp_path):
    pytest.importorskip("ipywidgets")
    clock = FakeClock()
    panel = quiz.QuizPanel(n=3, progress=tmp_path / "p.json", mode="mock", minutes=0.5, clock=clock)
    clock.now += 10
    panel.ticker.value += 1  # what the browser's Play widget does every second
    assert "time left: 0:20" in panel.timer.value and not panel.finished
    clock.now += 20
    panel.ticker.value += 1
    assert panel.finished and "Time is up." in panel.timer.value
    assert panel.score_line.value == "exam score: 0 of 3 (0%)"


def test_the_review_mode_of_the_panel_starts_with_the_wrong_answers(tmp_path):
    pytest.importorskip("ipywidgets")
    path = tmp_path / "p.json"
    bank = quiz.load_bank()
    wrong = next(q for q in bank if q.topic == "inference")
    quiz.record_answer(wrong, (wrong.answer + 1) % len(wrong.choices), path)
    panel = quiz.QuizPanel("inference", n=3, progress=path, mode="review", bank=bank)
    assert panel.current.id == wrong.id
    with pytest.raises(ConfigError, match="unknown mode 'exam'; valid: practice, review, mock"):
        quiz.QuizPanel(mode="exam", progress=path)
