"""The upstream transport on real sockets: small asyncio HTTP servers started here, no mocks.

Each server runs a ``serve(conn)`` coroutine per accepted connection and counts connections, so a
test can tell a reused connection from a new one and see whether the client closed its sockets.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httptools
import httpx
import pytest

from proxy import transport as transport_module
from proxy.transport import Http1Transport
from tests.support.services import free_port


@dataclass
class Request:
    method: bytes
    path: bytes
    headers: dict[bytes, bytes]
    body: bytes


@dataclass
class _Parsing:
    """httptools callbacks for one connection's requests."""

    done: deque[Request] = field(default_factory=deque)
    url: bytes = b""
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: list[bytes] = field(default_factory=list)
    parser: httptools.HttpRequestParser | None = None

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.parser is not None
        self.done.append(Request(self.parser.get_method(), self.url, self.headers, b"".join(self.body)))
        self.url, self.headers, self.body = b"", {}, []


class Conn:
    """The server side of one connection: read whole requests, write raw bytes or responses."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self._parsing = _Parsing()
        self._parsing.parser = httptools.HttpRequestParser(self._parsing)

    async def request(self) -> Request | None:
        """The next request, or None once the client has closed the connection."""
        while not self._parsing.done:
            data = await self.reader.read(65536)
            if not data:
                return None
            assert self._parsing.parser is not None
            self._parsing.parser.feed_data(data)
        return self._parsing.done.popleft()

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def respond(self, body: bytes = b"ok", status: int = 200, headers: bytes = b"") -> None:
        await self.send(b"HTTP/1.1 %d OK\r\nContent-Length: %d\r\n%s\r\n%s" % (status, len(body), headers, body))


Serve = Callable[[Conn], Awaitable[None]]


class Server:
    """A tiny HTTP/1.1 server on a free local port that counts its connections."""

    def __init__(self, serve: Serve) -> None:
        self.serve = serve
        self.accepted = 0
        self.open = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.url = ""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.accepted += 1
        self.open += 1
        try:
            await self.serve(Conn(reader, writer))
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.open -= 1
            self._changed.set()
            self._tasks.discard(task)

    async def start(self) -> None:
        # asyncio's default listen backlog is 100: 200 connects at once would overflow it, and a
        # dropped SYN is retried after 1 s (then 3 s), past the transport's 2 s connect timeout.
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=1024)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def wait_open(self, count: int, timeout_s: float = 5.0) -> None:
        """Wait until exactly ``count`` connections are open (the client's closes take a loop turn)."""
        try:
            async with asyncio.timeout(timeout_s):
                while self.open != count:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            raise AssertionError(f"{self.open} connections open, expected {count}") from None


@asynccontextmanager
async def serving(serve: Serve, *, keepalive_expiry_s: float = 4.0) -> AsyncIterator[tuple[Server, httpx.AsyncClient]]:
    server = Server(serve)
    await server.start()
    client = httpx.AsyncClient(
        transport=Http1Transport(keepalive_expiry_s=keepalive_expiry_s),
        base_url=server.url,
        timeout=httpx.Timeout(5.0, connect=2.0),
    )
    try:
        yield server, client
    finally:
        await client.aclose()
        await server.stop()


async def answer_each(conn: Conn) -> None:
    """Keep-alive: answer every request with its own path."""
    while (request := await conn.request()) is not None:
        await conn.respond(b"ok " + request.path)


# -- connecting ------------------------------------------------------------------------------------


async def test_a_refused_connection_is_a_connect_error() -> None:
    async with httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(f"http://127.0.0.1:{free_port()}/")


async def test_a_connect_that_hangs_is_a_connect_timeout() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepts: once its queue is full, new SYNs are dropped
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        try:
            filler.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        fillers.append(filler)
    try:
        async with httpx.AsyncClient(transport=Http1Transport(), timeout=httpx.Timeout(5.0, connect=0.3)) as client:
            started = time.monotonic()
            with pytest.raises(httpx.ConnectTimeout):
                await client.get(f"http://127.0.0.1:{port}/")
            assert time.monotonic() - started < 3.0
    finally:
        for sock in [listener, *fillers]:
            sock.close()


# -- failures while waiting or reading -----------------------------------------------------------


async def test_no_response_within_the_read_timeout_is_a_read_timeout() -> None:
    async def silent(conn: Conn) -> None:
        await conn.request()
        await conn.request()  # silent until the client hangs up

    async with serving(silent) as (server, client):
        started = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/", timeout=httpx.Timeout(5.0, read=0.2))
        assert time.monotonic() - started < 3.0
        await server.wait_open(0)  # the timed-out connection is closed, not pooled


async def test_a_body_that_stalls_is_a_read_timeout() -> None:
    async def stalls(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await conn.request()

    async with serving(stalls) as (_, client):
        async with client.stream("GET", "/", timeout=httpx.Timeout(5.0, read=0.2)) as response:
            assert response.status_code == 200
            with pytest.raises(httpx.ReadTimeout):
                await response.aread()


async def test_a_body_cut_short_is_a_remote_protocol_error() -> None:
    async def truncates(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")

    async with serving(truncates) as (_, client):
        with pytest.raises(httpx.RemoteProtocolError, match="before the response ended"):
            await client.get("/")


async def test_a_server_that_closes_without_answering_is_a_remote_protocol_error() -> None:
    async def hangs_up(conn: Conn) -> None:
        await conn.request()

    async with serving(hangs_up) as (server, client):
        with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
            await client.get("/")
        assert server.accepted == 1  # a new connection is not retried: the server really refused


async def test_bytes_that_are_not_http_are_a_remote_protocol_error() -> None:
    async def garbage(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"SMTP ready\r\n\r\n")

    async with serving(garbage) as (_, client):
        with pytest.raises(httpx.RemoteProtocolError, match="invalid HTTP"):
            await client.get("/")


# -- body framing ------------------------------------------------------------------------------------


async def test_chunked_bodies_split_anywhere_across_writes() -> None:
    pieces = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
        b"lo\r\n6\r",
        b"\n world",
        b"\r\n0\r",
        b"\n\r\n",
    ]

    async def chunked(conn: Conn) -> None:
        while await conn.request() is not None:
            for piece in pieces:
                await conn.send(piece)
                await asyncio.sleep(0.01)

    async with serving(chunked) as (server, client):
        for _ in range(2):
            response = await client.get("/")
            assert (response.status_code, response.content) == (200, b"hello world")
        assert server.accepted == 1  # the terminal chunk ended the message: the connection is reused


async def test_a_body_without_length_ends_with_the_connection() -> None:
    async def close_delimited(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\n\r\npart one, ")
        await asyncio.sleep(0.05)
        await conn.send(b"part two")

    async with serving(close_delimited) as (server, client):
        for _ in range(2):
            assert (await client.get("/")).content == b"part one, part two"
        assert server.accepted == 2


async def test_a_body_without_length_cut_by_our_own_close_is_an_error_not_a_short_body() -> None:
    async def close_delimited_then_waits(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\n\r\npart one")
        await conn.request()

    async with serving(close_delimited_then_waits) as (_, client):
        async with client.stream("GET", "/") as response:
            chunks = response.aiter_raw()
            assert await chunks.__anext__() == b"part one"
            await client.aclose()  # shuts the transport down under the open stream
            with pytest.raises(httpx.RemoteProtocolError, match="closed before the response ended"):
                await chunks.__anext__()


async def test_head_responses_have_no_body_and_keep_the_connection() -> None:
    async def heads(conn: Conn) -> None:
        while (request := await conn.request()) is not None:
            if request.method == b"HEAD":
                await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
            else:
                await conn.respond(b"hello")

    async with serving(heads) as (server, client):
        head = await client.head("/", timeout=httpx.Timeout(5.0, read=1.0))
        assert (head.status_code, head.headers["content-length"], head.content) == (200, "5", b"")
        assert (await client.get("/")).content == b"hello"
        assert server.accepted == 1


async def test_informational_responses_are_skipped() -> None:
    async def early_hints(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n")
        await conn.respond(b"final", headers=b"X-Final: yes\r\n")

    async with serving(early_hints) as (_, client):
        response = await client.get("/")
        assert (response.status_code, response.content) == (200, b"final")
        assert response.headers["x-final"] == "yes" and "link" not in response.headers


async def test_bytes_after_a_response_make_the_connection_unusable() -> None:
    async def trailing_junk(conn: Conn) -> None:
        while await conn.request() is not None:
            await conn.send(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\njunk"
            )

    async with serving(trailing_junk) as (server, client):
        assert [(await client.get("/")).content for _ in range(2)] == [b"ok", b"ok"]
        assert server.accepted == 2


# -- keep-alive ---------------------------------------------------------------------------------------


async def test_keep_alive_reuses_one_connection() -> None:
    async with serving(answer_each) as (server, client):
        assert [(await client.get(f"/{i}")).content for i in range(3)] == [b"ok /0", b"ok /1", b"ok /2"]
        assert server.accepted == 1


async def test_a_connection_closed_while_idle_is_replaced() -> None:
    async def one_answer_then_close(conn: Conn) -> None:
        await conn.request()
        await conn.respond(b"ok")  # keep-alive by HTTP/1.1 default, then closed while idle

    async with serving(one_answer_then_close) as (server, client):
        assert (await client.get("/")).content == b"ok"
        await server.wait_open(0)
        await asyncio.sleep(0.05)  # the client's loop sees the close (the race is the next test)
        assert (await client.get("/")).content == b"ok"
        assert server.accepted == 2


async def test_a_connection_closed_as_the_next_request_arrives_is_retried_on_a_new_one() -> None:
    """The server's idle timer fires as our request lands: it reads it and hangs up, unanswered."""

    async def closes_after_one(conn: Conn) -> None:
        await conn.request()
        await conn.respond(b"ok")
        await conn.request()

    async with serving(closes_after_one) as (server, client):
        assert (await client.get("/")).content == b"ok"
        assert (await client.get("/")).content == b"ok"
        assert server.accepted == 2


async def test_idle_connections_past_the_expiry_are_closed_not_reused() -> None:
    async with serving(answer_each, keepalive_expiry_s=0.1) as (server, client):
        await client.get("/")
        await asyncio.sleep(0.2)
        await client.get("/")
        assert server.accepted == 2
        await server.wait_open(1)  # the expired one was closed when the pool next looked


async def test_an_unread_body_that_paused_reading_does_not_stall_the_next_request() -> None:
    body = b"x" * (transport_module.HIGH_WATER + 1)  # crosses the mark only with its last byte

    async def big(conn: Conn) -> None:
        while await conn.request() is not None:
            await conn.respond(body)

    async with serving(big) as (server, client):
        async with client.stream("GET", "/") as response:
            assert response.status_code == 200
            await asyncio.sleep(0.2)  # all of it arrives; the consumer leaves it unread
        again = await client.get("/", timeout=httpx.Timeout(5.0, read=1.0))
        assert again.content == body and server.accepted == 1


async def test_an_abandoned_stream_closes_its_connection() -> None:
    async def endless(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await conn.request()

    async with serving(endless) as (server, client):
        async with client.stream("GET", "/") as response:
            assert await response.aiter_raw().__anext__() == b"first"
        await server.wait_open(0)


# -- streaming and flow control ------------------------------------------------------------------


async def test_a_streamed_body_is_readable_before_the_server_finishes() -> None:
    first_read = asyncio.Event()

    async def waits_for_the_reader(conn: Conn) -> None:
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await asyncio.wait_for(first_read.wait(), 5.0)  # the rest only once the client has the start
        await conn.send(b"4\r\nrest\r\n0\r\n\r\n")

    async with serving(waits_for_the_reader) as (_, client):
        async with client.stream("GET", "/", timeout=httpx.Timeout(5.0, read=3.0)) as response:
            chunks = response.aiter_raw()
            assert await chunks.__anext__() == b"first"
            first_read.set()
            assert b"".join([chunk async for chunk in chunks]) == b"rest"


async def test_a_slow_consumer_pauses_the_socket_instead_of_buffering() -> None:
    """64 MiB offered to a consumer that stops reading: the server gets stuck after what the
    socket buffers hold (kernel plus ``HIGH_WATER``), and every byte still arrives afterwards."""
    block, blocks = b"y" * (1 << 20), 64
    sent = 0

    async def firehose(conn: Conn) -> None:
        nonlocal sent
        await conn.request()
        await conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(block) * blocks))
        for _ in range(blocks):
            await conn.send(block)
            sent += len(block)

    async with serving(firehose) as (_, client):
        async with client.stream("GET", "/") as response:
            chunks = response.aiter_raw()
            received = len(await chunks.__anext__())
            await asyncio.sleep(0.5)  # the consumer stalls; an unbounded reader would take it all
            stalled_at = sent
            received += sum([len(chunk) async for chunk in chunks])
    assert stalled_at < 24 * len(block), f"the server got {stalled_at} bytes out to a stalled consumer"
    assert received == len(block) * blocks


# -- load and request bodies ------------------------------------------------------------------------


async def test_many_concurrent_requests_succeed_and_their_connections_are_pooled_then_closed() -> None:
    async def slow_answers(conn: Conn) -> None:
        while (request := await conn.request()) is not None:
            await asyncio.sleep(0.05)  # long enough that all 200 are in flight together
            await conn.respond(b"ok " + request.path)

    async with serving(slow_answers) as (server, client):
        for _ in range(2):
            responses = await asyncio.gather(*(client.get(f"/{i}") for i in range(200)))
            assert [r.content for r in responses] == [b"ok /%d" % i for i in range(200)]
        assert server.accepted == 200  # the second wave ran on the first wave's connections
        assert server.open == 200
        await client.aclose()
        await server.wait_open(0)  # closing the client closes every pooled socket


async def test_request_bodies_of_megabytes_arrive_whole() -> None:
    async def digest(conn: Conn) -> None:
        while (request := await conn.request()) is not None:
            te = request.headers.get(b"transfer-encoding", b"-")
            await conn.respond(
                b"%d %s %s %s"
                % (
                    len(request.body),
                    request.headers.get(b"content-length", b"-"),
                    te,
                    hashlib.sha256(request.body).hexdigest().encode(),
                )
            )

    payload = bytes(range(256)) * (5 * 4096)  # 5 MiB

    async def pieces() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 1 << 20):
            yield payload[i : i + (1 << 20)]

    expected = b"%d %d - %s" % (len(payload), len(payload), hashlib.sha256(payload).hexdigest().encode())
    async with serving(digest) as (server, client):
        assert (await client.post("/", content=payload)).content == expected
        assert (await client.post("/", content=pieces())).content == expected  # streamed: sent with its length
        assert server.accepted == 1
