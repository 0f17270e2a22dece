"""The question bank and the quiz: multiple-choice questions on the exam's optimization topics,
drawn by topic, scored, explained, and linked to the notebook that measures the same thing.

- The bank is `data/questions.json`: `{"questions": [{id, topic, question, choices, answer,
  explanation, notebook}, ...]}`, `answer` the index of the one correct choice, `topic` a key of
  `TOPICS`, `notebook` a path under the repository (`notebooks/11_zero.ipynb`) that must exist.
  `load_bank` validates every question and refuses a bad one with one `ConfigError` line naming
  the question and the problem.
- `draw(topic, n, seed)` picks questions (reproducibly with a seed); `score` counts a session.
- Progress (answered and correct, per topic and per question) lives in one small JSON file:
  `path`, else `$LABKIT_QUIZ_PROGRESS`, else `~/.labkit/quiz_progress.json`: the learner's own
  folder, not `runs/` (the results store reads every JSON there as a run record). Several
  sessions may record at once: each update holds an exclusive lock on a `.lock` file beside it
  (POSIX `fcntl`), reads, adds, and replaces the file atomically (temporary file + rename), so
  no answer is lost and no reader sees half a file.
- `quiz_panel(topic, n)` is the ipywidgets quiz (imported only when used: the core runs
  without ipywidgets). Its logic lives in `QuizPanel`, whose buttons tests click in code.
"""
from __future__ import annotations

import contextlib
import html
import json
import os
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.config import ConfigError, check_choice
from labkit.hardware import DATA_DIR
from labkit.results import write_json_atomic

# The topics, once: key -> title. The first five are the exam's optimization topics.
TOPICS = {
    "memory": "Memory and batch optimization",
    "parallelism": "Parallelism techniques",
    "distributed": "Multi-GPU and distributed setups",
    "profiling": "Performance profiling and troubleshooting",
    "inference": "Inference optimization (KV cache, batching)",
    "precision": "Mixed precision and kernels",
}
MAIN_TOPICS = ("memory", "parallelism", "distributed", "profiling", "inference")
REPO_ROOT = DATA_DIR.parent
BANK_PATH = DATA_DIR / "questions.json"
FIELDS = ("id", "topic", "question", "choices", "answer", "explanation", "notebook")


@dataclass(frozen=True)
class Question:
    id: str
    topic: str
    question: str
    choices: tuple[str, ...]
    answer: int  # index of the one correct choice
    explanation: str
    notebook: str  # path from the repository root, e.g. notebooks/11_zero.ipynb

    def is_correct(self, choice: int | None) -> bool:
        return choice == self.answer


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


def draw(topic: str | None = None, n: int = 10, seed: int | None = None,
         bank: Sequence[Question] | None = None) -> list[Question]:
    """`n` questions of `topic` (None or "all": every topic) in random order, the same ones for
    the same seed; all of them when the topic has fewer than `n`."""
    bank = load_bank() if bank is None else bank
    if topic not in (None, "all"):
        check_choice("topic", topic, ("all", *TOPICS))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"n={n!r} must be a positive integer")
    pool = [q for q in bank if topic in (None, "all", q.topic)]
    return random.Random(seed).sample(pool, min(n, len(pool)))


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
    """A session's score: the questions with a pick count as answered."""
    answered = [q for q in questions if picks.get(q.id) is not None]
    return Score(len(answered), sum(q.is_correct(picks[q.id]) for q in answered))


# --- Progress: one JSON file, updated under a lock --------------------------------------------

def progress_path(path: str | os.PathLike | None = None) -> Path:
    """`path`, else `$LABKIT_QUIZ_PROGRESS`, else `~/.labkit/quiz_progress.json`."""
    return Path(path or os.environ.get("LABKIT_QUIZ_PROGRESS")
                or Path.home() / ".labkit" / "quiz_progress.json")


def load_progress(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """{"topics": {topic: {"answered", "correct"}}, "questions": {id: {...}}}; empty when new."""
    p = progress_path(path)
    if not p.exists():
        return {"topics": {}, "questions": {}}
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        data = e
    if not isinstance(data, dict):
        raise ConfigError(f"the quiz progress file {p} is not a progress record; delete it to start over")
    return {"topics": data.get("topics", {}), "questions": data.get("questions", {})}


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


def _add(counts: dict[str, dict[str, int]], key: str, correct: bool) -> None:
    c = counts.setdefault(key, {"answered": 0, "correct": 0})
    c["answered"] += 1
    c["correct"] += int(correct)


def record_answer(question: Question, choice: int, path: str | os.PathLike | None = None) -> bool:
    """Count one answer in the progress file (safe with several sessions at once); True if right."""
    right = question.is_correct(choice)
    p = progress_path(path)
    with _locked(p):
        data = load_progress(p)
        _add(data["topics"], question.topic, right)
        _add(data["questions"], question.id, right)
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


# --- The widget -----------------------------------------------------------------------------------

class QuizPanel:
    """One quiz: topic dropdown, a question with radio buttons, Submit (right/wrong, the
    explanation, a link to the notebook), Next, a score line and the per-topic progress table.
    `link_base` is the notebooks folder as seen from where the quiz is displayed (the quiz
    notebook sits in notebooks/, so links are the bare file names by default)."""

    def __init__(self, topic: str | None = None, n: int = 10, *, seed: int | None = None,
                 progress: str | os.PathLike | None = None, bank: Sequence[Question] | None = None,
                 link_base: str = ""):
        import ipywidgets as W

        check_choice("topic", topic or "all", ("all", *TOPICS))
        self.bank = load_bank() if bank is None else list(bank)
        self.n, self.seed, self.progress, self.link_base = n, seed, progress, link_base
        self.topic = W.Dropdown(options=[("All topics", "all")] + [(t, k) for k, t in TOPICS.items()],
                                value=topic or "all", description="topic")
        self.question = W.HTML()
        self.choices = W.RadioButtons(options=[], value=None, layout={"width": "max-content"})
        self.submit_button = W.Button(description="Submit", button_style="primary")
        self.next_button = W.Button(description="Next")
        self.feedback, self.score_line, self.table = W.HTML(), W.HTML(), W.HTML()
        self.submit_button.on_click(self._on_submit)
        self.next_button.on_click(self._on_next)
        self.topic.observe(lambda change: self.start(), names="value")
        self.box = W.VBox([self.topic, self.question, self.choices,
                           W.HBox([self.submit_button, self.next_button]),
                           self.feedback, self.score_line, self.table])
        self.start()

    def start(self) -> None:
        """A new set of questions of the chosen topic; the session score starts again."""
        self.questions = draw(self.topic.value, self.n, self.seed, self.bank)
        self.picks: dict[str, int | None] = {}
        self.position = 0
        self._show()
        self._show_progress()

    @property
    def current(self) -> Question:
        return self.questions[self.position]

    @staticmethod
    def _html(text: str) -> str:
        return html.escape(text, quote=False)

    def _show(self) -> None:
        q = self.current
        self.question.value = (f"<b>Question {self.position + 1} of {len(self.questions)}</b> "
                               f"<i>({self._html(TOPICS[q.topic])})</i><p>{self._html(q.question)}</p>")
        self.choices.options = [(c, i) for i, c in enumerate(q.choices)]
        self.choices.value = None
        self.choices.disabled, self.submit_button.disabled, self.next_button.disabled = False, False, True
        self.next_button.description = "Next"
        self.feedback.value = ""
        self.score_line.value = score(self.questions, self.picks).line()

    def _on_submit(self, _button=None) -> None:
        q, choice = self.current, self.choices.value
        if choice is None:
            self.feedback.value = "Pick an answer first."
            return
        self.picks[q.id] = choice
        right = record_answer(q, choice, self.progress)
        verdict = ("<b style='color:green'>Right.</b>" if right else
                   f"<b style='color:#c00'>Wrong.</b> The answer is: {self._html(q.choices[q.answer])}")
        link = self.link_base + Path(q.notebook).name
        self.feedback.value = (f"{verdict}<p>{self._html(q.explanation)}</p>"
                               f"<p>Measure it: <a href='{html.escape(link)}' target='_blank'>"
                               f"{self._html(q.notebook)}</a></p>")
        self.choices.disabled, self.submit_button.disabled, self.next_button.disabled = True, True, False
        last = self.position == len(self.questions) - 1
        self.next_button.description = "New quiz" if last else "Next"
        self.score_line.value = score(self.questions, self.picks).line() + (" (done)" if last else "")
        self._show_progress()

    def _on_next(self, _button=None) -> None:
        if self.position == len(self.questions) - 1:
            self.start()
            return
        self.position += 1
        self._show()

    def _show_progress(self) -> None:
        frame = progress_summary(self.progress).drop(columns="topic")
        self.table.value = "<b>Your progress</b>" + frame.to_html(index=False, na_rep="")


def quiz_panel(topic: str | None = None, n: int = 10, **kwargs: Any):
    """The quiz widget, ready to display (see `QuizPanel` for the options)."""
    return QuizPanel(topic, n, **kwargs).box
