"""The question bank and the quiz: multiple-choice questions on GPU acceleration and model
optimization for LLMs, drawn by topic (or for review, or as a timed mock exam), scored,
explained choice by choice, and linked to the notebook that measures the same thing.

Scope, honestly: the bank covers the GPU-acceleration and model-optimization part of the
NVIDIA-Certified Professional: Generative AI LLMs exam (NCP-GENL), not the whole exam (no
prompting, data preparation, evaluation or safety questions; fine-tuning only for its memory:
LoRA and QLoRA).

- The bank is `data/questions.json`: `{"questions": [{id, topic, question, choices, answer,
  explanation, feedback, notebook}, ...]}`: `answer` the index of the one correct choice in the
  stored order, `feedback` one text per choice (why it is right, or the misunderstanding it
  reflects), `topic` a key of `TOPICS`, `notebook` an existing `notebooks/*.ipynb` path.
  `load_bank` validates every question and refuses a bad one with one `ConfigError` line.
- `draw(topic, n, seed)` picks questions and shuffles each one's choices (feedback with them,
  `answer` remapped): the same seed gives the same questions in the same order with the same
  choice order, so a workshop can share one quiz. The file is never rewritten: the stored order
  is only the authoring order. `review(n)` draws the questions last answered wrong first, then
  the unseen ones, then the rest. `mock_exam(n, minutes)` draws by `TOPIC_WEIGHTS` under a clock.
- Scoring and progress key on the question id and use the drawn question's own `answer`.
- Progress lives in one small JSON file: `path`, else `$LABKIT_QUIZ_PROGRESS`, else
  `~/.labkit/quiz_progress.json` (not `runs/`: the results store reads every JSON there as a
  run). Each update holds an exclusive `fcntl` lock on a `.lock` file beside it, reads, adds and
  replaces the file atomically, so several sessions lose no answer.
- `quiz_panel(topic, n)` is the ipywidgets quiz (imported only when used). Its logic lives in
  `QuizPanel`, whose buttons tests click in code; its clock is injectable.
- `bank_stats()` / `python -m labkit.study.quiz --stats`: counts by topic, how often the longest choice
  is the answer, and the answer positions after a seeded shuffle.
"""
from __future__ import annotations

import argparse
import contextlib
import html
import json
import math
import os
import random
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from labkit.config import ConfigError, check_choice
from labkit.hardware import DATA_DIR
from labkit.results import write_json_atomic

# The topics, once: key -> title.
TOPICS = {
    "memory": "Memory and batch optimization",
    "parallelism": "Parallelism techniques",
    "distributed": "Multi-GPU and distributed setups",
    "profiling": "Performance profiling and troubleshooting",
    "inference": "Inference optimization (KV cache, batching)",
    "precision": "Mixed precision and kernels",
    "operations": "GPU monitoring and operations (NVML, MIG, NCCL settings)",
}
MAIN_TOPICS = ("memory", "parallelism", "distributed", "profiling", "inference")

# Mock-exam weights: each topic's share of the exam, in percent. Where they come from: the
# NCP-GENL blueprint on NVIDIA's exam page has ten topic areas; a study guide quoting it
# (lzwjava.github.io/nvidia-ncp-genl-overview-en) gives "GPU Acceleration and Optimization" 14%
# and "Model Optimization" 17%, other guides group the domains differently (one lists a single
# "Optimization & Acceleration" at 22%); we could not check NVIDIA's page itself. The bank covers
# only those two areas (plus a little of "Production Monitoring and Reliability" in
# `operations`), so these are OUR topics' shares, not the exam's whole: the blueprint does not
# split its areas further, so the split inside each area is ours (14 = 3 + 3 + 3 + 3 + 2 over
# memory, parallelism, distributed, profiling, operations; 17 = 9 + 8 over inference,
# precision). A mock exam draws n questions in these proportions (`topic_counts`).
TOPIC_WEIGHTS = {"memory": 3, "parallelism": 3, "distributed": 3, "profiling": 3, "operations": 2,
                 "inference": 9, "precision": 8}
EXAM_SCOPE = ("Scope: this bank covers GPU acceleration and model optimization (memory, parallelism, "
              "multi-GPU, profiling, inference, precision, GPU operations), the optimization areas of "
              "the NCP-GENL exam's blueprint, not the whole exam (no prompting, data preparation, "
              "evaluation or safety questions; fine-tuning only for its memory: LoRA and QLoRA).")
SECONDS_PER_QUESTION = 120  # the exam's pace: 120 minutes for its 60-70 questions, about 2 each
REPO_ROOT = DATA_DIR.parent
BANK_PATH = DATA_DIR / "questions.json"
FIELDS = ("id", "topic", "question", "choices", "answer", "explanation", "feedback", "notebook")
ORDERS = ("random", "review")


@dataclass(frozen=True)
class Question:
    id: str
    topic: str
    question: str
    choices: tuple[str, ...]
    answer: int  # index of the one correct choice in THIS question's choice order
    explanation: str
    feedback: tuple[str, ...]  # one text per choice, parallel to `choices`
    notebook: str  # path from the repository root, e.g. notebooks/11_zero.ipynb

    def is_correct(self, choice: int | None) -> bool:
        return choice == self.answer

    def shuffled(self, rng: random.Random) -> Question:
        """The same question with its choices (and their feedback) in a random order, `answer`
        pointing at the same text."""
        order = list(range(len(self.choices)))
        rng.shuffle(order)
        return replace(self, choices=tuple(self.choices[i] for i in order),
                       feedback=tuple(self.feedback[i] for i in order),
                       answer=order.index(self.answer))


# --- The bank -------------------------------------------------------------------------------------

def _text(name: str, value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}: missing {name}")
    return value


def _check_choices(choices: Any, answer: Any, where: str) -> None:
    if not isinstance(choices, list) or len(choices) < 2:
        raise ConfigError(f"{where}: choices must be a list of at least 2 options")
    if not all(isinstance(c, str) and c.strip() for c in choices):
        raise ConfigError(f"{where}: every choice must be non-empty text")
    if len({c.strip().lower() for c in choices}) < len(choices):
        raise ConfigError(f"{where}: two choices are the same text (exactly one may be correct)")
    if not isinstance(answer, int) or isinstance(answer, bool):
        raise ConfigError(f"{where}: answer must be exactly one choice index, got {answer!r}")
    if not 0 <= answer < len(choices):
        raise ConfigError(f"{where}: answer {answer} is out of range; valid: 0..{len(choices) - 1}")


def _check_feedback(feedback: Any, choices: list, where: str) -> tuple[str, ...]:
    if feedback is None:
        raise ConfigError(f"{where}: missing feedback (a list with one text per choice)")
    if not isinstance(feedback, list) or len(feedback) != len(choices):
        got = len(feedback) if isinstance(feedback, list) else type(feedback).__name__
        raise ConfigError(f"{where}: feedback must be a list with one text per choice "
                          f"({len(choices)} choices, got {got})")
    if not all(isinstance(f, str) and f.strip() for f in feedback):
        raise ConfigError(f"{where}: every feedback must be non-empty text")
    return tuple(feedback)


def _check_notebook(path: Any, where: str, root: Path) -> str:
    path = _text("notebook", path, where)
    if not path.startswith("notebooks/") or not path.endswith(".ipynb"):
        raise ConfigError(f"{where}: notebook {path!r} must be a notebooks/*.ipynb path")
    if not (root / path).is_file():
        raise ConfigError(f"{where}: notebook {path!r} does not exist")
    return path


def check_question(raw: Any, root: Path = REPO_ROOT) -> Question:
    """One validated question, or a ConfigError naming it and what is wrong."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a question must be an object with {', '.join(FIELDS)}, got {raw!r:.60}")
    where = f"question {raw.get('id', '?')!r}"
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}; valid: {', '.join(FIELDS)}")
    qid = _text("id", raw.get("id"), where)
    topic = _text("topic", raw.get("topic"), where)
    if topic not in TOPICS:
        raise ConfigError(f"{where}: unknown topic {topic!r}; valid: {', '.join(TOPICS)}")
    _check_choices(raw.get("choices"), raw.get("answer"), where)
    return Question(id=qid, topic=topic, question=_text("question", raw.get("question"), where),
                    choices=tuple(raw["choices"]), answer=raw["answer"],
                    explanation=_text("explanation", raw.get("explanation"), where),
                    feedback=_check_feedback(raw.get("feedback"), raw["choices"], where),
                    notebook=_check_notebook(raw.get("notebook"), where, root))


def check_bank(raw: Any, root: Path = REPO_ROOT) -> list[Question]:
    """Every question validated, ids unique."""
    items = raw.get("questions") if isinstance(raw, Mapping) else None
    if not isinstance(items, list):
        raise ConfigError('a question bank is an object {"questions": [...]}')
    questions, seen = [], set()
    for item in items:
        q = check_question(item, root)
        if q.id in seen:
            raise ConfigError(f"question {q.id!r}: duplicate id")
        seen.add(q.id)
        questions.append(q)
    return questions


def load_bank(path: str | os.PathLike | None = None, root: str | os.PathLike | None = None) -> list[Question]:
    """The validated bank (`data/questions.json` by default); notebook paths resolve from `root`
    (the repository root by default)."""
    path = Path(path or BANK_PATH)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read the question bank {path}: {e}") from None
    return check_bank(raw, Path(root) if root else REPO_ROOT)


# --- Drawing: random, review, mock exam -------------------------------------------------------

def _check_n(n: Any) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"n={n!r} must be a positive integer")


def draw(topic: str | None = None, n: int = 10, seed: int | None = None,
         bank: Sequence[Question] | None = None, *, order: str = "random",
         progress: str | os.PathLike | None = None) -> list[Question]:
    """`n` questions of `topic` (None or "all": every topic), each with its choices shuffled;
    the same questions, order and choice orders for the same seed; all of them when the topic has
    fewer than `n`. order="random": a random sample; "review": see `review_order` (reads the
    progress file `progress`)."""
    bank = load_bank() if bank is None else bank
    if topic not in (None, "all"):
        check_choice("topic", topic, ("all", *TOPICS))
    _check_n(n)
    check_choice("order", order, ORDERS)
    pool = [q for q in bank if topic in (None, "all", q.topic)]
    rng = random.Random(seed)
    if order == "review":
        picked = review_order(pool, load_progress(progress)["questions"], rng)[:n]
    else:
        picked = rng.sample(pool, min(n, len(pool)))
    return [q.shuffled(rng) for q in picked]


def _last_correct(record: Mapping[str, Any]) -> bool:
    """The last answer's verdict; files written before `last_correct` existed only have counts,
    so there a question ever answered wrong counts as wrong (it deserves a review)."""
    if "last_correct" in record:
        return bool(record["last_correct"])
    return record.get("correct", 0) >= record.get("answered", 0)


def review_order(pool: Sequence[Question], records: Mapping[str, Mapping[str, Any]],
                 rng: random.Random) -> list[Question]:
    """Questions last answered wrong (longest ago first), then unseen ones (random order), then
    the ones last answered right (longest ago first). Ties shuffle with `rng`."""
    pool = list(pool)
    rng.shuffle(pool)  # the random order within a group; sorted() below is stable
    seen = [q for q in pool if q.id in records]
    wrong = [q for q in seen if not _last_correct(records[q.id])]
    right = [q for q in seen if _last_correct(records[q.id])]
    unseen = [q for q in pool if q.id not in records]

    def age(q: Question) -> int:
        return records[q.id].get("last_seen", 0)

    return sorted(wrong, key=age) + unseen + sorted(right, key=age)


def review(n: int = 10, topic: str | None = None, *, progress: str | os.PathLike | None = None,
           bank: Sequence[Question] | None = None, seed: int | None = None) -> list[Question]:
    """`draw(topic, n, seed, bank, order="review", progress=progress)`: wrong first, then unseen."""
    return draw(topic, n, seed, bank, order="review", progress=progress)


def largest_remainder(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """`total` split in proportion to `weights` (Hamilton's method): each key gets the floor of
    its quota total·w/Σw, and the seats left go one each to the largest fractional parts (ties:
    the order of `weights`)."""
    weight_sum = sum(weights.values())
    quotas = {k: total * w / weight_sum for k, w in weights.items()}
    counts = {k: math.floor(q) for k, q in quotas.items()}
    by_fraction = sorted(quotas, key=lambda k: quotas[k] - counts[k], reverse=True)
    for k in by_fraction[:total - sum(counts.values())]:
        counts[k] += 1
    return counts


def topic_counts(n: int, available: Mapping[str, int],
                 weights: Mapping[str, float] = TOPIC_WEIGHTS) -> dict[str, int]:
    """How many questions of each topic a mock exam of `n` draws: `largest_remainder` over the
    topics that have questions; a topic with fewer than its share gives all it has and the rest
    is split again among the others."""
    _check_n(n)
    num_available = sum(available.get(t, 0) for t in weights)
    if n > num_available:
        raise ConfigError(f"n={n} is more than the bank's {num_available} questions")
    counts: dict[str, int] = {}
    active = {t: w for t, w in weights.items() if available.get(t, 0) > 0}
    while True:
        split = largest_remainder(n - sum(counts.values()), active)
        short = [t for t in active if split[t] > available[t]]
        if not short:
            return {t: counts.get(t, 0) + split.get(t, 0) for t in weights}
        for t in short:
            counts[t] = available[t]
            del active[t]


@dataclass
class MockExam:
    """A timed exam: `questions`, `seconds` to answer them from `started` on `clock` (seconds,
    injectable for tests). Answers after the deadline are not counted; no feedback until the end."""
    questions: list[Question]
    seconds: float
    clock: Callable[[], float] = time.monotonic
    started: float = field(default=math.nan)
    picks: dict[str, int] = field(default_factory=dict)
    num_late: int = 0  # answers given after the deadline (not counted)

    def __post_init__(self) -> None:
        if math.isnan(self.started):
            self.started = self.clock()

    def time_left_s(self) -> float:
        return max(0.0, self.started + self.seconds - self.clock())

    @property
    def over(self) -> bool:
        return self.time_left_s() <= 0

    def answer(self, question: Question, choice: int) -> bool:
        """Keep `choice` for `question`; False (and not kept) once time is up."""
        if self.over:
            self.num_late += 1
            return False
        self.picks[question.id] = choice
        return True

    def result(self) -> list[dict[str, Any]]:
        """One row per topic in the exam plus a total: questions, answered, correct, and percent
        of the questions (an unanswered question counts as wrong, as in the exam)."""
        rows = []
        for key in [t for t in TOPICS if any(q.topic == t for q in self.questions)] + ["total"]:
            qs = [q for q in self.questions if key in ("total", q.topic)]
            s = score(qs, self.picks)
            rows.append({"topic": key, "title": TOPICS.get(key, "All topics"), "questions": len(qs),
                         "answered": s.answered, "correct": s.correct,
                         "percent": round(100 * s.correct / len(qs), 1)})
        return rows


def mock_exam(n: int = 30, minutes: float | None = None, seed: int | None = None,
              bank: Sequence[Question] | None = None,
              clock: Callable[[], float] = time.monotonic) -> MockExam:
    """A mock exam of `n` questions drawn by `TOPIC_WEIGHTS` (`topic_counts`), in a random order
    with shuffled choices, timed at `minutes` (default: 2 minutes a question, the exam's pace)."""
    bank = load_bank() if bank is None else bank
    counts = topic_counts(n, Counter(q.topic for q in bank))
    rng = random.Random(seed)
    picked = [q for t in TOPICS for q in rng.sample([q for q in bank if q.topic == t], counts.get(t, 0))]
    rng.shuffle(picked)
    minutes = n * SECONDS_PER_QUESTION / 60 if minutes is None else minutes
    if not minutes > 0:
        raise ConfigError(f"minutes={minutes!r} must be positive")
    return MockExam([q.shuffled(rng) for q in picked], 60.0 * minutes, clock)


# --- Scoring --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Score:
    answered: int
    correct: int

    @property
    def percent(self) -> float | None:
        return round(100 * self.correct / self.answered, 1) if self.answered else None

    def line(self) -> str:
        pct = "" if self.percent is None else f" ({self.percent:g}%)"
        return f"score: {self.correct} of {self.answered} correct{pct}"


def score(questions: Sequence[Question], picks: Mapping[str, int | None]) -> Score:
    """A session's score: the questions with a pick count as answered. `picks` is keyed by id and
    indexes each DRAWN question's choices (shuffled order)."""
    answered = [q for q in questions if picks.get(q.id) is not None]
    return Score(len(answered), sum(q.is_correct(picks[q.id]) for q in answered))


# --- Progress: one JSON file, updated under a lock --------------------------------------------

def progress_path(path: str | os.PathLike | None = None) -> Path:
    """`path`, else `$LABKIT_QUIZ_PROGRESS`, else `~/.labkit/quiz_progress.json`."""
    return Path(path or os.environ.get("LABKIT_QUIZ_PROGRESS")
                or Path.home() / ".labkit" / "quiz_progress.json")


def load_progress(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """{"topics": {topic: {"answered", "correct"}}, "questions": {id: {"answered", "correct",
    "last_correct", "last_seen"}}, "num_answers"}; empty when new. `last_seen` is the answer's
    number in this file (1, 2, ...). Older files (counts only) load as they are: `num_answers`
    then starts from the answers they counted."""
    p = progress_path(path)
    if not p.exists():
        return {"topics": {}, "questions": {}, "num_answers": 0}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        data = e
    if not isinstance(data, dict):
        raise ConfigError(f"the quiz progress file {p} is not a progress record; delete it to start over")
    topics = data.get("topics", {})
    num_answers = data.get("num_answers", sum(t.get("answered", 0) for t in topics.values()))
    return {"topics": topics, "questions": data.get("questions", {}), "num_answers": num_answers}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path`.lock for one read-add-write (no-op where fcntl is missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # Windows: the atomic rename still keeps the file whole
        yield
        return
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _add(counts: dict[str, dict[str, Any]], key: str, correct: bool) -> dict[str, Any]:
    c = counts.setdefault(key, {"answered": 0, "correct": 0})
    c["answered"] += 1
    c["correct"] += int(correct)
    return c


def record_answer(question: Question, choice: int, path: str | os.PathLike | None = None) -> bool:
    """Count one answer in the progress file (safe with several sessions at once); True if right.
    `choice` indexes `question.choices` as drawn; the record is keyed by the question's id."""
    right = question.is_correct(choice)
    p = progress_path(path)
    with _locked(p):
        data = load_progress(p)
        data["num_answers"] += 1
        _add(data["topics"], question.topic, right)
        _add(data["questions"], question.id, right).update(last_correct=right,
                                                            last_seen=data["num_answers"])
        write_json_atomic(p, data)
    return right


def progress_summary(path: str | os.PathLike | None = None):
    """One row per topic (answered, correct, percent: NaN before any answer) plus a total row, as
    a pandas DataFrame."""
    import pandas as pd

    topics = load_progress(path)["topics"]
    rows = []
    for key, title in {**TOPICS, "total": "All topics"}.items():
        c = topics.get(key, {}) if key != "total" else {
            "answered": sum(t["answered"] for t in topics.values()),
            "correct": sum(t["correct"] for t in topics.values())}
        s = Score(c.get("answered", 0), c.get("correct", 0))
        rows.append({"topic": key, "title": title, "answered": s.answered, "correct": s.correct,
                     "percent": float("nan") if s.percent is None else s.percent})
    return pd.DataFrame(rows)


# --- Bank statistics: is the bank fair? ---------------------------------------------------------

def longest_choice_hit(q: Question) -> float:
    """The chance that picking the longest choice (ties broken at random) is right: 1/k when the
    answer is one of the k longest choices (in characters), else 0. A test-wise learner's cue,
    so a fair bank keeps its mean low; it does not depend on the choice order."""
    lengths = [len(c) for c in q.choices]
    longest = max(lengths)
    return 1 / lengths.count(longest) if lengths[q.answer] == longest else 0.0


def longest_answer_offenders(bank: Sequence[Question]) -> list[str]:
    """The ids whose answer is the one longest choice: the first to rewrite (longer distractors
    or a shorter answer)."""
    return [q.id for q in bank if longest_choice_hit(q) == 1.0]


# A choice that hedges ("Both...", "Neither...", "None...", "Nothing...", "either way", "in both
# cases"): a test-wise guesser's cue when such choices are never (or always) the answer.
HEDGE = re.compile(r"^(both|neither|nothing|none)\b|either way|in both cases", re.IGNORECASE)
# A choice that is one number with at most a unit ("112 GB", "0.16", "9,437,184", "3.99995x")
NUMBER = re.compile(r"^\s*[~≈]?\s*(-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)\s*([%x×]|[A-Za-z]+(?:/[A-Za-z]+)?)?\s*$")
BYTE_UNITS = {"b": 1, "bytes": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20,
              "gib": 2**30, "tib": 2**40}


def id_prefix(q: Question) -> str:
    """The family of an id: "mem" for mem-01, "finetune" for finetune-12."""
    return re.sub(r"-?\d+$", "", q.id)


def longest_share_by(bank: Sequence[Question], key: Callable[[Question], str]) -> dict[str, float]:
    """The mean of `longest_choice_hit` per group of `key`."""
    groups: dict[str, list[float]] = {}
    for q in bank:
        groups.setdefault(key(q), []).append(longest_choice_hit(q))
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}


def hedge_counts(bank: Sequence[Question]) -> tuple[int, int]:
    """(questions with a hedging choice, those whose answer is one)."""
    hedged = [q for q in bank if any(HEDGE.search(c) for c in q.choices)]
    return len(hedged), sum(bool(HEDGE.search(q.choices[q.answer])) for q in hedged)


def numeric_values(q: Question) -> list[float] | None:
    """The choices as numbers when every one is a number in one unit (byte units made bytes),
    else None."""
    parsed = [NUMBER.match(c) for c in q.choices]
    if not all(parsed):
        return None
    units = [(m.group(2) or "").lower() for m in parsed]
    values = [float(m.group(1).replace(",", "")) * BYTE_UNITS.get(u, 1) for m, u in zip(parsed, units)]
    kinds = {"bytes" if u in BYTE_UNITS else u for u in units}
    return values if len(kinds) == 1 and len(set(values)) == len(values) else None


def numeric_answer_ranks(bank: Sequence[Question]) -> Counter[int]:
    """Among the questions with four numeric choices: how often the answer is the smallest (0),
    the second smallest (1), ... A guesser's cue when the middle ones win."""
    ranks: Counter[int] = Counter()
    for q in bank:
        values = numeric_values(q)
        if values is not None and len(values) == 4:
            ranks[sorted(values).index(values[q.answer])] += 1
    return ranks


def bank_stats(bank: Sequence[Question] | None = None, seed: int = 0) -> dict[str, Any]:
    """{"num_questions", "by_topic": {topic: count} (every key of TOPICS), "longest_is_answer_share"
    (the mean of `longest_choice_hit`: the share of questions where the longest choice is the
    answer, ties split), the same "longest_by_topic" and "longest_by_prefix" (`id_prefix`),
    "longest_answer_offenders" (ids), "hedge": (questions with a hedging choice, those it answers),
    "numeric_answer_ranks": {rank: count} (`numeric_answer_ranks`), "answer_positions":
    {position: count} after shuffling every question once with random.Random(seed), in bank order}."""
    bank = load_bank() if bank is None else list(bank)
    rng = random.Random(seed)
    counts = Counter(q.topic for q in bank)
    positions = Counter(q.shuffled(rng).answer for q in bank)
    ranks = numeric_answer_ranks(bank)
    return {"num_questions": len(bank), "by_topic": {t: counts[t] for t in TOPICS},
            "longest_is_answer_share": sum(map(longest_choice_hit, bank)) / max(1, len(bank)),
            "longest_by_topic": longest_share_by(bank, lambda q: q.topic),
            "longest_by_prefix": longest_share_by(bank, id_prefix),
            "longest_answer_offenders": longest_answer_offenders(bank),
            "hedge": hedge_counts(bank), "numeric_answer_ranks": {r: ranks[r] for r in range(4)},
            "answer_positions": {p: positions[p] for p in range(max(positions, default=-1) + 1)}}


def format_stats(stats: Mapping[str, Any]) -> str:
    """`bank_stats` as lines of text."""
    total = max(1, stats["num_questions"])
    lines = [EXAM_SCOPE, f"{stats['num_questions']} questions"]
    lines += [f"  {TOPICS[t]}: {c}" for t, c in stats["by_topic"].items()]
    lines.append(f"longest choice is the answer: {stats['longest_is_answer_share']:.0%} of questions "
                 f"(ties split); the only longest: {', '.join(stats['longest_answer_offenders']) or 'none'}")
    lines.append("  by topic: " + ", ".join(f"{t} {v:.0%}" for t, v in stats["longest_by_topic"].items()))
    lines.append("  by id prefix: " + ", ".join(f"{p} {v:.0%}" for p, v in stats["longest_by_prefix"].items()))
    hedged, answered = stats["hedge"]
    lines.append(f"a hedging choice (both, neither, none...) is the answer in {answered} of the "
                 f"{hedged} questions that have one ({answered / max(1, hedged):.0%})")
    ranks = stats["numeric_answer_ranks"]
    lines.append(f"four numeric choices ({sum(ranks.values())} questions): the answer is the "
                 + ", ".join(f"{n} {c}" for n, c in zip(("smallest", "2nd", "3rd", "largest"), ranks.values())))
    lines.append("answer positions after one seeded shuffle: " + ", ".join(
        f"{chr(65 + p)} {c} ({c / total:.0%})" for p, c in stats["answer_positions"].items()))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m labkit.study.quiz --stats [--seed N] [--bank PATH]`."""
    parser = argparse.ArgumentParser(prog="python -m labkit.study.quiz", description=__doc__.split("\n")[0])
    parser.add_argument("--stats", action="store_true", help="print the bank's statistics")
    parser.add_argument("--seed", type=int, default=0, help="seed of the shuffle (default 0)")
    parser.add_argument("--bank", default=None, help="question bank (default data/questions.json)")
    args = parser.parse_args(argv)
    if not args.stats:
        parser.print_help()
        return 2
    print(format_stats(bank_stats(load_bank(args.bank), args.seed)))
    return 0


# --- The widget -----------------------------------------------------------------------------------

def _esc(text: str) -> str:
    return html.escape(text, quote=False)


def feedback_html(q: Question, choice: int) -> str:
    """Right or wrong, the picked choice's feedback, the right answer and its feedback when the
    pick is wrong, then the explanation."""
    if q.is_correct(choice):
        parts = ["<b style='color:green'>Right.</b>", f"<p>{_esc(q.feedback[choice])}</p>"]
    else:
        parts = [f"<b style='color:#c00'>Wrong.</b> You picked: {_esc(q.choices[choice])}",
                 f"<p>{_esc(q.feedback[choice])}</p>",
                 f"<p>The answer is: <b>{_esc(q.choices[q.answer])}</b>. {_esc(q.feedback[q.answer])}</p>"]
    return "".join(parts) + f"<p><i>Why:</i> {_esc(q.explanation)}</p>"


MODES = ("practice", "review", "mock")


class QuizPanel:
    """One quiz: mode (practice: a random draw; review: wrong first, then unseen; mock: a timed
    exam drawn by topic weight), topic dropdown, a question with radio buttons, Submit, Next, a
    score line and the per-topic progress table. In practice and review, Submit shows right or
    wrong, the picked choice's feedback (and the right one's when wrong), the explanation and the
    notebook; in mock mode nothing until the end (or the deadline), then a result per topic and
    every question's feedback. `minutes` times the mock (default 2 a question), `clock` is its
    time source (seconds; tests pass a fake). `link_base` is the notebooks folder as seen from
    where the quiz is displayed (the quiz notebook sits in notebooks/: bare file names)."""

    def __init__(self, topic: str | None = None, n: int = 10, *, seed: int | None = None,
                 progress: str | os.PathLike | None = None, bank: Sequence[Question] | None = None,
                 link_base: str = "", mode: str = "practice", minutes: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        import ipywidgets as W

        check_choice("topic", topic or "all", ("all", *TOPICS))
        check_choice("mode", mode, MODES)
        self.bank = load_bank() if bank is None else list(bank)
        self.n, self.seed, self.progress, self.link_base = n, seed, progress, link_base
        self.minutes, self.clock, self.exam = minutes, clock, None
        self.mode = W.Dropdown(options=MODES, value=mode, description="mode")
        self.topic = W.Dropdown(options=[("All topics", "all")] + [(t, k) for k, t in TOPICS.items()],
                                value=topic or "all", description="topic")
        self.timer, self.question = W.HTML(), W.HTML()
        self.choices = W.RadioButtons(options=[], value=None, layout={"width": "max-content"})
        self.submit_button = W.Button(description="Submit", button_style="primary")
        self.next_button = W.Button(description="Next")
        # ticks once a second in the browser while a mock runs, to refresh the time-left line
        self.ticker = W.Play(interval=1000, max=10**9, show_repeat=False, layout={"display": "none"})
        self.feedback, self.score_line, self.table = W.HTML(), W.HTML(), W.HTML()
        self.submit_button.on_click(self._on_submit)
        self.next_button.on_click(self._on_next)
        self.ticker.observe(lambda change: self._tick(), names="value")
        for control in (self.mode, self.topic):
            control.observe(lambda change: self.start(), names="value")
        self.box = W.VBox([W.HBox([self.mode, self.topic]), self.timer, self.ticker, self.question,
                           self.choices, W.HBox([self.submit_button, self.next_button]),
                           self.feedback, self.score_line, self.table])
        self.start()

    def start(self) -> None:
        """A new set of questions for the chosen mode and topic; the session score starts again."""
        mode, topic = self.mode.value, self.topic.value
        if mode == "mock":
            self.exam = mock_exam(min(self.n, len(self.bank)), self.minutes, self.seed, self.bank, self.clock)
            self.questions = self.exam.questions
        else:
            self.exam = None
            order = "review" if mode == "review" else "random"
            self.questions = draw(topic, self.n, self.seed, self.bank, order=order, progress=self.progress)
        self.picks: dict[str, int | None] = {}
        self.position, self.finished = 0, False
        self.ticker.playing = self.exam is not None
        self._show()
        self._show_progress()

    @property
    def current(self) -> Question:
        return self.questions[self.position]

    def _tick(self) -> None:
        """Refresh the time-left line; at the deadline, end the exam."""
        if self.exam is None or self.finished:
            return
        left = self.exam.time_left_s()
        self.timer.value = f"<b>time left: {int(left) // 60}:{int(left) % 60:02d}</b>"
        if left <= 0:
            self._finish_exam("Time is up.")

    def _show(self) -> None:
        q = self.current
        self.question.value = (f"<b>Question {self.position + 1} of {len(self.questions)}</b> "
                               f"<i>({_esc(TOPICS[q.topic])})</i><p>{_esc(q.question)}</p>")
        self.choices.options = [(c, i) for i, c in enumerate(q.choices)]
        self.choices.value = None
        self.choices.disabled, self.submit_button.disabled, self.next_button.disabled = False, False, True
        self.next_button.description = "Next"
        self.feedback.value = ""
        self.timer.value = ""
        self.score_line.value = score(self.questions, self.picks).line() if self.exam is None else ""
        self._tick()

    def _on_submit(self, _button=None) -> None:
        q, choice = self.current, self.choices.value
        if choice is None:
            self.feedback.value = "Pick an answer first."
            return
        if self.exam is not None:
            self._submit_mock(q, choice)
            return
        self.picks[q.id] = choice
        record_answer(q, choice, self.progress)
        link = self.link_base + Path(q.notebook).name
        self.feedback.value = (feedback_html(q, choice) +
                               f"<p>Measure it: <a href='{html.escape(link)}' target='_blank'>"
                               f"{_esc(q.notebook)}</a></p>")
        self._after_submit()
        self.score_line.value = score(self.questions, self.picks).line() + (" (done)" if self._last else "")
        self._show_progress()

    @property
    def _last(self) -> bool:
        return self.position == len(self.questions) - 1

    def _after_submit(self) -> None:
        self.choices.disabled, self.submit_button.disabled, self.next_button.disabled = True, True, False
        self.next_button.description = "New quiz" if self._last else "Next"

    def _submit_mock(self, q: Question, choice: int) -> None:
        """Keep the answer if in time (and count it in the progress file), show nothing about it."""
        if not self.exam.answer(q, choice):
            self._finish_exam("Time is up: that answer was not counted.")
            return
        self.picks[q.id] = choice
        record_answer(q, choice, self.progress)
        self.feedback.value = f"Answer saved ({len(self.exam.picks)} of {len(self.questions)})."
        self._after_submit()
        if self._last:
            self._finish_exam("Exam finished.")

    def _finish_exam(self, reason: str) -> None:
        """The result per topic, then each question with its right answer and feedback."""
        import pandas as pd

        self.finished, self.ticker.playing = True, False
        self.choices.disabled, self.submit_button.disabled, self.next_button.disabled = True, True, False
        self.next_button.description = "New exam"
        rows, late = self.exam.result(), self.exam.num_late
        note = f" {late} answer(s) after the deadline not counted." if late else ""
        self.timer.value = f"<b>{_esc(reason)}</b>{note}"
        total = rows[-1]
        self.score_line.value = f"exam score: {total['correct']} of {total['questions']} ({total['percent']:g}%)"
        table = pd.DataFrame(rows).drop(columns="topic").to_html(index=False)
        self.feedback.value = f"<b>Result per topic</b>{table}<ol>{self._exam_review()}</ol>"
        self._show_progress()

    def _exam_review(self) -> str:
        """Every exam question with the feedback on its pick (or its right answer if unanswered)."""
        items = []
        for q in self.questions:
            pick = self.exam.picks.get(q.id)
            body = (feedback_html(q, pick) if pick is not None else
                    f"Not answered. The answer is: <b>{_esc(q.choices[q.answer])}</b>. "
                    f"{_esc(q.feedback[q.answer])}<p><i>Why:</i> {_esc(q.explanation)}</p>")
            items.append(f"<li>{_esc(q.question)}<br>{body}</li>")
        return "".join(items)

    def _on_next(self, _button=None) -> None:
        if self.finished or (self._last and self.exam is None):
            self.start()
            return
        if self.exam is not None and self.exam.over:
            self._finish_exam("Time is up.")
            return
        self.position += 1
        self._show()

    def _show_progress(self) -> None:
        frame = progress_summary(self.progress).drop(columns="topic")
        self.table.value = "<b>Your progress</b>" + frame.to_html(index=False, na_rep="")


def quiz_panel(topic: str | None = None, n: int = 10, **kwargs: Any):
    """The quiz widget, ready to display (see `QuizPanel` for the options)."""
    return QuizPanel(topic, n, **kwargs).box


if __name__ == "__main__":
    raise SystemExit(main())
