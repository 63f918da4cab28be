"""vLLM's chat completion chunks in, the Messages API's server-sent events out.

Thinking and text blocks are streamed as their deltas arrive (a block closes when the other kind
starts). Tool calls are sent whole (start, one ``input_json_delta``, stop) once the choice
finishes: their arguments must be checked before the client's SDK parses them, and the events then
assemble into exactly the ``Message`` the non-streamed answer gives (``translation.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import orjson

from proxy.dialects.messages.arguments import RAW_ARGUMENTS, parsed
from proxy.dialects.messages.errors import error_body
from proxy.dialects.shared import new_id, reasoning_of, sse
from proxy.errors import FlywheelError

if TYPE_CHECKING:
    from proxy.dialects.messages.translation import MessagesTranslation


class _Call:
    """One streamed tool call, gathered until the choice finishes."""

    __slots__ = ("id", "name", "arguments")

    def __init__(self) -> None:
        self.id: str | None = None
        self.name = ""
        self.arguments: list[str] = []


class MessagesStream:
    """vLLM chat chunks in, Messages events out.

    Thinking and text blocks are streamed as their deltas arrive (a block closes when the other
    kind starts); tool_use blocks follow, each whole, when the choice finishes. ``message_delta``
    (stop reason, output tokens) and ``message_stop`` come from ``done``.
    """

    __slots__ = (
        "_t",
        "_started",
        "_index",
        "_open",
        "_calls",
        "_tool_use",
        "_finish",
        "_matched",
        "_prompt",
        "_completion",
    )

    def __init__(self, translation: MessagesTranslation) -> None:
        self._t = translation
        self._started = False
        self._index = -1
        self._open: Literal["text", "thinking"] | None = None  # the block that takes deltas
        self._calls: dict[int, _Call] | None = {}  # None once sent, at the finish
        self._tool_use = False
        self._finish: Any = None
        self._matched: Any = None
        self._prompt: int | None = None
        self._completion: int | None = None

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if not self._started:
            out.append(self._start(chunk))
        usage = chunk.get("usage")
        if usage:
            self._prompt = usage.get("prompt_tokens")
            self._completion = usage.get("completion_tokens")
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = reasoning_of(delta)
            if reasoning:
                self._delta("thinking", reasoning, out)
            text = delta.get("content")
            if text:
                self._delta("text", text, out)
            for fragment in delta.get("tool_calls") or ():
                self._merge(fragment)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
                self._matched = choice.get("stop_reason")
                self._send_calls(out)
        return b"".join(out)

    def done(self) -> bytes:
        out: list[bytes] = []
        if not self._started:
            out.append(self._start(None))
        self._send_calls(out)
        self._close(out)
        stop_reason, stop_sequence = self._t.stop(self._finish, self._matched, self._tool_use)
        usage: dict[str, int] = {"output_tokens": self._completion if type(self._completion) is int else 0}
        if type(self._prompt) is int:
            usage["input_tokens"] = self._prompt
        out.append(
            sse(
                b"message_delta",
                {
                    "type": "message_delta",
                    "usage": usage,
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                },
            )
        )
        out.append(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        return b"".join(out)

    def error(self, error: FlywheelError) -> bytes:
        return sse(b"error", error_body(error))

    def _start(self, chunk: dict[str, Any] | None) -> bytes:
        self._started = True
        ids = chunk.get("prompt_token_ids") if chunk else None
        message: dict[str, Any] = {
            "id": self._t.response_id,
            "type": "message",
            "role": "assistant",
            "model": self._t.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(ids) if ids else 0, "output_tokens": 0},
        }
        return sse(b"message_start", {"type": "message_start", "message": message})

    def _close(self, out: list[bytes]) -> None:
        if self._open is not None:
            out.append(sse(b"content_block_stop", {"type": "content_block_stop", "index": self._index}))
            self._open = None

    def _block(self, block: dict[str, Any], out: list[bytes]) -> None:
        self._index += 1
        out.append(
            sse(b"content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})
        )

    def _delta(self, kind: Literal["text", "thinking"], text: str, out: list[bytes]) -> None:
        if self._open != kind:
            self._close(out)
            self._open = kind
            self._block(
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""},
                out,
            )
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        out.append(sse(b"content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}))

    def _merge(self, fragment: dict[str, Any]) -> None:
        if self._calls is None:
            return  # after the finish: vLLM sends nothing more for a choice
        index = fragment.get("index", 0)
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = _Call()
        if fragment.get("id"):
            call.id = fragment["id"]
        function = fragment.get("function") or {}
        if function.get("name"):
            call.name += function["name"]
        if function.get("arguments"):
            call.arguments.append(function["arguments"])

    def _send_calls(self, out: list[bytes]) -> None:
        calls, self._calls = self._calls, None
        if not calls:
            return
        self._close(out)
        self._tool_use = True
        for i in sorted(calls):
            call = calls[i]
            self._block({"type": "tool_use", "id": call.id or new_id("toolu"), "name": call.name, "input": {}}, out)
            text = "".join(call.arguments)
            value = parsed(text)
            partial = orjson.dumps({RAW_ARGUMENTS: text}).decode() if value is None else text if value else ""
            if partial:
                delta = {"type": "input_json_delta", "partial_json": partial}
                out.append(
                    sse(b"content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
                )
            out.append(sse(b"content_block_stop", {"type": "content_block_stop", "index": self._index}))
