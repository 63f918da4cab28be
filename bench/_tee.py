"""A TCP relay that keeps every byte both ways, to see what a real client sent and received.

The harness tests put it between an agent CLI and the proxy: what the harness sent (its request
bodies, as they crossed the wire) and what it received (the answers, dechunked) are then compared
with the proxy's record, without trusting the proxy's own account of either. Loopback only, in a
thread with its own event loop (the harness runs as a blocking subprocess); HTTP/1.1 is parsed
back once the client is done (requests by httptools, answers here: an answer to ``HEAD`` has no body).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httptools


@dataclass
class Exchange:
    """One request and its answer on a connection, in the order the client sent them."""

    sent_at: float
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    answer: bytes = b""


@dataclass
class _Conn:
    client: list[tuple[float, bytes]] = field(default_factory=list)
    server: list[tuple[float, bytes]] = field(default_factory=list)


class _Requests:
    """httptools callbacks: each request's start time, method, url, headers and body."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.done: list[dict[str, Any]] = []
        self.now = 0.0
        self.current: dict[str, Any] = {}

    def on_message_begin(self) -> None:
        self.current = {"at": self.now, "url": b"", "headers": {}, "body": []}

    def on_url(self, url: bytes) -> None:
        self.current["url"] += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current["headers"][name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.current["method"] = self.parser.get_method().decode()

    def on_body(self, body: bytes) -> None:
        self.current["body"].append(body)

    def on_message_complete(self) -> None:
        self.done.append(self.current)


def _requests(chunks: list[tuple[float, bytes]]) -> list[dict[str, Any]]:
    requests = _Requests()
    for at, data in chunks:
        requests.now = at
        requests.parser.feed_data(data)
    return requests.done


def _dechunk(data: bytes, at: int) -> tuple[bytes, int]:
    """A chunked body from ``at``: its bytes, and where the next message starts (the end if cut short)."""
    parts: list[bytes] = []
    while (line := data.find(b"\r\n", at)) >= 0:
        size = int(data[at:line].split(b";")[0], 16)
        if size == 0:
            return b"".join(parts), line + 4  # "0\r\n\r\n": no trailers
        parts.append(data[line + 2 : line + 2 + size])
        at = line + 2 + size + 2
    return b"".join(parts), len(data)


def _answers(data: bytes, methods: list[str]) -> list[tuple[int, bytes]]:
    """Each answer's status and body (dechunked), in order. Split here rather than by a parser that
    cannot know an answer to ``HEAD`` has no body; the last one may be cut short (a client may exit
    on a stream's last event, before the chunked body's terminator arrives)."""
    out, at = [], 0
    for method in methods:
        end = data.find(b"\r\n\r\n", at)
        if end < 0:
            break
        head = data[at:end].decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
        status, at = int(head[0].split()[1]), end + 4
        body = b""
        if method == "HEAD" or status in (204, 304):
            pass
        elif "content-length" in headers:
            body, at = data[at : at + int(headers["content-length"])], at + int(headers["content-length"])
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body, at = _dechunk(data, at)
        else:
            body, at = data[at:], len(data)
        out.append((status, body))
    return out


class Tee:
    """``with Tee(port) as tee:`` relays ``tee.url`` to 127.0.0.1:``port``; ``tee.exchanges()`` after."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = ""
        self._conns: list[_Conn] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._writers: list[asyncio.StreamWriter] = []
        self._relays: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._serve(),), daemon=True)

    def __enter__(self) -> Tee:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the tee did not start")
        return self

    def __exit__(self, *_: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        async with server:
            await self._stop.wait()
            for writer in self._writers:  # keep-alive connections the client left open
                writer.close()
            await asyncio.gather(*self._relays, return_exceptions=True)

    async def _relay(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        conn = _Conn()
        with self._lock:
            self._conns.append(conn)
        task = asyncio.current_task()
        assert task is not None
        self._relays.add(task)
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [client_writer, server_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, kept: list[tuple[float, bytes]]) -> None:
            try:
                while data := await src.read(65536):
                    with self._lock:
                        kept.append((time.monotonic(), data))
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()
                await dst.wait_closed()

        await asyncio.gather(
            pipe(client_reader, server_writer, conn.client),
            pipe(server_reader, client_writer, conn.server),
            return_exceptions=True,
        )

    def exchanges(self) -> list[Exchange]:
        """Every request with its answer, in the order the client sent them (all connections)."""
        out = []
        with self._lock:
            conns = [(list(c.client), list(c.server)) for c in self._conns]
        for client, server in conns:
            requests = _requests(client)
            answers = _answers(b"".join(data for _, data in server), [r["method"] for r in requests])
            for i, request in enumerate(requests):
                exchange = Exchange(
                    sent_at=request["at"],
                    method=request["method"],
                    path=request["url"].decode(),
                    headers=request["headers"],
                    body=b"".join(request["body"]),
                )
                if i < len(answers):
                    exchange.status, exchange.answer = answers[i]
                out.append(exchange)
        return sorted(out, key=lambda e: e.sent_at)
