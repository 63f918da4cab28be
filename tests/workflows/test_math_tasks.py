"""The bundled math tasks: deterministic, held-out by fact, in the documented mix; GSM8K JSONL."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from workflows.math.tasks import generate, load_jsonl


def fact(problem_id: str) -> str:
    return problem_id.split("/p")[0]


def test_generation_is_deterministic_and_held_out() -> None:
    train, test = generate("train"), generate("test")
    assert train == generate("train") and test == generate("test")
    assert len(test) == 210 and len(train) == 960
    assert not {fact(p.id) for p in train} & {fact(p.id) for p in test}
    assert len({p.id for p in train}) == len(train)


def test_the_default_mix_follows_its_weights() -> None:
    kinds = Counter(p.kind for p in generate("test"))
    assert kinds == {"add1": 63, "sub1": 63, "mul1": 42, "word1": 42}


def test_answers_are_right() -> None:
    for problem in generate("train")[:200]:
        if problem.kind in {"add1", "sub1", "mul1"}:
            a, op, b = problem.id.split("/")[2].replace("+", " + ").replace("-", " - ").replace("*", " * ").split()
            assert int(problem.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_unknown_mix_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown math mix 'nope'"):
        generate("train", mix="nope")


def test_gsm8k_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "gsm.jsonl"
    rows = [
        {"question": "Ann has 3 pens and buys 1,000 more. How many?", "answer": "3 + 1000 = 1003\n#### 1,003"},
        {"question": "Half of 3?", "answer": "#### 3/2"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    problems = load_jsonl(path)
    assert [(p.answer, p.kind) for p in problems] == [("1003", "jsonl"), ("3/2", "jsonl")]
    assert problems[0].id == "jsonl/gsm/1"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"question": "q", "answer": "no marker"}', r"gsm.jsonl:2: need string fields"),
        ("not json", r"gsm.jsonl:2: not JSON"),
        ('{"question": "q", "answer": "#### "}', r"gsm.jsonl:2: empty final answer"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        load_jsonl(path)
