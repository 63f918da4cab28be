"""The depth limit every body and upstream answer passes (``proxy.depth.too_deep``)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.depth import MAX_DEPTH, too_deep


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@pytest.mark.parametrize("depth", [1, MAX_DEPTH - 1, MAX_DEPTH])
def test_up_to_the_limit_passes(depth: int) -> None:
    value = nested(depth)
    assert not too_deep(orjson.dumps(value), value)


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 254, 300, 1000])
def test_past_the_limit_is_refused(depth: int) -> None:
    value = nested(depth)
    raw = b"[" * depth  # the bracket count only decides whether to measure; the value decides
    assert too_deep(raw, value)


def test_many_brackets_but_shallow_passes() -> None:
    """An answer with log-probs: thousands of containers, seven levels."""
    value = {"choices": [{"logprobs": {"content": [{"bytes": [1, 2], "top_logprobs": []} for _ in range(2000)]}}]}
    raw = orjson.dumps(value)
    assert raw.count(b"[") > MAX_DEPTH
    assert not too_deep(raw, value)


def test_brackets_inside_strings_do_not_count() -> None:
    value = {"content": "[" * 1000 + "{" * 1000}
    assert not too_deep(orjson.dumps(value), value)


def test_the_input_is_not_changed() -> None:
    value = nested(MAX_DEPTH + 5)
    before = orjson.dumps(value)
    too_deep(before, value)
    assert orjson.dumps(value) == before
