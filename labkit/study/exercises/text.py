"""The prose of the exercises and the troubleshooting labs, read by key from
notebooks/exercises/text/KEY.md (read at run time, like data/gpus.json: from the source checkout,
which `pip install -e .` keeps in place).

The format, strict and small: a file is a series of sections, each a `## NAME` line, a blank line
and the text up to the next `## ` line (its surrounding blank lines dropped); nothing comes before
the first. The names:

- every exercise: `title`, `scenario`, `question`, `hint`, `why`; `mistake_why` when it has a
  common mistake; `feedback: CHOICE` for each of its choices, when it has choices;
- every lab: `title`, `symptoms`, `hint`, `why`, and `feedback: DIAGNOSIS` for the diagnoses it
  answers in its own words (the others get the generic sentence, `labs.SIGNS`);
- either, when a CPU cannot demonstrate its mechanism (tensor cores, a GPU's bandwidth): `cpu`,
  what a CPU cannot show and that the formula is graded there, with the GPU reference figure
  from the H200 record (`labkit.study.exercises.h200`); shown at the top.

A text may hold `{name}` placeholders (str.format, a format spec allowed: `{context:,}`): the
numbers labkit computes are filled in from the exercise's or lab's `words`, never written into
the text; an exercise's `why` also gets `{answer}`, `{prediction}` and its evidence's keys when it
is graded. Write a literal brace as `{{` or `}}`. tests/test_exercise_core.py holds every file to
this format, every placeholder to a value and every key to one file."""
from __future__ import annotations

import functools
import re
import string
from typing import Any

from labkit import hardware

TEXT_DIR = hardware.REPO_DIR / "notebooks" / "exercises" / "text"
SECTION = re.compile(r"^## (.+)$", re.MULTILINE)
NAMES = frozenset({"title", "scenario", "symptoms", "question", "hint", "why", "mistake_why", "cpu"})
FEEDBACK = "feedback: "


@functools.cache
def sections(key: str) -> dict[str, str]:
    """The named sections of KEY.md; a ValueError for text outside a section, an unknown name or
    a name given twice."""
    path = TEXT_DIR / f"{key}.md"
    parts = SECTION.split(path.read_text(encoding="utf-8"))
    if parts[0].strip():
        raise ValueError(f"{path.name}: text before its first `## name` line")
    found: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        if name not in NAMES and not name.startswith(FEEDBACK):
            valid = ", ".join([*sorted(NAMES), FEEDBACK + "CHOICE"])
            raise ValueError(f"{path.name}: unknown section {name!r}; valid: {valid}")
        if name in found:
            raise ValueError(f"{path.name}: section {name!r} twice")
        found[name] = body.strip("\n")
    return found


def section(name: str, doc: str, *, optional: bool = False) -> property:
    """A read-only attribute of a `Text`: its section `name` with the words filled in ("" for a
    missing `optional` one)."""
    def get(self: Text) -> str:
        return "" if optional and name not in sections(self.key) else self.say(name)
    return property(get, doc=doc)


class Text:
    """What an exercise or a lab says: its sections, with the `words` (labkit's numbers) filled
    in. For a frozen dataclass with `key` and `words` fields."""

    key: str
    words: dict[str, Any]
    title = section("title", "The title: a notebook's heading.")
    hint = section("hint", "A nudge towards the method, shown on request before the answer.")
    cpu = section("cpu", "What a CPU cannot show, and that it grades the formula there (\"\" when "
                         "a CPU shows it all).", optional=True)

    def say(self, name: str, **values: Any) -> str:
        """Section `name` with its placeholders filled from `words` and `values`."""
        return sections(self.key)[name].format(**self.words, **values)

    def template(self, name: str) -> str:
        """Section `name` with `words` filled in and its other placeholders kept, for str.format
        once their values exist (an exercise's why: its answer and evidence)."""
        def escape(text: str) -> str:
            return text.replace("{", "{{").replace("}", "}}")

        parts = []
        for literal, field, spec, conversion in string.Formatter().parse(sections(self.key)[name]):
            parts.append(escape(literal))
            if field is None:
                continue
            tail = ("!" + conversion if conversion else "") + (":" + spec if spec else "")
            placeholder = "{" + field + tail + "}"
            parts.append(escape(placeholder.format(**self.words)) if field in self.words else placeholder)
        return "".join(parts)

    @property
    def feedback(self) -> dict[str, str]:
        """choice -> why it is right or wrong, in the file's order."""
        return {name[len(FEEDBACK):]: self.say(name) for name in sections(self.key)
                if name.startswith(FEEDBACK)}
