"""vLLM's chat completion chunks in, the Responses API's server-sent events out.

The documented event sequence: ``response.created`` and ``response.in_progress`` with the first
chunk; then one open output item at a time, in arrival order (``output_item.added``, its content
part, its deltas, its done events); ``sequence_number`` counts from 0. ``done`` ends with
``response.completed`` (or ``response.incomplete``), sent once the call's record committed.
The items are the ones the whole answer gives (``translation.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy.dialects.responses.answer import logprobs_of, usage_of
from proxy.dialects.shared import reasoning_of, sse
from proxy.errors import FlywheelError

if TYPE_CHECKING:
    from proxy.dialects.responses.translation import ResponsesTranslation


def _event(kind: str, seq: int, payload: dict[str, Any]) -> bytes:
    return sse(kind.encode(), {"type": kind, "sequence_number": seq, **payload})


class ResponsesStream:
    """Chat chunks in, Responses events out: one open output item at a time, in arrival order."""

    def __init__(self, translation: ResponsesTranslation) -> None:
        self.t = translation
        self.seq = 0
        self.started = False
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.open_kind: str | None = None  # reasoning | message | call
        self.open_call: int | None = None  # the chat tool-call index of the open function_call
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if not self.started:
            self.started = True
            self.t.started(chunk)
            skeleton = self.t.envelope("in_progress", [], None)
            self._emit(out, "response.created", response=skeleton)
            self._emit(out, "response.in_progress", response=skeleton)
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = reasoning_of(delta)
            if reasoning:
                self._open(out, "reasoning")
                self.text.append(reasoning)
                self._emit(
                    out,
                    "response.reasoning_text.delta",
                    item_id=self._item_id(),
                    output_index=self._index(),
                    content_index=0,
                    delta=reasoning,
                )
            if delta.get("content"):
                self._open(out, "message")
                logprobs = logprobs_of((choice.get("logprobs") or {}).get("content") or []) if self.t.logprobs else []
                self.text.append(delta["content"])
                self.logprobs.extend(logprobs)
                self._emit(
                    out,
                    "response.output_text.delta",
                    item_id=self._item_id(),
                    output_index=self._index(),
                    content_index=0,
                    delta=delta["content"],
                    logprobs=logprobs,
                )
            for fragment in delta.get("tool_calls") or ():
                self._call_fragment(out, fragment)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def done(self) -> bytes:
        out: list[bytes] = []
        self._close(out)
        incomplete = self.finish_reason == "length"
        final = self.t.envelope(
            "incomplete" if incomplete else "completed", self.output, usage_of(self.usage), incomplete
        )
        self._emit(out, "response.incomplete" if incomplete else "response.completed", response=final)
        return b"".join(out)

    def error(self, error: FlywheelError) -> bytes:
        return _event(
            "error", self.seq, {"code": error.code or error.type, "message": error.message, "param": error.param}
        )

    def _emit(self, out: list[bytes], kind: str, **payload: Any) -> None:
        out.append(_event(kind, self.seq, payload))
        self.seq += 1

    def _item_id(self) -> str:
        assert self.open is not None
        item_id: str = self.open["id"]
        return item_id

    def _index(self) -> int:
        return len(self.output)

    def _call_fragment(self, out: list[bytes], fragment: dict[str, Any]) -> None:
        """A tool-call delta: a new index opens its function_call item; its arguments are a delta."""
        index = fragment.get("index", 0)
        if self.open_kind != "call" or self.open_call != index:
            self._open(out, "call", fragment)
            self.open_call = index
        function = fragment.get("function") or {}
        assert self.open is not None
        if function.get("name") and not self.open["name"]:  # a server that names the call late
            self.open.update(self.t.named(function["name"]))
        if function.get("arguments"):
            self.text.append(function["arguments"])
            self._emit(
                out,
                "response.function_call_arguments.delta",
                item_id=self._item_id(),
                output_index=self._index(),
                delta=function["arguments"],
            )

    def _open(self, out: list[bytes], kind: str, fragment: dict[str, Any] | None = None) -> None:
        if self.open_kind == kind and kind != "call":
            return
        self._close(out)
        self.open_kind = kind
        if kind == "reasoning":
            item = self.t.reasoning_item(self.t.item_id("rs"), "", "in_progress")
            self._added(out, item, {"type": "reasoning_text", "text": ""})
        elif kind == "message":
            item = self.t.message_item(self.t.item_id("msg"), "", "in_progress", None)
            self._added(out, item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
        else:
            assert fragment is not None
            self.open = self.t.call_item(
                self.t.item_id("fc"),
                {"id": fragment.get("id"), "function": {"name": (fragment.get("function") or {}).get("name")}},
                "in_progress",
            )
            self._emit(out, "response.output_item.added", output_index=self._index(), item=self.open)

    def _added(self, out: list[bytes], item: dict[str, Any], part: dict[str, Any]) -> None:
        """Open an item that has one content part: the item (content still empty), then its part."""
        item["content"] = []
        self.open = item
        self._emit(out, "response.output_item.added", output_index=self._index(), item=item)
        self._emit(
            out,
            "response.content_part.added",
            item_id=item["id"],
            output_index=self._index(),
            content_index=0,
            part=part,
        )

    def _close(self, out: list[bytes]) -> None:
        """Finish the open item: its done events, then it joins the output."""
        if self.open is None:
            return
        item_id, index, text = self.open["id"], self._index(), "".join(self.text)
        status = "incomplete" if self.finish_reason == "length" else "completed"
        if self.open_kind == "reasoning":
            self._emit(
                out, "response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text
            )
            self._emit(
                out,
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part={"type": "reasoning_text", "text": text},
            )
            item = self.t.reasoning_item(item_id, text, status)
        elif self.open_kind == "message":
            logprobs = self.logprobs if self.t.logprobs else []
            self._emit(
                out,
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=logprobs,
            )
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            self._emit(
                out, "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part
            )
            item = self.t.message_item(item_id, text, status, logprobs if self.t.logprobs else None)
        else:
            self._emit(
                out,
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                name=self.open["name"],
                arguments=text,
            )
            item = {**self.open, "arguments": text, "status": "completed"}
        self._emit(out, "response.output_item.done", output_index=index, item=item)
        self.output.append(item)
        self.open, self.open_kind, self.open_call, self.text, self.logprobs = None, None, None, [], []
