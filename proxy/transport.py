"""A lean HTTP/1.1 keep-alive transport for the one ``httpx.AsyncClient`` that talks to vLLM.

Why not httpx's default (httpcore): its pool scans every pooled connection on each request and
each response close (and polls each idle socket), so its cost per request grows with the number
of connections; at 64-256 concurrent calls that scan was most of the proxy's CPU. Here idle
connections wait in a stack per origin: taking one is O(1), and a connection the server closed
is known from the event loop (``connection_lost``), not from a poll. Parsing is httptools' C
parser (uvicorn's); bodies reach ``aiter_raw`` as the socket delivers them, with flow control.

It plugs in below ``httpx.AsyncClient``, so the proxy's code, errors and tests (which swap in an
``httpx.MockTransport``) are unchanged. Failures raise httpx's own exceptions: ``ConnectError``,
``ConnectTimeout``, ``ReadTimeout`` (no byte for the read timeout) and ``RemoteProtocolError``.
"""

from __future__ import annotations

import asyncio
import ssl
import time
import weakref
from collections import deque
from collections.abc import AsyncIterator

import httptools
import httpx

Origin = tuple[str, str, int]

HIGH_WATER = 512 * 1024
"""Buffered response bytes at which reading from the socket pauses until the consumer catches up."""


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

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.parser is not None and not self.complete and self._delimited_by_close():
            self.complete = True  # a body without length or chunking ends where the connection does
            self._wake()
        elif self.parser is not None and not self.complete:
            self._fail(httpx.RemoteProtocolError("upstream closed the connection before the response ended")
                       if self.head is not None and self.head.done()
                       else httpx.RemoteProtocolError("Server disconnected without sending a response."))

    def data_received(self, data: bytes) -> None:
        if self.parser is None:  # bytes while idle: the server is closing or misbehaving
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            return
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

    # -- httptools callbacks ---------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))  # httptools hands over whole names and values

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.keep_alive = self.parser.should_keep_alive()
        if self.head is not None and not self.head.done():
            self.head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # -- used by the transport -----------------------------------------------------------------

    def _wake(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    def _fail(self, error: Exception) -> None:
        self.error = error
        self.closed = True
        if self.head is not None and not self.head.done():
            self.head.set_exception(error)
            self.head.exception()  # marked retrieved: nobody may be waiting any more
        self._wake()
        if self.transport is not None:
            self.transport.close()

    def start(self, data: bytes) -> None:
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.headers, self.chunks, self.buffered, self.complete, self.error = [], deque(), 0, False, None
        self.head = asyncio.get_running_loop().create_future()
        self.transport.write(data)

    async def next_chunk(self, read_timeout: float | None) -> bytes | None:
        """The next body bytes, or None at the end of the response."""
        while True:
            if self.chunks:  # everything that has arrived, in one piece: the consumer writes it once
                chunk = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
                self.chunks.clear()
                self.buffered = 0
                if self.paused and self.transport is not None:
                    self.paused = False
                    self.transport.resume_reading()
                return chunk
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            loop = asyncio.get_running_loop()
            self.wake = loop.create_future()
            timer = loop.call_later(read_timeout, self._timed_out, "sent nothing") if read_timeout else None
            try:
                await self.wake
            finally:
                self.wake = None
                if timer is not None:
                    timer.cancel()

    def _timed_out(self, what: str) -> None:
        self._fail(httpx.ReadTimeout(f"upstream {what} within the read timeout"))

    async def response_head(self, read_timeout: float | None) -> None:
        """Wait for the status line and headers."""
        assert self.head is not None
        timer = (asyncio.get_running_loop().call_later(read_timeout, self._timed_out, "sent no response headers")
                 if read_timeout else None)
        try:
            await self.head
        finally:
            if timer is not None:
                timer.cancel()

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed and self.error is None

    def close(self) -> None:
        self.closed = True
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


class Http1Transport(httpx.AsyncBaseTransport):
    """HTTP/1.1 with keep-alive connection reuse; plain TCP or TLS; no HTTP/2, no proxies."""

    def __init__(self, *, max_keepalive: int = 512, keepalive_expiry_s: float = 4.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._idle: dict[Origin, list[_Connection]] = {}
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
                loop.create_connection(_Connection, host, port, ssl=context,
                                       server_hostname=host if context else None), connect_s)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {host}:{port} timed out") from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _checkout(self, origin: Origin) -> _Connection | None:
        stack = self._idle.get(origin)
        now = time.monotonic()
        while stack:
            conn = stack.pop()
            self._idle_count -= 1
            if not conn.closed and now - conn.idle_since < self._expiry:
                return conn
            conn.close()
        return None

    def _release(self, origin: Origin, conn: _Connection) -> None:
        conn.parser = None
        if not conn.reusable() or self._idle_count >= self._max_keepalive:
            conn.close()
            self._open.discard(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(origin, []).append(conn)
        self._idle_count += 1

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        scheme = url.scheme
        origin: Origin = (scheme, url.host, url.port or (443 if scheme == "https" else 80))
        timeouts = request.extensions.get("timeout", {})
        body = request.content if isinstance(request.stream, httpx.ByteStream) else await request.aread()
        headers = request.headers
        lines = [b"%s %s HTTP/1.1" % (request.method.encode(), url.raw_path)]
        lines += [b"%s: %s" % (name, value) for name, value in headers.raw]
        if body and "content-length" not in headers and "transfer-encoding" not in headers:
            lines.append(b"content-length: %d" % len(body))
        data = b"\r\n".join(lines) + b"\r\n\r\n" + body

        conn = self._checkout(origin) or await self._connect(origin, timeouts.get("connect"))
        self._open.add(conn)
        try:
            conn.start(data)
            await conn.response_head(timeouts.get("read"))
        except BaseException:
            conn.close()
            self._open.discard(conn)
            raise
        assert conn.parser is not None
        response = httpx.Response(conn.parser.get_status_code(), headers=conn.headers,
                                  stream=_Body(self, origin, conn, timeouts.get("read")),
                                  extensions={"http_version": b"HTTP/1.1"}, request=request)
        return response

    async def aclose(self) -> None:
        for conn in list(self._open) + [c for stack in self._idle.values() for c in stack]:
            conn.close()
        self._open.clear()
        self._idle.clear()
        self._idle_count = 0
