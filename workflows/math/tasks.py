"""Math tasks: a bundled deterministic generator, and GSM8K-format JSONL read from a path.

The generator enumerates each kind's whole problem space and sends a fixed fifth of it (by a stable
hash of the problem) to the held-out ``test`` split, so a test problem is never seen in training,
whatever the seed or the number of episodes. The default mix (``basic``) is sized for
SmolLM2-135M-Instruct: one-digit arithmetic and one-step word problems, where it is right about a
third of the time greedily and less when sampled, so GRPO has both headroom and within-group
variance (see the workflow README for the measured figures).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Split = Literal["train", "test"]
TEST_SHARE = 5
"""One problem in TEST_SHARE goes to the test split."""


@dataclass(frozen=True)
class MathProblem:
    id: str
    kind: str
    question: str
    answer: str
    """The gold final answer as text (an integer for generated problems, anything math-verify reads for JSONL)."""


def _held_out(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % TEST_SHARE == 0


# -- generated kinds ------------------------------------------------------------------------------

PHRASINGS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?", "Calculate {a} {word} {b}.")
"""Each arithmetic fact is asked in every phrasing; the split is decided by the fact (its numbers),
so a test fact is never trained on in any phrasing."""
WORDS = {"+": "plus", "-": "minus", "*": "times"}


def _facts(
    op: str, pairs: Iterator[tuple[int, int]], value: Callable[[int, int], int]
) -> Iterator[tuple[str, str, str, int]]:
    for a, b in pairs:
        for n, phrasing in enumerate(PHRASINGS):
            yield f"{a}{op}{b}", f"{a}{op}{b}/p{n}", phrasing.format(a=a, b=b, op=op, word=WORDS[op]), value(a, b)


def _add1() -> Iterator[tuple[str, str, str, int]]:
    return _facts("+", ((a, b) for a in range(10) for b in range(10)), lambda a, b: a + b)


def _sub1() -> Iterator[tuple[str, str, str, int]]:
    pairs = ((a, b) for a in range(1, 19) for b in range(1, 10) if 0 <= a - b <= 9)
    return _facts("-", pairs, lambda a, b: a - b)


def _mul1() -> Iterator[tuple[str, str, str, int]]:
    return _facts("*", ((a, b) for a in range(2, 10) for b in range(2, 10)), lambda a, b: a * b)


def _add21() -> Iterator[tuple[str, str, str, int]]:
    return _facts("+", ((a, b) for a in range(10, 100) for b in range(1, 10)), lambda a, b: a + b)


def _add2() -> Iterator[tuple[str, str, str, int]]:
    return _facts("+", ((a, b) for a in range(10, 100) for b in range(10, 100)), lambda a, b: a + b)


NAMES = ("Tom", "Sara", "Ali", "Mia", "Ben", "Lena", "Omar", "Zoe")
ITEMS = ("apples", "pencils", "marbles", "stickers", "books", "cookies")


def _word1() -> Iterator[tuple[str, str, str, int]]:
    """One-step word problems with one-digit numbers: gains, losses, and equal groups."""
    for n, name in enumerate(NAMES):
        item = ITEMS[n % len(ITEMS)]
        for a in range(1, 10):
            for b in range(1, 10):
                key = f"gain:{name}:{a}:{b}"
                yield (
                    key,
                    key,
                    f"{name} has {a} {item}. {name} gets {b} more. How many {item} does {name} have now?",
                    a + b,
                )
                if b <= a:
                    key = f"loss:{name}:{a}:{b}"
                    yield (
                        key,
                        key,
                        (f"{name} had {a} {item} and gave away {b}. How many {item} does {name} have left?"),
                        a - b,
                    )
                if 2 <= a <= 5 and 2 <= b <= 5:
                    key = f"groups:{name}:{a}:{b}"
                    yield (
                        key,
                        key,
                        (f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?"),
                        a * b,
                    )


Generator = Callable[[], Iterator[tuple[str, str, str, int]]]
"""Yields (fact key: decides the split, problem key: unique id, question, answer) for a whole space."""
KINDS: dict[str, Generator] = {
    "add1": _add1,
    "sub1": _sub1,
    "mul1": _mul1,
    "add21": _add21,
    "add2": _add2,
    "word1": _word1,
}
MIXES: dict[str, dict[str, int]] = {
    "basic": {"add1": 3, "sub1": 3, "mul1": 2, "word1": 2},
    "hard": {"add2": 2, "mul1": 1, "word1": 1},
}
"""Named task mixes: kind -> weight. ``basic`` is the default (see the module docstring)."""


def _kind_problems(kind: str, split: Split) -> list[MathProblem]:
    out = []
    for fact, key, question, answer in KINDS[kind]():
        if _held_out(f"{kind}:{fact}") == (split == "test"):
            out.append(MathProblem(id=f"math/{kind}/{key}", kind=kind, question=question, answer=str(answer)))
    return out


def generate(split: Split, *, mix: str = "basic", size: int | None = None, seed: int = 0) -> list[MathProblem]:
    """A deterministic list of problems for ``split``: the mix's kinds interleaved by weight.

    ``size`` caps the list (default: as many as the scarcest kind allows at its weight); the order
    is fixed by ``seed``, so ``--limit K`` on the test split always means the same K problems.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown math mix {mix!r}; choose one of {sorted(MIXES)}")
    weights = MIXES[mix]
    pools = {}
    for kind in weights:
        pool = _kind_problems(kind, split)
        random.Random(f"{seed}:{split}:{kind}").shuffle(pool)
        pools[kind] = pool
    rounds = min(len(pools[k]) // w for k, w in weights.items())
    out: list[MathProblem] = []
    for r in range(rounds):
        for kind, weight in weights.items():
            out.extend(pools[kind][r * weight : (r + 1) * weight])
    return out[:size] if size is not None else out


def load_jsonl(path: Path, split_name: str = "jsonl") -> list[MathProblem]:
    """Read GSM8K-format JSONL: ``{"question": ..., "answer": "... #### 42"}`` per line.

    The gold answer is the text after the last ``####`` (commas dropped); a line without one, or
    without a question, is an error naming the line, never a silently skipped problem.
    """
    problems = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not JSON ({exc.msg})") from exc
            question, answer = row.get("question"), row.get("answer")
            if not isinstance(question, str) or not isinstance(answer, str) or "####" not in answer:
                raise ValueError(f"{path}:{n}: need string fields 'question' and 'answer' with '#### <final>'")
            final = answer.rsplit("####", 1)[1].strip().replace(",", "")
            if not final:
                raise ValueError(f"{path}:{n}: empty final answer after '####'")
            problems.append(
                MathProblem(
                    id=str(row.get("id") or f"{split_name}/{path.stem}/{n}"),
                    kind="jsonl",
                    question=question,
                    answer=final,
                )
            )
    if not problems:
        raise ValueError(f"{path}: no problems")
    return problems
