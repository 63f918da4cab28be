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

from contract.schemas import MAX_STORED_INT
from contract.vocabulary import CallKind
from proxy.depth import MAX_DEPTH, too_deep
from proxy.errors import UpstreamError

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


READ_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError)
"""What a reader raises on an answer that passed the checks but is still not what it expects."""


def unreadable(source: str, exc: Exception) -> UpstreamError:
    """The upstream's 502 for an answer that broke its reader (logged with the traceback)."""
    log.exception("an upstream answer broke its reader", extra={"replica": source})
    return malformed(source, f"unreadable ({type(exc).__name__}: {exc})")


@contextmanager
def reading(source: str) -> Iterator[None]:
    """Turn a reader's failure on an answer that passed the checks into the upstream's 502.
    (Per stream chunk the relay catches ``READ_ERRORS`` itself: a context manager per chunk costs.)"""
    try:
        yield
    except READ_ERRORS as exc:
        raise unreadable(source, exc) from exc


def _check(data: dict[str, Any], kind: CallKind, body_key: str, source: str) -> None:
    # Every check returns what is wrong (None if nothing), and the place is named only then: this
    # runs on every chunk of every stream, where building each field's name up front cost more
    # than the checks themselves.
    what = _usage(data.get("usage"))
    if not _ids(data.get("prompt_token_ids")):
        what = "prompt_token_ids is not a list of integers"
    for i, choice in enumerate(data.get("choices") or ()):
        if what:
            break
        wrong = _choice(choice, kind, body_key)
        if wrong:
            what = f"choices[{i}]{wrong}"
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


def _ids(ids: Any) -> bool:
    return ids is None or (type(ids) is list and all(type(i) is int for i in ids))


def _choice(choice: Any, kind: CallKind, body_key: str) -> str | None:
    """What is wrong with one choice, as a suffix of its place (``.token_ids is ...``)."""
    if type(choice) is not dict:
        return " is not an object"
    if "index" in choice and type(choice["index"]) is not int:  # choices are keyed and sorted by it
        return ".index is not an integer"
    if not _optional(choice.get("finish_reason"), str):
        return ".finish_reason is not a string"
    for key in ("token_ids", "prompt_token_ids"):
        if not _ids(choice.get(key)):
            return f".{key} is not a list of integers"
    wrong = _logprobs(choice.get("logprobs"), kind)
    if wrong:
        return f".logprobs{wrong}"
    if kind != "chat":
        return None if _optional(choice.get("text"), str) else ".text is not a string"
    wrong = _message(choice.get(body_key))
    return f".{body_key}{wrong}" if wrong else None


def _logprobs(logprobs: Any, kind: CallKind) -> str | None:
    if logprobs is None:
        return None
    if type(logprobs) is not dict:
        return " is not an object"
    if kind == "chat":
        items = logprobs.get("content")
        if items is None:
            return None
        if type(items) is list and all(type(x) is dict and _number(x.get("logprob")) for x in items):
            return None
        return ".content is not a list of {logprob: number}"
    values = logprobs.get("token_logprobs")
    if values is None or (type(values) is list and all(x is None or _number(x) for x in values)):
        return None
    return ".token_logprobs is not a list of numbers"


def _message(message: Any) -> str | None:
    if message is None:
        return None
    if type(message) is not dict:
        return " is not an object"
    for key in ("content", "reasoning_content", "reasoning"):
        if not _optional(message.get(key), str):
            return f".{key} is not a string"
    calls = message.get("tool_calls")
    if calls is None:
        return None
    if type(calls) is not list:
        return ".tool_calls is not a list"
    for j, call in enumerate(calls):
        function = call.get("function") if type(call) is dict else None
        if (
            type(call) is not dict
            or ("index" in call and type(call["index"]) is not int)
            or not _optional(call.get("id"), str)
            or not (
                function is None
                or type(function) is dict
                and _optional(function.get("name"), str)
                and _optional(function.get("arguments"), str)
            )
        ):
            return f".tool_calls[{j}] is not a tool call"
    return None


def _optional(value: Any, kind: type) -> bool:
    return value is None or (type(value) is kind)


def _number(value: Any) -> bool:
    return type(value) is int or type(value) is float
