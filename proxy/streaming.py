"""A streamed model call's relay: server-sent events forwarded as they arrive, the last one held back.

Each upstream event is read (``capture.py`` keeps the ids and log-probs), then passed to the client
as it came, stripped of what the proxy added, or translated into the client's API
(``dialects/``); what arrived together leaves together, in one write. The final event
(``data: [DONE]``, or the dialect's closing events) is sent only after the call's record committed.
A stream that fails (the upstream's error event, a cut connection, no ``[DONE]``, no choices, a
refused record) ends with an error event in the client's API instead, and is recorded as failed.
A client that leaves mid-stream still gets its call recorded (status 499), by a task held in
``Relay.background`` and drained on shutdown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson

from proxy.answers import READ_ERRORS, check_chunk, json_object, malformed, reading, unreadable
from proxy.capture import StreamCapture, Wants, strip_for_client, usage_only
from proxy.dialects.base import EventStream
from proxy.errors import EpisodeClosed, FlywheelError, RecordingFailed, UpstreamError
from proxy.recording import Recording
from proxy.upstream import map_transport_error

SSE_DONE = b"data: [DONE]\n\n"

Close = Callable[[], Awaitable[None]]
"""Releases the upstream stream (its connection, or a spliced stream's generators)."""


def sse_events(chunks: AsyncGenerator[dict[str, Any], None]) -> tuple[AsyncIterator[bytes], Close]:
    """Chunks as the SSE bytes vLLM's chat route would send (a spliced stream), and their close."""

    async def events() -> AsyncGenerator[bytes, None]:
        async for chunk in chunks:
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
        yield SSE_DONE

    relayed = events()

    async def close() -> None:
        await relayed.aclose()
        await chunks.aclose()

    return relayed, close


class StreamRelay:
    """One streamed call's events from upstream to client, captured and recorded on the way.

    ``events``: the client's API when the call is in another one (``dialects/``); None: chat or
    completion chunks, relayed as they came.
    """

    def __init__(
        self,
        record: Recording,
        *,
        wants: Wants,
        events: EventStream | None,
        background: set[asyncio.Task[Any]],
    ) -> None:
        self.record = record
        self.kind = record.kind
        self.wants = wants
        self.events = events
        self.background = background
        self.capture = StreamCapture(record.kind) if record.episode_id is not None else None
        self.buffer = b""
        self.ttft_ms: float | None = None
        self.saw_done = False
        self.streamed_choices = False
        """A parsed stream carried at least one choice (a stream without any is malformed)."""
        self.error: FlywheelError | None = None
        self.ended = False
        """The call's ending is written (answered, failed, or refused by the store) and its last event
        is on its way: a client leaving now leaves nothing to record (a second record would say 499
        for a call already stored as failed)."""

    async def relay(self, upstream: AsyncIterator[bytes], close: Close) -> AsyncIterator[bytes]:
        """Forward events as they arrive, capturing them; [DONE] only after the record commits."""
        finished = False
        try:
            try:
                async for raw in upstream:
                    out = self._take(raw)
                    if out is not None:
                        yield out
                    if self.error is not None:  # the stream ends at the upstream's error: nothing after it is read
                        break
            except httpx.TransportError as exc:
                assert self.record.replica is not None
                self.error = map_transport_error(exc, self.record.replica)
            except FlywheelError as exc:  # a spliced stream's token API call failed
                self.error = exc
            yield await self._last_event()
            finished = True
        finally:
            await close()
            if not (finished or self.ended) and self.record.episode_id is not None:
                # the client went away mid-stream: keep what happened
                _spawn(self.background, self._record_left())

    def _take(self, raw: bytes) -> bytes | None:
        """What to write for the bytes that arrived: the complete events among them, in one write."""
        self.buffer += raw
        if b"\r" in self.buffer:
            self.buffer = self.buffer.replace(b"\r\n", b"\n")
        buffer, start, outs = self.buffer, 0, []
        while (cut := buffer.find(b"\n\n", start)) >= 0:
            out, content, done, upstream_error = self._event(buffer[start:cut])
            start = cut + 2
            self.saw_done = self.saw_done or done
            if upstream_error is not None:
                self.error = upstream_error
                break
            if content and self.ttft_ms is None:
                self.ttft_ms = (time.perf_counter() - self.record.t0) * 1000
                self.record.metrics.ttft.observe(self.ttft_ms / 1000)
            if out is not None:
                outs.append(out)
        self.buffer = buffer[start:]
        if not outs:
            return None
        return outs[0] if len(outs) == 1 else b"".join(outs)  # what arrived together leaves together

    async def _last_event(self) -> bytes:
        """The stream's end: its final event once the record committed, else an error event (the
        call recorded as failed)."""
        error = self.error
        if error is None and not self.saw_done:
            error = UpstreamError("upstream closed the stream before [DONE]", code="incomplete_stream")
        if error is None and not self.streamed_choices and (self.capture is not None or self.events is not None):
            error = malformed(self.record.source, "a stream without choices")
        captured, ending = None, b""
        if error is None:
            try:
                with reading(self.record.source):  # what the record and the last event read, before the record
                    captured = self.capture.result() if self.capture is not None else None
                    ending = SSE_DONE if self.events is None else self.events.done()
            except UpstreamError as exc:
                error = exc
        if error is not None:
            await self.record.failed(error)
            self.ended = True
            return self._error_event(error)
        if self.record.episode_id is not None:
            try:
                await self.record.answered(captured, self.ttft_ms)
            except (RecordingFailed, EpisodeClosed) as exc:  # a refused record is an error event, no [DONE]
                self.record.observe(exc.status_code, captured)
                self.ended = True
                return self._error_event(exc)
        self.record.observe(200, captured)
        self.ended = True
        return ending

    async def _record_left(self) -> None:
        captured = self.capture.result() if self.capture is not None else None
        await self.record.left(captured, self.ttft_ms, "client disconnected mid-stream")

    def _error_event(self, error: FlywheelError) -> bytes:
        """The event that ends a failed stream, in the client's API."""
        if self.events is not None:
            return self.events.error(error)
        return b"data: " + error.json() + b"\n\n"

    def _event(self, event: bytes) -> tuple[bytes | None, bool, bool, FlywheelError | None]:
        """(bytes for the client, carried content, was [DONE], upstream error)."""
        data = None
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
        if data is None:  # comments, event names: pass through (a dialect's client gets only its events)
            return (event + b"\n\n" if self.events is None else None), False, False, None
        if data == b"[DONE]":
            return None, False, True, None
        capture, source = self.capture, self.record.source
        if capture is None and self.events is None:
            return event + b"\n\n", True, False, None
        try:
            chunk = check_chunk(json_object(data, source), self.kind, source)
        except UpstreamError as exc:
            return None, False, False, exc
        if "error" in chunk and "choices" not in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            return (
                None,
                False,
                False,
                UpstreamError(f"upstream error mid-stream: {err.get('message')}", code="upstream_error"),
            )
        self.streamed_choices = self.streamed_choices or bool(chunk.get("choices"))
        try:
            content = capture.feed(chunk) if capture is not None else bool(chunk.get("choices"))
            translated = self.events.chunk(chunk) if self.events is not None else None
        except READ_ERRORS as exc:
            return None, False, False, unreadable(source, exc)
        except UpstreamError as exc:
            return None, False, False, exc
        if self.events is not None:
            return translated or None, content, False, None
        if usage_only(chunk, self.wants):  # the proxy asked for it (to count the ids), not the client
            return None, content, False, None
        if strip_for_client(chunk, self.wants, self.kind):
            return b"data: " + orjson.dumps(chunk) + b"\n\n", content, False, None
        return event + b"\n\n", content, False, None


def _spawn(tasks: set[asyncio.Task[Any]], coro: Any) -> None:
    """Run ``coro`` past its request, held in ``tasks`` so it is not collected and is drained on shutdown."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
