"""Answer extraction and checking for math replies, and the episode reward built from them.

Two separate questions, reported separately by ``python -m workflows eval math``:

- *correct*: is the reply's final answer right, whatever its format? The final answer is the last
  ``Answer: X`` (or ``\\boxed{X}``, or "the answer is X"), else the last number in the reply.
- *formatted*: does the reply end with a line ``Answer: <number>``, as the system prompt asks?

Numbers compare exactly as fractions (``1,000`` = ``1000`` = ``1000.0``; ``1/2`` = ``0.5``).
Anything that is not a plain number (``\\frac{3}{4}``, ``2\\sqrt{2}``) goes to math-verify, which is
imported only then (it lives in the agents venv).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

_NUM = r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\$?\.\d+"
_EXPLICIT = re.compile(rf"answer\s*(?:is|:|=)\s*[*_]*\s*({_NUM})", re.IGNORECASE)
_LAST_LINE = re.compile(rf"^\s*[*_]*answer\s*:[*_]*\s*({_NUM})\s*[*_]*\.?\s*$", re.IGNORECASE)
_ANY_NUMBER = re.compile(_NUM)


@dataclass(frozen=True)
class Check:
    answer: str | None
    """The extracted final answer (None: the reply holds no answer at all)."""
    correct: bool
    formatted: bool

    def reward(self, format_weight: float = 0.0) -> float:
        """``(1 - w) * correct + w * formatted``: in [0, 1]; w = 0 rewards correctness only."""
        if not 0.0 <= format_weight <= 1.0:
            raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
        return (1.0 - format_weight) * float(self.correct) + format_weight * float(self.formatted)


def parse_number(text: str) -> Fraction | None:
    """A plain number (``-1,234.5``, ``$12``, ``3/4``, ``7.``) as an exact fraction, else None."""
    cleaned = text.strip().rstrip(".").replace(",", "").replace("$", "").strip()
    if cleaned.endswith("%"):
        cleaned = cleaned[:-1]
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


def _boxed(reply: str) -> list[tuple[int, str]]:
    """(position, content) of each ``\\boxed{...}``, braces nested."""
    found = []
    start = reply.find("\\boxed{")
    while start != -1:
        depth, i = 1, start + len("\\boxed{")
        while i < len(reply) and depth:
            depth += {"{": 1, "}": -1}.get(reply[i], 0)
            i += 1
        if depth == 0 and reply[start + 7 : i - 1].strip():
            found.append((start, reply[start + 7 : i - 1].strip()))
        start = reply.find("\\boxed{", start + 1)
    return found


def extract_answer(reply: str) -> str | None:
    """The reply's final answer: the last explicit one, else the last number, else None."""
    explicit = [(m.start(), m.group(1)) for m in _EXPLICIT.finditer(reply)] + _boxed(reply)
    if explicit:
        return max(explicit)[1].strip().rstrip(".")
    numbers = _ANY_NUMBER.findall(reply)
    return str(numbers[-1]) if numbers else None


def is_formatted(reply: str) -> bool:
    """True when the last non-empty line is ``Answer: <number>`` (bold markers and a period allowed)."""
    lines = [line for line in reply.strip().splitlines() if line.strip()]
    return bool(lines) and _LAST_LINE.match(lines[-1]) is not None


def same_answer(predicted: str, gold: str) -> bool:
    """Exact comparison for plain numbers; math-verify for anything symbolic."""
    p, g = parse_number(predicted), parse_number(gold)
    if p is not None and g is not None:
        return p == g
    from math_verify import parse, verify  # type: ignore[import-untyped,unused-ignore]  # agents venv

    return bool(verify(parse(f"${gold}$"), parse(f"${predicted}$")))


def check(reply: str, gold: str) -> Check:
    answer = extract_answer(reply)
    return Check(answer=answer, correct=answer is not None and same_answer(answer, gold), formatted=is_formatted(reply))
