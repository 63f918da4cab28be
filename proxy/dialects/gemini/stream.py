"""vLLM's chat completion chunks in, Gemini's streamed ``GenerateContentResponse`` chunks out.

With ``alt=sse`` (what Gemini CLI and the google-genai SDKs ask for) each chunk is one server-sent
event, ``data: <json>``, framed with CRLF as Google's servers frame it; without it, the chunks are
the elements of one JSON array sent piece by piece (Google's other stream form). Thought and text
parts are sent as their deltas arrive; function calls are sent whole once their choice finishes
(their arguments must be complete to be parsed), so the chunks' parts join into exactly the
candidate the non-streamed answer gives (``translation.py``). The last chunk (``done``) carries
every candidate's ``finishReason`` and the ``usageMetadata``: it is what the relay holds back until
the record committed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from proxy.dialects.gemini.answer import finish_reason, function_call, logprobs_result, usage_metadata
from proxy.dialects.gemini.errors import error_body
from proxy.dialects.shared import derived_id, reasoning_of
from proxy.errors import FlywheelError

if TYPE_CHECKING:
    from proxy.dialects.gemini.translation import GeminiTranslation


class _Choice:
    """One candidate as it streams: its tool calls gathered until it finishes, its finish reason."""

    __slots__ = ("calls", "finish")

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, Any]] | None = {}  # None once sent, at the finish
        self.finish: Any = None


class GeminiStream:
    """vLLM chat chunks in, Gemini chunks out (one ``GenerateContentResponse`` per upstream chunk
    that carries something to show; the finish reasons and usage from ``done``)."""

    __slots__ = ("_t", "_choices", "_sent", "_prompt", "_completion")

    def __init__(self, translation: GeminiTranslation) -> None:
        self._t = translation
        self._choices: dict[int, _Choice] = {}
        self._sent = False
        self._prompt: int | None = None
        self._completion: int | None = None

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        usage = chunk.get("usage")
        if usage:
            self._prompt = usage.get("prompt_tokens")
            self._completion = usage.get("completion_tokens")
        if self._prompt is None and isinstance(chunk.get("prompt_token_ids"), list):
            self._prompt = len(chunk["prompt_token_ids"])
        candidates = []
        for choice in chunk.get("choices") or ():
            found = self._candidate(choice)
            if found is not None:
                candidates.append(found)
        return self._frame(self._response(candidates)) if candidates else b""

    def done(self) -> bytes:
        candidates = []
        for index in sorted(self._choices) or [0]:
            state = self._choices.get(index) or _Choice()
            parts = self._calls(index, state)
            candidates.append(
                {
                    "content": {"parts": parts, "role": "model"},
                    "finishReason": finish_reason(state.finish),
                    "index": index,
                }
            )
        final = self._response(candidates)
        final["usageMetadata"] = usage_metadata(self._prompt, self._completion)
        return self._frame(final, last=True)

    def error(self, error: FlywheelError) -> bytes:
        return self._frame(error_body(error), last=True)

    def _candidate(self, choice: dict[str, Any]) -> dict[str, Any] | None:
        index = choice.get("index", 0)
        index = index if type(index) is int else 0
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _Choice()
        delta = choice.get("delta") or {}
        parts: list[dict[str, Any]] = []
        reasoning = reasoning_of(delta)
        if reasoning and self._t.asked.thoughts:
            parts.append({"text": reasoning, "thought": True})
        text = delta.get("content")
        if text:
            parts.append({"text": text})
        for fragment in delta.get("tool_calls") or ():
            _merge(state, fragment)
        if choice.get("finish_reason") is not None:
            state.finish = choice["finish_reason"]
            parts += self._calls(index, state)
        out: dict[str, Any] = {"content": {"parts": parts, "role": "model"}, "index": index}
        asked = self._t.asked
        items = (choice.get("logprobs") or {}).get("content") if asked.logprobs else None
        if items:
            out["logprobsResult"] = logprobs_result(items, choice.get("token_ids"), asked.top_logprobs)
        return out if parts or items else None

    def _calls(self, index: int, state: _Choice) -> list[dict[str, Any]]:
        """The choice's function call parts, once (at its finish, or at the end of the stream)."""
        calls, state.calls = state.calls, None
        parts = []
        for k in sorted(calls or ()):
            call = calls[k]  # type: ignore[index]
            ident = call["id"] or derived_id("call", self._t.response_id, index * 1000 + k)
            parts.append(function_call(ident, call["name"], "".join(call["arguments"])))
        return parts

    def _response(self, candidates: list[dict[str, Any]]) -> dict[str, Any]:
        return {"candidates": candidates, "modelVersion": self._t.model, "responseId": self._t.response_id}

    def _frame(self, data: dict[str, Any], *, last: bool = False) -> bytes:
        body = orjson.dumps(data)
        if self._t.sse:
            return b"data: " + body + b"\r\n\r\n"
        opening = b"," if self._sent else b"["
        self._sent = True
        return opening + b"\r\n" + body + (b"]" if last else b"")


def _merge(state: _Choice, fragment: dict[str, Any]) -> None:
    if state.calls is None:
        return  # after the finish: vLLM sends nothing more for a choice
    index = fragment.get("index", 0)
    call = state.calls.get(index)
    if call is None:
        call = state.calls[index] = {"id": None, "name": "", "arguments": []}
    if fragment.get("id"):
        call["id"] = fragment["id"]
    function = fragment.get("function") or {}
    if function.get("name"):
        call["name"] += function["name"]
    if function.get("arguments"):
        call["arguments"].append(function["arguments"])
