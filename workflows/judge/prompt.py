"""What the judge is asked and how its answer is read: prompt, JSON schema, parsing, clipping.

One request scores every distinct trajectory of a group side by side (the RULER idea, OpenPipe
2025: ranking attempts at the same task against each other is easier for a judge than scoring each
alone, and GRPO only uses rewards relative to the group's mean). The answer is constrained by a
JSON schema (OpenAI ``response_format`` ``json_schema``; vLLM enforces it with guided decoding):
one object per trajectory label, each with a short ``reason`` written before its ``score``, so the
judge states its grounds before it commits to a number. Scores live in [``SCORE_MIN``,
``SCORE_MAX``]; a score outside is clipped (and counted), a missing or non-numeric one makes the
whole answer malformed: it is retried, never guessed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SCORE_MIN = 0.0
SCORE_MAX = 1.0
REASON_CHARS = 300
"""Longest reason the schema allows: a sentence or two; longer ones cost tokens and time."""

SYSTEM_PROMPT = f"""You judge attempts at a task. Each trajectory below is an independent attempt by an AI \
agent at the same task: the messages it got, the tool calls it made, the tool results, its final answer.

Score every trajectory from {SCORE_MIN:g} to {SCORE_MAX:g}: {SCORE_MAX:g} for an attempt that does the task fully \
and correctly, {SCORE_MIN:g} for one that does nothing useful or gets it wrong. Compare the trajectories with each \
other: a better attempt gets a higher score than a worse one, equally good attempts get equal scores. The \
outcome counts most; then how the agent got there (right tool use, no needless or broken steps). Follow the \
rubric when there is one. For each trajectory give a one-sentence reason, then its score. Answer with the JSON \
object only."""


class MalformedJudgement(ValueError):
    """The judge's answer is not the JSON the schema asks for (the message says what is wrong)."""


@dataclass(frozen=True)
class Score:
    score: float
    """Clipped to [SCORE_MIN, SCORE_MAX]."""
    reason: str
    clipped: bool
    """The judge's number lay outside the range."""


def label(i: int) -> str:
    """The name of the i-th (0-based) trajectory in the prompt and the answer."""
    return f"trajectory_{i + 1}"


def schema(n: int) -> dict[str, Any]:
    """JSON schema of an answer scoring ``n`` trajectories: every label required, nothing else allowed."""
    item = {
        "type": "object",
        "properties": {
            "reason": {"type": "string", "maxLength": REASON_CHARS},
            "score": {"type": "number", "minimum": SCORE_MIN, "maximum": SCORE_MAX},
        },
        "required": ["reason", "score"],
        "additionalProperties": False,
    }
    labels = [label(i) for i in range(n)]
    return {
        "type": "object",
        "properties": {name: item for name in labels},
        "required": labels,
        "additionalProperties": False,
    }


def response_format(n: int) -> dict[str, Any]:
    """The request's ``response_format`` for ``n`` trajectories."""
    return {"type": "json_schema", "json_schema": {"name": "judgement", "schema": schema(n), "strict": True}}


def messages(task: str, trajectories: Sequence[str], rubric: str | None = None) -> list[dict[str, str]]:
    """The chat messages of one judgement: the rules, then the task, the rubric and each trajectory under its label."""
    parts = [f"# Task\n{task.strip()}"]
    if rubric and rubric.strip():
        parts.append(f"# Rubric\n{rubric.strip()}")
    parts.append(f"# Trajectories ({len(trajectories)})")
    parts += [f"## {label(i)}\n{text}" for i, text in enumerate(trajectories)]
    labels = ", ".join(label(i) for i in range(len(trajectories)))
    parts.append(f"Score {labels}: a JSON object with a reason and a score for each.")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(parts)}]


def clip(value: float) -> tuple[float, bool]:
    """``value`` within [SCORE_MIN, SCORE_MAX], and whether it had to be moved."""
    clipped = min(SCORE_MAX, max(SCORE_MIN, value))
    return clipped, clipped != value


def parse(content: str | None, n: int) -> list[Score]:
    """The ``n`` scores of an answer, in label order; ``MalformedJudgement`` says what is wrong with a bad one."""
    if not content or not content.strip():
        raise MalformedJudgement("empty answer")
    try:
        data = json.loads(content)
    except ValueError as exc:
        raise MalformedJudgement(f"not JSON ({exc}): {content[:200]!r}") from None
    if not isinstance(data, dict):
        raise MalformedJudgement(f"expected a JSON object, got {type(data).__name__}")
    scores = []
    for i in range(n):
        name = label(i)
        entry = data.get(name)
        if not isinstance(entry, dict):
            raise MalformedJudgement(f"no object for {name}")
        value = entry.get("score")
        try:
            number = float(value) if isinstance(value, int | float) and not isinstance(value, bool) else math.nan
        except OverflowError:  # an integer past float's range
            number = math.nan
        if not math.isfinite(number):
            raise MalformedJudgement(f"{name}: score {str(value)[:50]} is not a finite number")
        reason = entry.get("reason")
        if not isinstance(reason, str):
            raise MalformedJudgement(f"{name}: reason {reason!r} is not a string")
        score, clipped = clip(number)
        scores.append(Score(score=score, reason=reason[:REASON_CHARS], clipped=clipped))
    return scores
