"""A lean HTTP/1.1 keep-alive transport for the one ``httpx.AsyncClient`` that talks to vLLM.

Why not httpx's default (httpcore): its pool scans every pooled connection on each request and
each response close (and polls each idle socket), so its cost per request grows with the number
of connections; at 64-256 concurrent calls that scan was most of the proxy's CPU. Measured against
it (``upstream_transport: httpx``, the same pool size) in one run, cells alternated, by
``python -m bench.proxy_overhead --seconds 3 --concurrency 1,64,256 --apis chat --transports
lean,httpx`` (2-core Intel Xeon, AVX-512, 2026-11-25, a training run on the same cores): proxy CPU
per recorded chat call, lean / httpx, plain 1.02 / 1.59 ms at c=1, 0.72 / 2.10 at c=64, 0.77 / 3.09
at c=256; streamed 1.30 / 2.36, 1.03 / 8.78, 1.17 / 4.15; req/s 1.5-4.0x (plain) and 2.9-8.8x
(streamed) in lean's favour. So it stays. Here idle
connections wait in a deque per origin: taking the newest is O(1), expired ones are dropped from
the old end, and a connection the server closed is known from the event loop (``eof_received``,
``connection_lost``), not from a poll. Parsing is httptools' C parser (uvicorn's); bodies reach
``aiter_raw`` as the socket delivers them, with flow control (reading pauses past ``HIGH_WATER``).

A server may close an idle keep-alive connection just as a request is written to it (its idle
timer fired first). When a reused connection ends without a single byte of response, the request
goes once more on a fresh connection, as it never reached a handler that answered.

It plugs in below ``httpx.AsyncClient``, so the proxy's code, errors and tests (which swap in an
``httpx.MockTransport``) are unchanged. Failures raise httpx's own exceptions: ``ConnectError``,
``ConnectTimeout``, ``ReadTimeout`` (no byte within the read timeout) and ``RemoteProtocolError``
(a response cut short, a server that closed without answering, bytes that are not HTTP). Writes
are buffered by the event loop; a server that stops reading is caught by the read timeout.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator
from typing import cast

import httptools
import httpx

Origin = tuple[str, str, int]

HIGH_WATER = 512 * 1024
"""Buffered response bytes at which reading from the socket pauses until the consumer catches up."""

_ONE_WRITE = 64 * 1024
"""Bodies up to this size go out in one write with the head (one TCP segment for a small call)."""


class _Disconnected(httpx.RemoteProtocolError):
    """The server closed the connection before sending any byte of the response."""


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection, serving one request at a time."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.closed = False
        self.idle_since = 0.0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head: asyncio.Future[None] | None = None
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.complete = False
        self.error: Exception | None = None
        self.wake: asyncio.Future[None] | None = None
        self.keep_alive = True
        self.received = False
        self.informational = False
        self.head_only = False
        self.aborted = False

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # create_connection makes a stream transport

    def eof_received(self) -> bool | None:
        self.closed = True  # before connection_lost (scheduled later): never hand this one out again
        return None  # close our side too; connection_lost ends or fails the response

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.parser is None or self.complete or self.error is not None:
            return
        if self.aborted:  # closed on our side (the transport shut down) with the response still coming
            self._fail(httpx.RemoteProtocolError("connection closed before the response ended"))
        elif exc is None and self._delimited_by_close():
            self.complete = True  # a body without length or chunking ends where the server closes
            self._wake()
        elif not self.received:
            self._fail(_Disconnected("Server disconnected without sending a response."))
        else:
            self._fail(httpx.RemoteProtocolError("upstream closed the connection before the response ended"))

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # bytes while idle: the server is closing or misbehaving
            self.close()
            return
        if self.complete:  # bytes after the response: the connection's framing is lost
            self.keep_alive = False
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("unexpected protocol upgrade from upstream"))
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"invalid HTTP from upstream: {exc}"))

    def _delimited_by_close(self) -> bool:
        head = self.head
        if head is None or not head.done() or head.cancelled() or head.exception() is not None:
            return False
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" not in names and b"transfer-encoding" not in names

    # -- httptools callbacks (after ``complete`` the parser may be reading a next message that
    #    nobody asked for: it is ignored and the connection is not reused) -------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.complete:
            self.headers.append((name, value))  # httptools hands over whole names and values

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        if self.complete:  # a second response to one request: the server is confused
            self.keep_alive = False
            return
        if self.parser.get_status_code() < 200:  # 1xx (101 raises HttpParserUpgrade): the answer follows
            self.headers = []
            self.informational = True
            return
        self.keep_alive = self.parser.should_keep_alive()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)
        if self.head_only:  # a HEAD response has headers only, whatever its Content-Length says
            self.complete = True
            self._wake()

    def on_body(self, body: bytes) -> None:
        if self.complete:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.complete = True
        self._wake()

    # -- used by the transport -----------------------------------------------------------------

    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def _fail(self, error: Exception) -> None:
        self.error = error
        self.closed = self.aborted = True
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # marked retrieved: nobody may be waiting any more
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def usable(self) -> bool:
        """Open as far as the event loop knows (an idle connection's close shows up as EOF)."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def start(self, head: bytes, body: bytes, *, head_only: bool) -> None:
        if not self.usable():
            raise _Disconnected("Server disconnected without sending a response.")
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.headers, self.chunks, self.buffered, self.error = [], deque(), 0, None
        self.complete = self.received = self.informational = False
        self.keep_alive, self.head_only = True, head_only
        self.head = asyncio.get_running_loop().create_future()
        if len(body) <= _ONE_WRITE:
            self.transport.write(head + body)
        else:  # no copy of a large body; TCP_NODELAY is on, so the head leaves at once either way
            self.transport.write(head)
            self.transport.write(body)

    async def next_chunk(self, read_timeout: float | None) -> bytes | None:
        """The next body bytes, or None at the end of the response."""
        while True:
            if self.chunks:  # everything that has arrived, in one piece: the consumer writes it once
                chunk = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
                self.chunks.clear()
                self.buffered = 0
                self._resume()
                return chunk
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            loop = asyncio.get_running_loop()
            self.wake = loop.create_future()
            timer = loop.call_later(read_timeout, self._timed_out, "sent nothing") if read_timeout is not None else None
            try:
                await self.wake
            finally:
                self.wake = None
                if timer is not None:
                    timer.cancel()

    def _resume(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _timed_out(self, what: str) -> None:
        self._fail(httpx.ReadTimeout(f"upstream {what} within the read timeout"))

    async def response_head(self, read_timeout: float | None) -> None:
        """Wait for the status line and headers."""
        assert self.head is not None
        timer = (
            asyncio.get_running_loop().call_later(read_timeout, self._timed_out, "sent no response headers")
            if read_timeout is not None
            else None
        )
        try:
            await self.head
        finally:
            if timer is not None:
                timer.cancel()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and self.error is None and self.usable()

    def release(self) -> None:
        """Back to idle: a response the consumer left unread may have paused reading."""
        self.parser = None
        self._resume()

    def close(self) -> None:
        self.closed = self.aborted = True
        if self.transport is not None:
            self.transport.close()


class _Body(httpx.AsyncByteStream):
    """A response body streamed off its connection; closing it returns the connection to the pool."""

    def __init__(self, pool: Http1Transport, origin: Origin, conn: _Connection, read_timeout: float | None) -> None:
        self._pool = pool
        self._origin = origin
        self._conn = conn
        self._read_timeout = read_timeout
        self._done = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self._conn.next_chunk(self._read_timeout)) is not None:
            yield chunk

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._pool._release(self._origin, self._conn)


def _encode(request: httpx.Request, body: bytes) -> bytes:
    """The request line and headers. A body always goes with its length: a streamed request body
    (``Transfer-Encoding: chunked`` from httpx) has been read whole by now."""
    headers = request.headers
    raw = headers.raw
    if "transfer-encoding" in headers or (body and "content-length" not in headers):
        raw = [(n, v) for n, v in raw if n.lower() not in (b"transfer-encoding", b"content-length")]
        raw.append((b"Content-Length", b"%d" % len(body)))
    lines = [b"%s %s HTTP/1.1" % (request.method.encode(), request.url.raw_path)]
    lines += [b"%s: %s" % (name, value) for name, value in raw]
    return b"\r\n".join(lines) + b"\r\n\r\n"


class Http1Transport(httpx.AsyncBaseTransport):
    """HTTP/1.1 with keep-alive connection reuse; plain TCP or TLS; no HTTP/2, no proxies.

    Connections in use are not capped (every open stream holds one); ``max_keepalive`` bounds the
    idle ones, and an idle one older than ``keepalive_expiry_s`` (keep it below the server's own
    keep-alive timeout, 5 s for uvicorn) is closed instead of reused.
    """

    def __init__(
        self, *, max_keepalive: int = 512, keepalive_expiry_s: float = 4.0, ssl_context: ssl.SSLContext | None = None
    ) -> None:
        self._idle: dict[Origin, deque[_Connection]] = {}  # oldest left, newest right
        self._idle_count = 0
        self._max_keepalive = max_keepalive
        self._expiry = keepalive_expiry_s
        self._ssl = ssl_context
        self._open: weakref.WeakSet[_Connection] = weakref.WeakSet()  # closed on aclose()

    async def _connect(self, origin: Origin, connect_s: float | None) -> _Connection:
        scheme, host, port = origin
        context = None
        if scheme == "https":
            context = self._ssl = self._ssl or httpx.create_ssl_context()
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(_Connection, host, port, ssl=context, server_hostname=host if context else None),
                connect_s,
            )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _prune(self, idle: deque[_Connection], now: float) -> None:
        """Close idle connections that expired or were closed, from the old end: O(1) per call, amortised."""
        while idle and (idle[0].closed or now - idle[0].idle_since >= self._expiry):
            idle.popleft().close()
            self._idle_count -= 1

    def _checkout(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        if not idle:
            return None
        self._prune(idle, time.monotonic())
        while idle:  # what is left has not expired; the newest is the most likely to be open
            conn = idle.pop()
            self._idle_count -= 1
            if conn.usable():
                return conn
            conn.close()
        return None

    def _release(self, origin: Origin, conn: _Connection) -> None:
        conn.release()
        idle = self._idle.get(origin)
        if idle is None:
            idle = self._idle[origin] = deque()
        now = time.monotonic()
        self._prune(idle, now)
        if not conn.reusable() or self._idle_count >= self._max_keepalive:
            conn.close()
            self._open.discard(conn)
            return
        conn.idle_since = now
        idle.append(conn)
        self._idle_count += 1

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        scheme = url.scheme
        origin: Origin = (scheme, url.host, url.port or (443 if scheme == "https" else 80))
        timeouts = request.extensions.get("timeout", {})
        body = request.content if isinstance(request.stream, httpx.ByteStream) else await request.aread()
        head = _encode(request, body)
        conn = self._checkout(origin)
        if conn is not None:
            try:
                return await self._exchange(origin, conn, request, head, body, timeouts)
            except _Disconnected:
                pass  # the server dropped this idle connection as we reused it: once more, on a new one
        conn = await self._connect(origin, timeouts.get("connect"))
        return await self._exchange(origin, conn, request, head, body, timeouts)

    async def _exchange(
        self,
        origin: Origin,
        conn: _Connection,
        request: httpx.Request,
        head: bytes,
        body: bytes,
        timeouts: dict[str, float | None],
    ) -> httpx.Response:
        """Send the request on ``conn`` and wait for the response head; the body streams after."""
        self._open.add(conn)
        try:
            conn.start(head, body, head_only=request.method == "HEAD")
            await conn.response_head(timeouts.get("read"))
        except BaseException:
            conn.close()
            self._open.discard(conn)
            raise
        assert conn.parser is not None
        version = conn.parser.get_http_version()
        return httpx.Response(
            conn.parser.get_status_code(),
            headers=conn.headers,
            stream=_Body(self, origin, conn, timeouts.get("read")),
            request=request,
            extensions={"http_version": b"HTTP/1.1" if version == "1.1" else f"HTTP/{version}".encode()},
        )

    async def aclose(self) -> None:
        for conn in list(self._open) + [c for idle in self._idle.values() for c in idle]:
            conn.close()
        self._open.clear()
        self._idle.clear()
        self._idle_count = 0
