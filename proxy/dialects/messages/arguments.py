"""A tool call's arguments both ways: chat's arguments text and the Messages ``tool_use`` input.

Input to text (a ``tool_use`` passed back): orjson, compact with UTF-8 kept (``json.dumps`` only
for integers beyond 64 bits). The layout changes nothing, since vLLM parses arguments back into an
object before the chat template renders them and the splicer compares parsed JSON; orjson is an
order of magnitude faster than ``json.dumps`` on the proxy's hot path.

Text to input (the model's answer): arguments that are not a JSON object (malformed, or an array)
become ``{"_raw_arguments": <text>}``, so the agent's tool sees a call it cannot run and answers
with an error the model can learn from, instead of a silent ``{}`` or a failed request; passed
back, such an input is the sampled text again. Empty arguments are ``{}``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

RAW_ARGUMENTS = "_raw_arguments"
"""The key of a tool_use ``input`` that carries arguments text which is not a JSON object."""


def arguments_text(tool_input: dict[str, Any]) -> str:
    """A ``tool_use`` input as chat's arguments text."""
    raw = tool_input.get(RAW_ARGUMENTS)
    if len(tool_input) == 1 and isinstance(raw, str):
        return raw  # our own answer to arguments that were not a JSON object: the sampled text again
    try:
        return orjson.dumps(tool_input).decode()
    except TypeError:  # an integer beyond 64 bits, which orjson does not write
        return json.dumps(tool_input, ensure_ascii=False)


def parsed(text: str) -> dict[str, Any] | None:
    """Arguments text as a JSON object (``{}`` for no text), or None when it is not one."""
    if not text:
        return {}
    try:
        value = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def tool_input(arguments: Any) -> dict[str, Any]:
    """Parsed arguments; text that is not a JSON object is kept whole under ``_raw_arguments``."""
    if isinstance(arguments, dict):
        return arguments
    text = arguments if isinstance(arguments, str) else ("" if arguments is None else str(arguments))
    value = parsed(text)
    return {RAW_ARGUMENTS: text} if value is None else value
