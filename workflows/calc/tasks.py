"""Calculator tasks: arithmetic a 135M model cannot do in its head, solved with tool calls.

Every task has a reference solution, one ``Step`` (``a op b``) per calculator call, and a gold
answer (the last step's value). Kinds:

- ``mul``: ``What is 37 * 48?`` (two-digit by two-digit), one step;
- ``word1``: a one-step word problem (gain, loss or equal groups): the operation is in the words;
- ``expr2``: ``What is (37 + 48) * 6?`` or ``What is 37 * 6 - 48?``: two steps, the second on the
  first one's result (which only the calculator's reply holds);
- ``word2``: a two-step word problem (gain then loss);
- ``chain``: ``Start with 37. Add 12, multiply by 3, subtract 45, ... What is the result?``: the
  long-horizon variant (``generate(chain=N)``), N steps each on the previous one's result, an
  episode of N + 1 calls.

A task's split is decided by a stable hash of its numbers and kind (a fifth goes to ``test``), so
a held-out task is never trained on, whatever the seed. Tasks are drawn with ``seed`` from each
kind's space and interleaved by the mix's weights, so ``--limit K`` on the test split always means
the same K tasks.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Split = Literal["train", "test"]
Op = Literal["+", "-", "*"]
OPS: tuple[Op, ...] = ("+", "-", "*")
NAMES_OF: dict[Op, str] = {"+": "add", "-": "subtract", "*": "multiply"}
"""The calculator's operation names: the model's own words for the operations (words, not symbols:
under the argument grammar a symbol is one token among many punctuation tokens, and with "minus"
it often sampled 'm', 'in', 'us', reaching for "multiply")."""
OP_OF: dict[str, Op] = {name: op for op, name in NAMES_OF.items()}
TEST_SHARE = 5
"""One task in TEST_SHARE goes to the test split."""
SIZES: dict[Split, int] = {"train": 2000, "test": 200}
"""Tasks per split by default (the spaces are far larger; the draw is seeded)."""


@dataclass(frozen=True)
class Step:
    a: int
    op: Op
    b: int

    @property
    def value(self) -> int:
        return apply(self.a, self.op, self.b)

    def matches(self, a: int, op: str, b: int) -> bool:
        """The same computation (operands in either order for + and *)."""
        if op != self.op:
            return False
        return (a, b) == (self.a, self.b) or (op != "-" and (b, a) == (self.a, self.b))


@dataclass(frozen=True)
class CalcTask:
    id: str
    kind: str
    question: str
    steps: tuple[Step, ...]
    """The reference solution: one calculator call per step, in order."""

    @property
    def answer(self) -> int:
        return self.steps[-1].value


def apply(a: int, op: str, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operation {op!r}")


def _held_out(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % TEST_SHARE == 0


NAMES = ("Tom", "Sara", "Ali", "Mia", "Ben", "Lena", "Omar", "Zoe")
ITEMS = ("apples", "pencils", "marbles", "stickers", "books", "cookies")

Draw = Callable[[random.Random], tuple[str, str, tuple[Step, ...]]]
"""One random task of a kind: (key: the numbers, decides the split and the id; question; steps)."""


def _mul(r: random.Random) -> tuple[str, str, tuple[Step, ...]]:
    a, b = r.randint(12, 99), r.randint(12, 99)
    return f"{a}*{b}", f"What is {a} * {b}?", (Step(a, "*", b),)


def _word1(r: random.Random) -> tuple[str, str, tuple[Step, ...]]:
    name, item, shape = r.choice(NAMES), r.choice(ITEMS), r.choice(("gain", "loss", "groups"))
    if shape == "gain":
        a, b = r.randint(12, 99), r.randint(12, 99)
        question = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
        step = Step(a, "+", b)
    elif shape == "loss":
        a = r.randint(40, 99)
        b = r.randint(11, a - 10)
        question = f"{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?"
        step = Step(a, "-", b)
    else:
        a, b = r.randint(3, 19), r.randint(12, 49)
        question = f"{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have?"
        step = Step(a, "*", b)
    return f"{shape}:{name}:{item}:{a}:{b}", question, (step,)


def _expr2(r: random.Random) -> tuple[str, str, tuple[Step, ...]]:
    if r.random() < 0.5:
        a, b, c = r.randint(12, 99), r.randint(12, 99), r.randint(3, 9)
        first = Step(a, "+", b)
        return f"({a}+{b})*{c}", f"What is ({a} + {b}) * {c}?", (first, Step(first.value, "*", c))
    a, b, c = r.randint(12, 99), r.randint(3, 9), r.randint(12, 99)
    first = Step(a, "*", b)
    return f"{a}*{b}-{c}", f"What is {a} * {b} - {c}?", (first, Step(first.value, "-", c))


def _word2(r: random.Random) -> tuple[str, str, tuple[Step, ...]]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    a, b = r.randint(12, 99), r.randint(12, 99)
    c = r.randint(11, a + b - 10)
    first = Step(a, "+", b)
    question = f"{name} has {a} {item}, gets {b} more, then gives away {c}. How many {item} does {name} have now?"
    return f"{name}:{item}:{a}:{b}:{c}", question, (first, Step(first.value, "-", c))


CHAIN = "chain"
CHAIN_MAX = 1000
"""A chain multiplies only while the product stays below this (so its numbers, repeated on every tape
line, stay short), and it never goes below zero."""


def _chain(steps: int) -> Draw:
    """Chains of ``steps`` steps: add or subtract a two-digit number, or multiply by 2 to 5."""

    def draw(r: random.Random) -> tuple[str, str, tuple[Step, ...]]:
        value = r.randint(12, 99)
        start, out = value, []
        for _ in range(steps):
            op = r.choice(OPS)
            if op == "*" and value * 5 >= CHAIN_MAX:
                op = "-"
            b = r.randint(2, 5) if op == "*" else r.randint(11, 99)
            if op == "-" and b > value:
                op = "+"
            out.append(Step(value, op, b))
            value = apply(value, op, b)
        said = ", ".join(say(s) for s in out)
        key = f"{start}" + "".join(f"{s.op}{s.b}" for s in out)
        return key, f"Start with {start}. {said[0].upper()}{said[1:]}. What is the result?", tuple(out)

    return draw


def say(step: Step) -> str:
    """A chain step in words: ``add 12``, ``subtract 45``, ``multiply by 3``."""
    return f"{NAMES_OF[step.op]} {'by ' if step.op == '*' else ''}{step.b}"


KINDS: dict[str, Draw] = {"mul": _mul, "word1": _word1, "expr2": _expr2, "word2": _word2}
MIXES: dict[str, dict[str, int]] = {
    "default": {"mul": 1, "word1": 2, "expr2": 1, "word2": 1},
    "one_step": {"mul": 1, "word1": 1},
    "two_step": {"expr2": 1, "word2": 1},
}
"""Named task mixes: kind -> weight (see the workflow README for each kind's measured baseline)."""


def _draw(kind: str, split: Split, count: int, seed: int, draw: Draw | None = None) -> list[CalcTask]:
    """``count`` distinct tasks of ``kind`` in ``split``, drawn with ``seed`` (by ``draw``, default
    the kind's)."""
    rng = random.Random(f"calc:{seed}:{kind}")
    seen: set[str] = set()
    out: list[CalcTask] = []
    attempts = 0
    while len(out) < count:
        attempts += 1
        if attempts > 200 * count + 1000:
            raise ValueError(f"kind {kind!r}: could not draw {count} distinct {split} tasks")
        key, question, steps = (draw or KINDS[kind])(rng)
        if key in seen or _held_out(f"{kind}:{key}") != (split == "test"):
            continue
        seen.add(key)
        out.append(CalcTask(id=f"calc/{kind}/{key}", kind=kind, question=question, steps=steps))
    return out


def generate(
    split: Split, *, mix: str = "default", size: int | None = None, seed: int = 0, chain: int = 0
) -> list[CalcTask]:
    """A deterministic list of ``size`` tasks (default ``SIZES[split]``), kinds interleaved by weight;
    ``chain`` > 0: chained tasks of that many steps instead of the mix."""
    if mix not in MIXES:
        raise ValueError(f"unknown calc mix {mix!r}; choose one of {sorted(MIXES)}")
    weights = MIXES[mix]
    total = size if size is not None else SIZES[split]
    if chain:
        if chain < 2:
            raise ValueError(f"chain must be 0 (off) or >= 2 steps, got {chain}")
        return _draw(CHAIN, split, total, seed, _chain(chain))
    rounds = -(-total // sum(weights.values()))
    pools = {kind: _draw(kind, split, rounds * w, seed) for kind, w in weights.items()}
    out: list[CalcTask] = []
    for r in range(rounds):
        for kind, weight in weights.items():
            out.extend(pools[kind][r * weight : (r + 1) * weight])
    return out[:total]
