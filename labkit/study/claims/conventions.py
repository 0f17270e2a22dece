"""The mechanical part of data/quiz_conventions.md: a question whose answer is an amount of
bytes computed from a count (parameters, weights, tokens, values, elements) must say in its stem
what each element takes (a dtype, or bytes or bits per element), unless the stem already gives
the count in bytes."""
from __future__ import annotations

import re

# an amount, not a rate; a bare B needs its space ("2 B"), since "7B" is a parameter count
BYTES = re.compile(r"\d[\d,.]*(?:\s*(?:bytes|KiB|MiB|GiB|GB|MB|KB|TB)|\s+B)\b(?!/s)")
COUNTED = re.compile(r"param|weights|tokens|values|elements|\d+\s*[×x]\s*\d+", re.IGNORECASE)
DTYPE = re.compile(r"fp32|fp16|bf16|fp8|int8|int4|e4m3|e5m2|nf4|float(?:8|16|32)|bfloat16|\d+-bit|"
                   r"mixed-precision|\bbytes?\b|\bbits?\b|\d\s+B\b", re.IGNORECASE)


def byte_answers(questions) -> list[str]:
    """Ids of the questions whose answer is an amount of bytes."""
    return [q.id for q in questions if BYTES.search(q.choices[q.answer])]


def open_dtype(questions) -> list[str]:
    """Ids of the byte-answer questions that count something in the stem and leave its element
    size unsaid (no dtype, no bytes or bits per element, no byte figure to start from)."""
    byte_ids = set(byte_answers(questions))
    return [q.id for q in questions if q.id in byte_ids and COUNTED.search(q.question)
            and not DTYPE.search(q.question) and not BYTES.search(q.question)]
