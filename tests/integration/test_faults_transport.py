"""Transport faults the proxy itself must absorb: clients that stop reading, bodies past the limit,
a burst of 1,000 connections.

Each test runs the real proxy (``python -m proxy serve``, SQLite store) in front of the named fake
upstream, ``bench/fake_upstream.py`` started as a subprocess: these tests isolate the proxy, and a
canned upstream answers at once, so whatever stalls or grows is the proxy's. Loopback only; every
read has a timeout, so no test can hang. (vLLM killed mid-stream is in ``test_engine_restart.py``,
which pays for an engine of its own; the store's faults are in ``test_faults_store.py``.)
"""

from __future__ import annotations

import asyncio
import resource
import select
import socket
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import httpx
import orjson
import pytest

from bench._procs import FakeUpstreamProcess
from tests.support.services import ADMIN_KEY, ProxyProcess, episode_record, new_episode

ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
MAX_BODY = 64 * 1024
"""The proxy's ``max_body_bytes`` here: small, so a body far past it is cheap to send."""
LONG_STREAM = 32_000
"""Tokens in a stalled client's stream: about 6 MB of events for the client, more than the socket
buffers between the proxy and a client that reads nothing hold (the proxy's send buffer grows to
``net.ipv4.tcp_wmem``'s 4 MiB at most), so the proxy really waits on that client."""
ANSWER_TIMEOUT_S = 60.0
"""No connection of the burst may wait longer than this for its whole answer."""


@dataclass
class Proxied:
    proxy: ProxyProcess
    upstream: FakeUpstreamProcess


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxied]:
    tmp = tmp_path_factory.mktemp("faults-transport")
    upstream = FakeUpstreamProcess.start(tokens=LONG_STREAM)
    proxy = ProxyProcess(
        upstream_url=upstream.url,
        store_url=f"sqlite+aiosqlite:///{tmp / 'flywheel.db'}",
        workdir=tmp,
        extra_env={"FLYWHEEL_MAX_BODY_BYTES": str(MAX_BODY), "FLYWHEEL_LOG_LEVEL": "warning"},
    )
    try:
        proxy.start()
        yield Proxied(proxy, upstream)
    finally:
        proxy.stop()
        upstream.stop()


def _key(episode: dict[str, Any]) -> dict[str, str]:
    return {"authorization": f"Bearer {episode['api_key']}"}


def _chat(max_tokens: int, *, stream: bool) -> dict[str, Any]:
    return {
        "model": "policy",
        "stream": stream,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": "Hi"}],
    }


def _call(episode: dict[str, Any]) -> httpx.Response:
    """One short recorded chat call, not streamed."""
    url = f"{episode['base_url']}/chat/completions"
    return httpx.post(url, headers=_key(episode), json=_chat(4, stream=False), timeout=ANSWER_TIMEOUT_S)


def _proxy_pid(proxied: Proxied) -> int:
    assert proxied.proxy.proc is not None
    return proxied.proxy.proc.pid  # one worker: uvicorn serves in this very process


def _descriptors(pid: int, database: str) -> Counter[str]:
    """The process's open descriptors by kind: sockets, the SQLite store's files (``database`` and
    its ``-wal``), anything else."""
    kinds: Counter[str] = Counter()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = str(fd.readlink())
        except OSError:  # closed while listing
            continue
        kinds["sockets" if target.startswith("socket:") else "store" if target.startswith(database) else "other"] += 1
    return kinds


STORE_POOL = 10
"""The SQLite engine's fixed pool (``proxy.store.db.make_engine``): a burst may open up to that
many connections, each holding the database file and its WAL, and keeps them for the next one."""


def _status_kb(pid: int, field_name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{field_name} not in /proc/{pid}/status")


@dataclass
class Answer:
    """One HTTP response read off a raw socket (httptools parses it, chunked or not)."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False

    parser: httptools.HttpResponseParser | None = None

    def feed(self, data: bytes) -> None:
        if self.parser is None:
            self.parser = httptools.HttpResponseParser(self)
        self.parser.feed_data(data)

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


def _request(path: str, headers: dict[str, str], body: bytes, *, close: bool = True) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines += [f"content-length: {len(body)}"] + (["connection: close"] if close else [])
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _sse_data(body: bytes) -> list[bytes]:
    return [e[5:].strip() for e in body.replace(b"\r\n", b"\n").split(b"\n\n") if e.startswith(b"data:")]


def _error_shaped(answer: Answer) -> bool:
    """The OpenAI error shape every documented refusal has: ``{"error": {"message", "type", ...}}``."""
    try:
        error = orjson.loads(bytes(answer.body))["error"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


# -- a client that stops reading ------------------------------------------------------------------


def test_clients_that_stop_reading_do_not_hold_up_the_others(proxied: Proxied) -> None:
    """Two clients each open a recorded stream of 32,000 tokens (fake upstream) on a socket with
    a 4 KiB receive buffer and then read nothing; meanwhile 30 other clients make recorded calls,
    plain and streamed.

    The others see: 200 each, streams ending with ``data: [DONE]``, all while the two still read
    nothing. The store then holds each of the 30 calls (status 200) and neither stalled call yet
    (the proxy waits on those clients with their streams unfinished: it forwards a stream's last
    event only after its record, so nothing of theirs is acknowledged). Once the two read, each
    gets its whole stream ending in ``[DONE]``, and the store holds their calls (200, 32,000
    completion tokens each).
    """
    proxy = proxied.proxy
    stalled_episodes = [new_episode(proxy, f"stalled-{i}") for i in range(2)]
    stalled: list[socket.socket] = []
    for episode in stalled_episodes:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: fixes the window
        sock.settimeout(ANSWER_TIMEOUT_S)
        sock.connect(("127.0.0.1", proxy.port))
        path = episode["base_url"].split(str(proxy.port), 1)[1] + "/chat/completions"
        sock.sendall(_request(path, _key(episode), orjson.dumps(_chat(LONG_STREAM, stream=True))))
        stalled.append(sock)

    others = [new_episode(proxy, f"other-{i}") for i in range(30)]

    async def one(client: httpx.AsyncClient, episode: dict[str, Any], stream: bool) -> tuple[int, bool]:
        body = _chat(16, stream=stream)
        url = f"{episode['base_url']}/chat/completions"
        response = await client.post(url, headers=_key(episode), json=body)
        finished = _sse_data(response.content)[-1] == b"[DONE]" if stream else bool(response.json()["choices"])
        return response.status_code, finished

    async def the_others() -> list[tuple[int, bool]]:
        async with httpx.AsyncClient(timeout=ANSWER_TIMEOUT_S) as client:
            return await asyncio.gather(*(one(client, e, i % 2 == 0) for i, e in enumerate(others)))

    results = asyncio.run(the_others())
    assert results == [(200, True)] * 30

    recorded_while_stalled = [len(episode_record(proxy, e["id"])["calls"]) for e in stalled_episodes]
    others_stored = [[c["status_code"] for c in episode_record(proxy, e["id"])["calls"]] for e in others]
    assert others_stored == [[200]] * 30
    assert recorded_while_stalled == [0, 0], "the stalled streams finished unread: make LONG_STREAM longer"

    events_read = []
    for sock in stalled:
        parsed = Answer()
        with sock:
            while not parsed.complete:
                data = sock.recv(1 << 20)
                assert data, "the proxy closed a stalled client's stream before its end"
                parsed.feed(data)
        events = _sse_data(bytes(parsed.body))
        assert parsed.status == 200 and events[-1] == b"[DONE]"
        events_read.append(len(events))

    stored_after = []
    for episode in stalled_episodes:
        deadline = time.monotonic() + 30  # the record commits after [DONE] was held back for it
        calls = episode_record(proxy, episode["id"])["calls"]
        while not calls and time.monotonic() < deadline:
            time.sleep(0.2)
            calls = episode_record(proxy, episode["id"])["calls"]
        stored_after.append([(c["status_code"], c["completion_tokens"]) for c in calls])
    assert stored_after == [[(200, LONG_STREAM)]] * 2
    print(
        f"\nslow readers: others {Counter(s for s, _ in results)} all finished; stored while stalled: "
        f"others {len(others_stored)} calls of 200, stalled {recorded_while_stalled}; stalled clients then read "
        f"{events_read} events each ending [DONE]; stored after: {stored_after}"
    )


# -- bodies past the limit ------------------------------------------------------------------------


def _send_chunked_until_answered(port: int, path: str, headers: dict[str, str], total: int) -> tuple[int, Answer]:
    """Send a chunked body of ``total`` bytes, stopping as soon as the proxy answers; (bytes sent, answer)."""
    head = [f"POST {path} HTTP/1.1", "host: 127.0.0.1", "content-type: application/json"]
    head += [f"{k}: {v}" for k, v in headers.items()] + ["transfer-encoding: chunked"]
    start = b'{"model": "policy", "messages": [{"role": "user", "content": "'  # a string that never ends
    piece = b"x" * 65536
    chunk = b"%x\r\n%b\r\n" % (len(piece), piece)
    answer = Answer()
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S) as sock:
        try:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + b"%x\r\n%b\r\n" % (len(start), start))
            while sent < total and not answer.complete:
                sock.sendall(chunk)
                sent += len(piece)
                while select.select([sock], [], [], 0)[0] and not answer.complete:
                    data = sock.recv(65536)
                    if not data:
                        break
                    answer.feed(data)
            while not answer.complete:  # sent it all without an answer: the proxy read the whole body
                data = sock.recv(65536)
                if not data:
                    break
                answer.feed(data)
        except TimeoutError:  # the proxy neither read nor answered for ANSWER_TIMEOUT_S: no answer
            pass
    return sent, answer


def test_a_chunked_body_past_the_limit_is_refused_before_it_is_read(proxied: Proxied) -> None:
    """A chunked body (no content-length, so no early refusal from the headers) of 256 MiB against
    ``max_body_bytes`` 64 KiB, to the chat route by a client that watches for an answer while it
    sends, and 128 MiB to the Messages route by one (httpx) that sends all before it reads.

    The first client sees a 413 in the OpenAI error shape (``invalid_request_error``) after sending
    a few MiB at most, long before its 256 MiB. The second sees a 413 in Anthropic's shape
    (``request_too_large``). The proxy's peak RSS grows by far less than either body: it holds at
    most the limit, and discards the rest as it arrives. The store holds no call from either (a
    refused body is no call), and the proxy answers the next request on the same port.
    """
    proxy = proxied.proxy
    pid = _proxy_pid(proxied)
    episode = new_episode(proxy, "huge-body")
    path = episode["base_url"].split(str(proxy.port), 1)[1]
    peak_before = _status_kb(pid, "VmHWM")

    total = 256 * 2**20
    sent, answer = _send_chunked_until_answered(proxy.port, f"{path}/chat/completions", _key(episode), total)
    assert answer.status == 413 and _error_shaped(answer), (answer.status, sent, bytes(answer.body[:300]))
    assert orjson.loads(bytes(answer.body))["error"]["type"] == "invalid_request_error"
    assert sent < total // 8, f"the proxy answered only after {sent} of {total} bytes"

    def pieces() -> Iterator[bytes]:
        piece = b"y" * 2**20
        for _ in range(128):
            yield piece

    naive = httpx.post(
        f"{episode['base_url'].removesuffix('/v1')}/v1/messages",
        headers={**_key(episode), "content-type": "application/json"},
        content=pieces(),
        timeout=ANSWER_TIMEOUT_S,
    )
    assert naive.status_code == 413, naive.text
    assert naive.json()["type"] == "error" and naive.json()["error"]["type"] == "request_too_large"

    peak_after = _status_kb(pid, "VmHWM")
    grew_mib = (peak_after - peak_before) / 1024
    assert grew_mib < 32, f"peak RSS grew by {grew_mib:.0f} MiB for bodies of 256 and 128 MiB"
    assert episode_record(proxy, episode["id"])["calls"] == []
    assert _call(episode).status_code == 200
    print(
        f"\nhuge bodies: chat 413 after {sent / 2**20:.1f} of {total / 2**20:.0f} MiB sent; messages 413 "
        f"(request_too_large) after 128 MiB; peak RSS {peak_before / 1024:.0f} -> {peak_after / 1024:.0f} MiB; "
        "stored calls 0, then 1 call 200"
    )


# -- a burst of 1,000 connections -----------------------------------------------------------------


@dataclass
class Gate:
    """Holds every connection of the burst until all of them are open (or failed to open)."""

    expected: int
    arrived: int = 0
    go: asyncio.Event = field(default_factory=asyncio.Event)

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived == self.expected:
            self.go.set()


async def _one_connection(port: int, request: bytes, gate: Gate) -> tuple[Answer, str | None]:
    """Connect, wait until every connection of the burst is open, send, read to the end."""
    answer = Answer()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), ANSWER_TIMEOUT_S)
    except (OSError, TimeoutError) as exc:
        gate.arrive()
        return answer, f"connect: {type(exc).__name__}"
    gate.arrive()
    try:
        await gate.go.wait()
        writer.write(request)

        async def read() -> None:
            while not answer.complete:
                data = await reader.read(65536)
                if not data:
                    return
                answer.feed(data)

        await asyncio.wait_for(read(), ANSWER_TIMEOUT_S)
        return answer, None if answer.complete else "closed before a whole answer"
    except TimeoutError:
        return answer, f"no whole answer within {ANSWER_TIMEOUT_S:.0f} s"
    except (OSError, httptools.HttpParserError) as exc:
        return answer, f"{type(exc).__name__}: {exc}"
    finally:
        writer.close()


async def _burst(port: int, requests: list[bytes]) -> list[tuple[Answer, str | None]]:
    """Open every connection first, then let them all send at once."""
    gate = Gate(len(requests))
    return await asyncio.gather(*(_one_connection(port, r, gate) for r in requests))


def _well_formed(answer: Answer, streamed: bool) -> bool:
    """2xx with a whole answer, or a documented refusal (429, 503) in the error shape."""
    if answer.status == 200:
        if streamed:
            return _sse_data(bytes(answer.body))[-1] == b"[DONE]"
        return bool(orjson.loads(bytes(answer.body))["choices"])
    return answer.status in (429, 503) and _error_shaped(answer)


def test_a_burst_of_1000_connections_is_served_or_refused_cleanly(proxied: Proxied) -> None:
    """1,000 connections opened at once (all connected before any sends), then each sends one
    recorded chat call over 50 episodes, half streamed (fake upstream, 16 tokens each).

    Every connection gets a whole, well-formed answer within 60 s: 200 with its answer (a stream
    ending in ``[DONE]``), or a documented refusal (429 or 503) in the error shape; none is reset,
    cut or left hanging. The store holds exactly one call of status 200 per 200 the clients saw.
    Afterwards ``/healthz`` answers 200, a new call succeeds, the proxy's open sockets come back to
    their count before the burst and its other descriptors do not grow, but for the store's files,
    which stay within its fixed pool's bound.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:  # 1,000 client sockets plus this process's own
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    proxy = proxied.proxy
    pid = _proxy_pid(proxied)
    episodes = [new_episode(proxy, f"burst-{i}") for i in range(50)]
    assert _call(episodes[0]).status_code == 200  # warm: the pool holds its one idle upstream connection
    database = proxy.store_url.split(":///", 1)[1]  # its -wal and -shm files share the prefix
    baseline = _descriptors(pid, database)

    requests = []
    for i in range(1000):
        episode = episodes[i % 50]
        path = episode["base_url"].split(str(proxy.port), 1)[1] + "/chat/completions"
        requests.append(_request(path, _key(episode), orjson.dumps(_chat(16, stream=i % 2 == 1))))

    results = asyncio.run(_burst(proxy.port, requests))
    statuses = Counter(a.status for a, _ in results)
    failures = Counter(f for _, f in results if f is not None)
    malformed = [i for i, (a, f) in enumerate(results) if f is None and not _well_formed(a, i % 2 == 1)]
    assert not failures, failures
    assert not malformed, [(results[i][0].status, bytes(results[i][0].body[:200])) for i in malformed[:5]]

    health = httpx.get(f"{proxy.url}/healthz")
    assert health.status_code == 200, health.text
    assert _call(episodes[1]).status_code == 200
    stored = Counter(c["status_code"] for e in episodes for c in episode_record(proxy, e["id"])["calls"])
    assert stored[200] == statuses[200] + 2  # plus the warm-up and the call after
    assert set(stored) <= set(statuses) | {200}  # a refused call is stored as failed or not at all

    # Sockets come back to their count before the burst (client connections closed, idle upstream
    # connections expire after 4 s and are closed at the pool's next use: a call each second). The
    # store's files may grow only up to its fixed pool's bound; nothing else may grow.
    deadline = time.monotonic() + 30
    fds = _descriptors(pid, database)
    while fds["sockets"] > baseline["sockets"] and time.monotonic() < deadline:
        time.sleep(1)
        assert _call(episodes[2]).status_code == 200
        fds = _descriptors(pid, database)
    assert fds["sockets"] <= baseline["sockets"], f"descriptors after the burst {dict(fds)}, before {dict(baseline)}"
    assert fds["other"] <= baseline["other"], f"descriptors after the burst {dict(fds)}, before {dict(baseline)}"
    assert fds["store"] <= 2 * STORE_POOL + 2, f"the store's files: {dict(fds)}"  # + the fast path's writer
    print(
        f"\nburst of 1000: statuses {dict(statuses)}, failures {dict(failures)}; stored calls by status "
        f"{dict(stored)} (incl. 2 outside the burst); proxy descriptors {dict(baseline)} before, {dict(fds)} after"
    )


def test_a_stream_reaches_the_client_as_the_upstream_sends_it(proxied: Proxied) -> None:
    """The upstream sends a token event every 0.5 s for 6 s (slow-stream mode): a proxy that buffered
    the stream would hand every event over at its end. Half-second gaps between events are far
    longer than a busy machine's scheduling stalls, so unlike a fast engine's stream this cannot pass
    or fail by the machine's load (``test_vllm.py`` checks the real engine's stream for its content)."""
    episode = new_episode(proxied.proxy, "slow-stream")
    body = {**_chat(64, stream=True), "fake_upstream": {"duration_s": 6.0}}
    arrivals: list[float] = []
    start = time.perf_counter()
    url = f"{episode['base_url']}/chat/completions"
    with httpx.stream("POST", url, headers=_key(episode), json=body, timeout=ANSWER_TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.perf_counter() - start)
    assert len(arrivals) >= 8, arrivals
    assert arrivals[0] < 2.0 and arrivals[-1] > 5.0, (arrivals[0], arrivals[-1])
    apart = sum(1 for a, b in zip(arrivals, arrivals[1:], strict=False) if b - a > 0.25)
    assert apart >= 6, arrivals
