"""What the proxy requires of an upstream answer before it reads, records or translates it.

vLLM's answers are foreign input. One that breaks the shape below is the upstream's fault and
becomes ``UpstreamError`` (502 ``upstream_error``, code ``malformed_answer``) before anything is
recorded as a success: the call is recorded as failed, like any other upstream error, and the
client gets its API's error shape, never a 500 and never a record of a success it did not get.

Checked, because the capture, the store, the metrics and the dialects read it:

- the answer (or stream chunk) is a JSON object; a whole answer has a non-empty ``choices`` list;
- the answer nests at most ``MAX_DEPTH`` levels (the proxy writes it again: orjson stops at 254);
- each choice is an object; ``index`` an integer; ``finish_reason`` a string or null; ``token_ids``
  and ``prompt_token_ids`` lists of integers; ``logprobs`` an object whose sampled-token logprobs
  are numbers; ``message``/``delta`` an object with string ``content`` and a list of tool-call
  objects, or ``text`` a string (completions);
- ``usage`` counts are integers in [0, 2**31): Prometheus counters refuse negative increments,
  and the store's count columns are 32-bit on PostgreSQL (one bad value would fail its whole
  batch of records).

``reading`` is the backstop for the rest: an answer that passes these checks but still breaks a
reader is a 502 too, logged with its traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson

from proxy.errors import UpstreamError
from proxy.schemas import MAX_DEPTH, MAX_STORED_INT, too_deep
from proxy.vocabulary import CallKind

log = logging.getLogger("flywheel.answers")

_USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def malformed(source: str, what: str) -> UpstreamError:
    return UpstreamError(f"upstream {source} sent a malformed answer: {what}", code="malformed_answer")


def json_object(content: bytes, source: str) -> dict[str, Any]:
    """``content`` parsed as a JSON object, or the 502 for an answer that is not one."""
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        raise malformed(source, "invalid JSON") from None
    if not isinstance(data, dict):
        raise malformed(source, f"a JSON {type(data).__name__}, not an object")
    if too_deep(content, data):
        raise malformed(source, f"nested deeper than {MAX_DEPTH} levels")
    return data


def check_answer(data: dict[str, Any], kind: CallKind, source: str) -> dict[str, Any]:
    """``data``, a whole (non-streamed) answer, if it has the shape the proxy reads."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise malformed(source, "no choices")
    _check(data, kind, "message", source)
    return data


def check_chunk(data: Any, kind: CallKind, source: str) -> dict[str, Any]:
    """``data``, one stream chunk, if it has the shape the proxy reads (``choices`` may be empty)."""
    if not isinstance(data, dict):
        raise malformed(source, f"a stream chunk that is a JSON {type(data).__name__}, not an object")
    if data.get("choices") is not None and not isinstance(data["choices"], list):
        raise malformed(source, "'choices' is not a list")
    _check(data, kind, "delta", source)
    return data


@contextmanager
def reading(source: str) -> Iterator[None]:
    """Turn a reader's failure on an answer that passed the checks into the upstream's 502."""
    try:
        yield
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        log.exception("an upstream answer broke its reader", extra={"replica": source})
        raise malformed(source, f"unreadable ({type(exc).__name__}: {exc})") from exc


def _check(data: dict[str, Any], kind: CallKind, body_key: str, source: str) -> None:
    what = _ids(data.get("prompt_token_ids"), "prompt_token_ids") or _usage(data.get("usage"))
    for i, choice in enumerate(data.get("choices") or ()):
        what = what or _choice(choice, kind, body_key, f"choices[{i}]")
    if what:
        raise malformed(source, what)


def _usage(usage: Any) -> str | None:
    if usage is None:
        return None
    if not isinstance(usage, dict):
        return "'usage' is not an object"
    for key in _USAGE_COUNTS:
        count = usage.get(key)
        if count is not None and not (type(count) is int and 0 <= count <= MAX_STORED_INT):
            return f"usage.{key} is {count!r}, not an integer in [0, {MAX_STORED_INT}]"
    return None


def _ids(ids: Any, where: str) -> str | None:
    if ids is None or (isinstance(ids, list) and all(type(i) is int for i in ids)):
        return None
    return f"{where} is not a list of integers"


def _choice(choice: Any, kind: CallKind, body_key: str, where: str) -> str | None:
    if not isinstance(choice, dict):
        return f"{where} is not an object"
    if "index" in choice and type(choice["index"]) is not int:  # choices are keyed and sorted by it
        return f"{where}.index is not an integer"
    if not _optional(choice.get("finish_reason"), str):
        return f"{where}.finish_reason is not a string"
    what = (
        _ids(choice.get("token_ids"), f"{where}.token_ids")
        or _ids(choice.get("prompt_token_ids"), f"{where}.prompt_token_ids")
        or _logprobs(choice.get("logprobs"), kind, f"{where}.logprobs")
    )
    if what:
        return what
    if kind != "chat":
        return None if _optional(choice.get("text"), str) else f"{where}.text is not a string"
    return _message(choice.get(body_key), f"{where}.{body_key}")


def _logprobs(logprobs: Any, kind: CallKind, where: str) -> str | None:
    if logprobs is None:
        return None
    if not isinstance(logprobs, dict):
        return f"{where} is not an object"
    if kind == "chat":
        items = logprobs.get("content")
        if items is None:
            return None
        if isinstance(items, list) and all(isinstance(x, dict) and _number(x.get("logprob")) for x in items):
            return None
        return f"{where}.content is not a list of {{logprob: number}}"
    values = logprobs.get("token_logprobs")
    if values is None or (isinstance(values, list) and all(x is None or _number(x) for x in values)):
        return None
    return f"{where}.token_logprobs is not a list of numbers"


def _message(message: Any, where: str) -> str | None:
    if message is None:
        return None
    if not isinstance(message, dict):
        return f"{where} is not an object"
    for key in ("content", "reasoning_content", "reasoning"):
        if not _optional(message.get(key), str):
            return f"{where}.{key} is not a string"
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if not isinstance(calls, list):
        return f"{where}.tool_calls is not a list"
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or ("index" in call and type(call["index"]) is not int)
            or not _optional(call.get("id"), str)
            or not (
                function is None
                or isinstance(function, dict)
                and _optional(function.get("name"), str)
                and _optional(function.get("arguments"), str)
            )
        ):
            return f"{where}.tool_calls[{j}] is not a tool call"
    return None


def _optional(value: Any, kind: type) -> bool:
    return value is None or (type(value) is kind)


def _number(value: Any) -> bool:
    return type(value) is int or type(value) is float
