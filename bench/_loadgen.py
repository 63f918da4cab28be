"""A closed-loop HTTP/1.1 load generator that costs the machine as little as it can.

Why not httpx/aiohttp: on 2 cores a Python client spends about as much CPU per request as the proxy
it measures, and then the benchmark measures the client. Here every connection is a raw asyncio
protocol on uvloop over a keep-alive socket; requests are pre-built bytes; responses go through
httptools' C parser, and only the status and the last bytes of the body are kept (enough to tell a
stream that ended with its API's last event, ``data: [DONE]`` for chat, from one that ended with
an error event). The same
generator measures the direct baseline and the proxy, so the two are comparable.

Each connection is one simulated agent: it sends its request, waits for the whole answer, sends
the next (closed loop), so concurrency is exactly the number of connections. Benches that play
whole episodes (fleet, soak) hold one ``connection`` per episode and take their groups from
``created_groups``, as a workflow runner would.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import httptools

if TYPE_CHECKING:
    from contract.client import AsyncProxyClient
    from contract.entities import CreatedGroup

DONE_TAIL = b"data: [DONE]\n\n"


@dataclass(frozen=True, slots=True)
class StreamEnd:
    """How a complete stream ends: one of ``markers`` within its last ``keep`` bytes."""

    markers: tuple[bytes, ...] = (DONE_TAIL,)
    keep: int = 64


CHAT_END = StreamEnd()


def build_request(host: str, port: int, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"host: {host}:{port}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: keep-alive",
    ]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@dataclass(slots=True)
class Answer:
    status: int
    ok: bool
    ttfb_ns: int
    total_ns: int
    keep_alive: bool


class ClientConnection(asyncio.Protocol):
    """One keep-alive connection; ``ask`` sends a request and resolves when its answer is complete."""

    def __init__(self, on_first_body: asyncio.Event | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Answer] | None = None
        self.stream = False
        self.end = CHAT_END
        self.sent = 0
        self.first = 0
        self.tail = b""
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.on_first_body = on_first_body

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc!r}"))
        if not self.lost.done():
            self.lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(exc)
            assert self.transport is not None
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        if not self.first:
            self.first = time.perf_counter_ns()
        self.tail = (self.tail + body)[-self.end.keep :]

    def on_message_complete(self) -> None:
        now = time.perf_counter_ns()
        status = self.parser.get_status_code()
        ok = status == 200 and (not self.stream or any(m in self.tail for m in self.end.markers))
        first = self.first or now
        # Asked here: once feed_data returns, httptools says False for every message.
        keep_alive = self.parser.should_keep_alive()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(Answer(status, ok, first - self.sent, now - self.sent, keep_alive))

    def ask(self, request: bytes, *, stream: bool, end: StreamEnd = CHAT_END) -> asyncio.Future[Answer]:
        assert self.transport is not None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter = asyncio.get_running_loop().create_future()
        self.stream, self.end, self.first, self.tail = stream, end, 0, b""
        self.sent = time.perf_counter_ns()
        self.transport.write(request)
        return self.waiter


async def connect(host: str, port: int) -> ClientConnection:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(ClientConnection, host, port)
    return protocol


@asynccontextmanager
async def connection(host: str, port: int) -> AsyncIterator[ClientConnection]:
    """One keep-alive connection for an agent's run of calls, closed however the run ends."""
    conn = await connect(host, port)
    try:
        yield conn
    finally:
        if conn.transport is not None:
            conn.transport.close()


async def created_groups(
    client: AsyncProxyClient, task_id: str, size: int, *, until: float, on_error: Callable[[str], None]
) -> AsyncIterator[CreatedGroup]:
    """Groups of ``size``, one after another, until ``until`` (``time.monotonic()``), as a workflow
    runner asks for them. A create that fails (admission control's 429, a dropped connection) is
    counted with ``on_error`` and tried again a second later."""
    while time.monotonic() < until:
        try:
            group = await client.create_group(task_id, size)
        except Exception as exc:  # noqa: BLE001 - counted and reported, the runner waits and goes on
            on_error(f"create_group:{type(exc).__name__}")
            await asyncio.sleep(1.0)
            continue
        yield group


@dataclass
class CellResult:
    """What one (target, mode, concurrency) cell measured."""

    latencies_ns: list[int] = field(default_factory=list)
    ok: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    ok_per_conn: list[int] = field(default_factory=list)
    """Successful answers per connection over the whole cell (warm-up included): for the store check."""
    seconds: float = 0.0

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1

    @property
    def rps(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    def percentile_ms(self, q: float) -> float:
        if not self.latencies_ns:
            return float("nan")
        ordered = sorted(self.latencies_ns)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


async def run_cell(
    host: str,
    port: int,
    requests: list[bytes],
    *,
    stream: bool,
    warmup_s: float,
    measure_s: float,
    timeout_s: float = 30.0,
    end: StreamEnd = CHAT_END,
) -> CellResult:
    """One closed-loop connection per entry of ``requests``. Latencies and counts cover answers
    completed inside the measuring window (after ``warmup_s``); ``ok_per_conn`` covers the whole run."""
    result = CellResult(ok_per_conn=[0] * len(requests))
    conns = await asyncio.gather(*(connect(host, port) for _ in requests))
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from, stop_at = start + warmup_s, start + warmup_s + measure_s

    def in_window() -> bool:
        return measure_from <= loop.time() <= stop_at

    def reconnect_later(index: int) -> None:
        transport = conns[index].transport
        if transport is not None:
            transport.close()

    async def agent(index: int) -> None:
        request = requests[index]
        while loop.time() < stop_at:
            try:
                answer = await asyncio.wait_for(conns[index].ask(request, stream=stream, end=end), timeout_s)
            except (TimeoutError, ConnectionError, httptools.HttpParserError) as exc:
                if in_window():
                    result.error(type(exc).__name__)
                reconnect_later(index)
                conns[index] = await connect(host, port)
                continue
            if answer.ok:
                result.ok_per_conn[index] += 1
            if in_window():  # counted by completion time: throughput = answers completed in the window
                if answer.ok:
                    result.ok += 1
                    result.latencies_ns.append(answer.total_ns)
                else:
                    result.error(f"http_{answer.status}" if answer.status != 200 else "stream_error_event")
            if not answer.keep_alive:
                reconnect_later(index)
                conns[index] = await connect(host, port)

    await asyncio.gather(*(agent(i) for i in range(len(requests))))
    result.seconds = measure_s
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    return result
