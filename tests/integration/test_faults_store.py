"""Store faults under load: the proxy killed, PostgreSQL restarted, SQLite's disk full (issue 14).

Real processes on loopback: ``python -m proxy serve`` (``ProxyProcess``) in front of the session's
real vLLM, concurrent agents calling it, half of them streaming. Each test prints one ``FIGURES``
line (calls acknowledged and stored, the statuses the clients saw) and repeats its figures in its
assertion messages. An acknowledged call is one the client received whole: a 200 JSON answer, or
a stream that ended with ``data: [DONE]``.

Bounded in time: every client call has a 60 s timeout (a proxy that hung on a dead store would
fail it), every wait for load has its own bound, and the three tests take about 2 minutes together
on a warm engine (docs/guide/testing.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import shutil
import sqlite3
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.services import ADMIN_KEY, ProxyProcess, free_port

pytestmark = pytest.mark.vllm
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
CLIENT_TIMEOUT_S = 60.0
"""The longest any client call may take: a hang on a dead or full store fails the test here."""
START_TIMEOUT_S = 180.0
"""A proxy's start (imports, migrations) on a shared 2-core machine under heavy load."""
PG_BIN = Path("/usr/lib/postgresql/15/bin")


# -- clients --------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What one client call saw: ``status`` is ``"200"``, ``"<http status> <error code>"``,
    ``"stream-error <code>"`` (a stream that ended on an error event, no [DONE]), ``"truncated"`` (a
    stream that just stopped) or ``"transport <exception>"``."""

    status: str
    response_id: str | None = None
    error: dict[str, Any] | None = None
    seconds: float = 0.0


@dataclass
class Tally:
    """Every outcome the agents saw, by phase, and the calls acknowledged to them."""

    phase: str = "before"
    outcomes: list[tuple[str, Outcome]] = field(default_factory=list)
    acked: list[tuple[str, str]] = field(default_factory=list)
    """(episode id, response id) of every acknowledged call."""
    streams_mid: int = 0
    """Streams that have delivered a first event and not yet their last, now."""

    def add(self, phase: str, episode_id: str, outcome: Outcome) -> None:
        self.outcomes.append((phase, outcome))
        if outcome.response_id is not None:
            self.acked.append((episode_id, outcome.response_id))

    def statuses(self, phase: str | None = None) -> dict[str, int]:
        return dict(Counter(o.status for p, o in self.outcomes if phase is None or p == phase))

    def acked_in(self, phase: str) -> int:
        return sum(1 for p, o in self.outcomes if p == phase and o.response_id is not None)

    def refused_in(self, phase: str) -> list[Outcome]:
        return [o for p, o in self.outcomes if p == phase and o.response_id is None]


async def call(
    client: httpx.AsyncClient, episode: dict[str, Any], *, stream: bool, max_tokens: int = 3, tally: Tally | None = None
) -> Outcome:
    """One chat call of ``episode`` through the proxy, as an OpenAI client makes it (a stream in
    the middle of its body is counted in ``tally.streams_mid``)."""
    body = {"model": "policy", "messages": [{"role": "user", "content": "Say one word."}], "max_tokens": max_tokens}
    url = f"{episode['base_url']}/chat/completions"
    auth = {"authorization": f"Bearer {episode['api_key']}"}
    started = time.monotonic()
    try:
        if not stream:
            response = await client.post(url, json=body, headers=auth)
            outcome = _answer(response.status_code, response.content)
        else:
            async with client.stream("POST", url, json=body | {"stream": True}, headers=auth) as response:
                if response.status_code != 200:
                    outcome = _answer(response.status_code, await response.aread())
                else:
                    outcome = _stream(await _events(response, tally))
    except httpx.HTTPError as exc:
        outcome = Outcome(f"transport {type(exc).__name__}")
    outcome.seconds = time.monotonic() - started
    return outcome


async def _events(response: httpx.Response, tally: Tally | None) -> list[str]:
    events: list[str] = []
    try:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                if not events and tally is not None:
                    tally.streams_mid += 1
                events.append(line[6:])
    finally:
        if events and tally is not None:
            tally.streams_mid -= 1
    return events


def _answer(status: int, content: bytes) -> Outcome:
    data = json.loads(content) if content else {}
    if status == 200:
        return Outcome("200", response_id=data["id"])
    error = data.get("error", {})
    return Outcome(f"{status} {error.get('code')}", error=error)


def _stream(events: list[str]) -> Outcome:
    if events and events[-1] == "[DONE]":
        return Outcome("200", response_id=json.loads(events[0])["id"])
    last = json.loads(events[-1]) if events else {}
    if "error" in last:
        return Outcome(f"stream-error {last['error'].get('code')}", error=last["error"])
    return Outcome("truncated")


def new_group(proxy: ProxyProcess, size: int, task_id: str) -> list[dict[str, Any]]:
    response = httpx.post(f"{proxy.url}/groups", json={"task_id": task_id, "size": size}, headers=ADMIN, timeout=30)
    assert response.status_code == 201, response.text
    return list(response.json()["episode_keys"])


def stored_ids(proxy: ProxyProcess, episode_id: str) -> set[str]:
    """Response ids of the episode's stored calls, read back whole through the episodes API."""
    response = httpx.get(f"{proxy.url}/episodes/{episode_id}", headers=ADMIN, timeout=30)
    assert response.status_code == 200, response.text
    return {c["response"]["id"] for c in response.json()["calls"] if c["response"]}


def lost(proxy: ProxyProcess, acked: list[tuple[str, str]]) -> list[tuple[str, str]]:
    by_episode: dict[str, set[str]] = {}
    for episode_id, _ in acked:
        if episode_id not in by_episode:
            by_episode[episode_id] = stored_ids(proxy, episode_id)
    return [(e, r) for e, r in acked if r not in by_episode[e]]


async def agents_until(
    episodes: list[dict[str, Any]], tally: Tally, stop: asyncio.Event, *, pause_s: float = 0.2, max_tokens: int = 3
) -> None:
    """Every episode calls in a loop until ``stop``, odd ones streaming; a refused call is retried
    after ``pause_s`` (a client's backoff), so agents never spin on a store that is down."""

    async def agent(client: httpx.AsyncClient, episode: dict[str, Any], stream: bool) -> None:
        while not stop.is_set():
            phase = tally.phase
            outcome = await call(client, episode, stream=stream, max_tokens=max_tokens, tally=tally)
            tally.add(phase, episode["id"], outcome)
            if outcome.response_id is None:
                await asyncio.sleep(pause_s)

    # Every agent keeps its connection (httpx keeps 20 by default): a call in flight at a kill is
    # one on an open connection, not a connect still to come.
    limits = httpx.Limits(max_connections=len(episodes), max_keepalive_connections=len(episodes))
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S, limits=limits) as client:
        await asyncio.gather(*(agent(client, e, i % 2 == 1) for i, e in enumerate(episodes)))


async def wait_for(condition: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True


# -- 1. kill -9 of the proxy ---------------------------------------------------------------------


def check_sqlite_whole(path: Path, *, episodes: int) -> dict[str, int]:
    """The store as a kill -9 left it, read with sqlite3 directly: nothing half-written.

    The file passes ``integrity_check`` and ``foreign_key_check``; the one group holds exactly its
    ``episodes`` episodes (indexes 0..n-1); every episode's call ordinals are dense from 0; every
    delta row's base is a stored earlier call of its episode; every successful call has its answer,
    its prompt ids and its sampled ids. Returns counts for the figures.
    """
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
        groups = db.execute("SELECT id, size FROM groups").fetchall()
        assert len(groups) == 1 and groups[0][1] == episodes, groups
        indexes = [i for (i,) in db.execute("SELECT group_index FROM episodes ORDER BY group_index")]
        assert indexes == list(range(episodes)), indexes
        ordinals: dict[str, list[int]] = {}
        for episode_id, ordinal in db.execute("SELECT episode_id, ordinal FROM calls ORDER BY episode_id, ordinal"):
            ordinals.setdefault(episode_id, []).append(ordinal)
        gaps = {e: o for e, o in ordinals.items() if o != list(range(len(o)))}
        assert gaps == {}, f"ordinals with gaps: {gaps}"
        orphans = db.execute(
            "SELECT c.episode_id, c.ordinal FROM calls c WHERE c.base_ordinal IS NOT NULL AND NOT EXISTS "
            "(SELECT 1 FROM calls b WHERE b.episode_id = c.episode_id AND b.ordinal = c.base_ordinal "
            "AND b.ordinal < c.ordinal)"
        ).fetchall()
        assert orphans == [], f"delta rows without their base: {orphans}"
        hollow = db.execute(
            "SELECT episode_id, ordinal FROM calls WHERE status_code = 200 AND (response IS NULL "
            "OR response = 'null' OR (prompt_ids IS NULL AND prompt_token_ids IS NULL) "
            "OR (choice_ids IS NULL AND choices IS NULL))"
        ).fetchall()
        assert hollow == [], f"successful calls stored without answer or ids: {hollow}"
        statuses = dict(db.execute("SELECT status_code, count(*) FROM calls GROUP BY status_code").fetchall())
        return {str(k): v for k, v in statuses.items()}
    finally:
        db.close()


def test_kill9_under_load_loses_no_acknowledged_call(vllm_url: str, tmp_path: Path) -> None:
    """``kill -9`` of the proxy while 50 episodes (25 streaming) call it without pause.

    The clients see 200s (streams ending in [DONE]) until the kill, then a transport error on the
    call in flight (a stream cut short is never taken as acknowledged). The store, read
    directly before the restart, is whole (``check_sqlite_whole``). After the restart every
    acknowledged call is in it (by response id), and each of the 50 clients retries its cut call:
    every retry is a 200 and is stored too. Calls the store holds beyond the acknowledged ones were
    committed but cut before the client read the answer (allowed: never acknowledged, never lost).
    """
    db = tmp_path / "flywheel.db"
    store = f"sqlite+aiosqlite:///{db}"
    proxy = ProxyProcess(upstream_url=vllm_url, store_url=store, workdir=tmp_path)
    proxy.start(timeout=START_TIMEOUT_S)
    episodes = new_group(proxy, 50, "kill9")
    tally = Tally(phase="load")
    loaded_s, streams_cut = 0.0, 0

    async def until_killed() -> None:
        nonlocal loaded_s, streams_cut
        stop = asyncio.Event()
        started = time.monotonic()
        agents = asyncio.create_task(agents_until(episodes, tally, stop, pause_s=0.0, max_tokens=16))
        # vLLM answers a batch together, so the kill waits for a moment inside one: at least 10
        # of the 25 streams part-way through their body (bounded: at most 5 minutes on a busy box).
        await wait_for(lambda: len(tally.acked) >= 50 and tally.streams_mid >= 10, 300)
        loaded_s, streams_cut = time.monotonic() - started, tally.streams_mid
        proxy.kill9()
        tally.phase = "after kill"
        stop.set()
        await asyncio.wait_for(agents, timeout=120)

    asyncio.run(until_killed())
    cut = sum(n for status, n in tally.statuses().items() if status.startswith("transport") and "Connect" not in status)
    figures = (
        f"acknowledged {len(tally.acked)} in {loaded_s:.0f} s, calls cut in flight by the kill {cut} "
        f"({streams_cut} streams part-way through their body); "
        f"statuses {tally.statuses()}"
    )
    assert len(tally.acked) >= 50, f"too few calls completed before the kill to mean anything: {figures}"
    assert set(tally.statuses()) <= {"200"} | {s for s in tally.statuses() if s.startswith("transport")}, figures
    stored = check_sqlite_whole(db, episodes=50)
    restarted = ProxyProcess(upstream_url=vllm_url, store_url=store, workdir=tmp_path, port=proxy.port)
    restarted.start(timeout=START_TIMEOUT_S)
    try:
        missing = lost(restarted, tally.acked)

        async def retry_all() -> list[Outcome]:
            async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
                return list(await asyncio.gather(*(call(client, e, stream=i % 2 == 1) for i, e in enumerate(episodes))))

        retries = asyncio.run(retry_all())
        retried = [(e["id"], r.response_id) for e, r in zip(episodes, retries, strict=True) if r.response_id]
        retried_lost = lost(restarted, [(e, r) for e, r in retried if r is not None])
    finally:
        restarted.stop()
    figures += (
        f"; stored 200s {stored.get('200', 0)} (other statuses {stored}); lost {len(missing)}; "
        f"retries {dict(Counter(r.status for r in retries))}, retried and stored {len(retried) - len(retried_lost)}"
    )
    print(f"FIGURES kill9: {figures}")
    assert missing == [], f"acknowledged calls lost: {missing[:5]}; {figures}"
    assert stored.get("200", 0) >= len(tally.acked), figures
    assert [r.status for r in retries] == ["200"] * 50, figures
    assert retried_lost == [], figures


# -- 2. PostgreSQL restarted under load -----------------------------------------------------------


@dataclass
class PrivateCluster:
    """A PostgreSQL 15 cluster of this test's own (never the shared server), run as ``postgres``
    (the server refuses root) in a temporary directory that user owns, on a free loopback port."""

    root: Path
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *args: str) -> None:
        subprocess.run(["runuser", "-u", "postgres", "--", *args], check=True, capture_output=True, timeout=120)

    def init(self) -> None:
        data = str(self.root / "data")
        self._as_postgres(str(PG_BIN / "initdb"), "-D", data, "-A", "trust", "-U", "postgres", "--no-sync")

    def start(self) -> None:
        # fsync off: the test crashes the server process, not the machine; what a commit wrote is
        # in the OS's page cache and survives, and the shared 2-core box is spared the flushes.
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        data, log = str(self.root / "data"), str(self.root / "server.log")
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", data, "-o", options, "-l", log, "-w", "start")

    def stop(self, mode: str = "immediate") -> None:
        """``immediate``: the server dies at once (clients cut, WAL replayed at the next start)."""
        self._as_postgres(str(PG_BIN / "pg_ctl"), "-D", str(self.root / "data"), "-m", mode, "-w", "stop")


@pytest.fixture
def private_pg() -> Iterator[PrivateCluster]:
    if not (PG_BIN / "initdb").exists() or not (PG_BIN / "pg_ctl").exists():
        pytest.skip(f"no PostgreSQL 15 binaries in {PG_BIN}")
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("no 'postgres' user to run a private PostgreSQL cluster as")
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("starting a private cluster as 'postgres' needs root and runuser")
    root = Path(tempfile.mkdtemp(prefix="flywheel-pg-"))
    os.chown(root, user.pw_uid, user.pw_gid)
    cluster = PrivateCluster(root)
    try:
        cluster.init()
        cluster.start()
        yield cluster
    finally:
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_postgres_restart_under_load_answers_503_and_recovers(
    vllm_url: str, tmp_path: Path, private_pg: PrivateCluster
) -> None:
    """A private PostgreSQL killed (``pg_ctl stop -m immediate``) and restarted while 20 episodes
    (10 streaming) call through the proxy.

    While it is down the clients see only 503 ``service_unavailable`` errors with code
    ``store_unavailable`` and a message naming the store: as the HTTP answer, or as a stream's last
    event (a stream that began before the store failed, whose record could not commit: no [DONE]),
    never a 500, a truncated stream or a call hanging past the client's timeout (60 s; the store's
    connect timeout is 10 s). Once the server is back the proxy serves calls again by itself (no
    restart), and the store holds every call acknowledged before, during and after the outage.
    """
    proxy = ProxyProcess(upstream_url=vllm_url, store_url=private_pg.url, workdir=tmp_path)
    proxy.start(timeout=START_TIMEOUT_S)
    episodes = new_group(proxy, 20, "pg-restart")
    tally = Tally()
    down_s = recovered_s = 0.0

    async def scenario() -> None:
        nonlocal down_s, recovered_s
        stop = asyncio.Event()
        agents = asyncio.create_task(agents_until(episodes, tally, stop))
        try:
            await wait_for(lambda: tally.acked_in("before") >= 10, 180)
            tally.phase = "down"
            went_down = time.monotonic()
            await asyncio.to_thread(private_pg.stop)
            # Down until the clients were refused once per agent, bounded (the episode check is
            # cached for 2 s, so the first refusals are records that could not commit).
            await wait_for(lambda: len(tally.refused_in("down")) >= len(episodes), 60)
            await asyncio.to_thread(private_pg.start)
            tally.phase = "restarted"
            back = time.monotonic()
            down_s = back - went_down
            await wait_for(lambda: tally.acked_in("restarted") >= 1, 180)
            recovered_s = time.monotonic() - back
            await wait_for(lambda: tally.acked_in("restarted") >= 10, 180)
        finally:
            stop.set()
            await asyncio.wait_for(agents, timeout=CLIENT_TIMEOUT_S + 30)

    try:
        asyncio.run(scenario())
        missing = lost(proxy, tally.acked)
    finally:
        proxy.stop()
    refused = [o for _, o in tally.outcomes if o.response_id is None]
    slowest = max((o.seconds for o in refused), default=0.0)
    figures = (
        f"acknowledged {len(tally.acked)} (before {tally.acked_in('before')}, during {tally.acked_in('down')}, "
        f"after {tally.acked_in('restarted')}), lost {len(missing)}; server down {down_s:.1f} s, first call "
        f"acknowledged {recovered_s:.1f} s after it was back; statuses (by the phase a call began in) before "
        f"{tally.statuses('before')}, while down {tally.statuses('down')}, after the restart "
        f"{tally.statuses('restarted')}; slowest refusal {slowest:.2f} s"
    )
    print(f"FIGURES postgres restart: {figures}")
    allowed = {"200", "503 store_unavailable", "stream-error store_unavailable"}
    assert set(tally.statuses()) <= allowed, figures
    assert tally.refused_in("down"), f"the outage was never seen by a client: {figures}"
    for outcome in refused:
        assert outcome.error is not None and outcome.error["type"] == "service_unavailable", outcome
        assert "store is unavailable" in outcome.error["message"], outcome
    assert tally.acked_in("restarted") >= 10, f"the proxy did not recover by itself: {figures}"
    assert missing == [], f"acknowledged calls lost: {missing[:5]}; {figures}"


# -- 3. SQLite on a full disk ------------------------------------------------------------------


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A ``size`` tmpfs mounted at ``path`` (a disk that really fills); skips where mounting is refused."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.decode().strip() or mounted.returncode})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(ballast: Path) -> int:
    """Write ``ballast`` until the file system has no byte left; returns the bytes written."""
    written = 0
    chunk = b"\0" * 65536
    with open(ballast, "wb", buffering=0) as out:
        while True:
            try:
                written += out.write(chunk)
            except OSError:  # ENOSPC: what is left is smaller than a chunk; take it byte by byte
                if len(chunk) == 1:
                    return written
                chunk = chunk[: len(chunk) // 16] or b"\0"


def test_sqlite_full_disk_answers_507_and_recovers(vllm_url: str, tmp_path: Path) -> None:
    """SQLite on an 8 MB tmpfs filled to the last byte while 8 episodes (4 streaming) call.

    Before the disk fills every call is a 200. While it is full the clients see 507
    ``insufficient_storage`` with code ``store_full`` (as the HTTP answer, or as a stream's last
    event, no [DONE]), and ``POST /groups`` a 507 too: never a 500 or a truncated stream. Once the
    ballast is deleted, every client's next call is a 200 and a new group is created, with no
    restart. Afterwards the database passes ``PRAGMA integrity_check`` and holds every
    acknowledged call.
    """
    with small_filesystem(tmp_path / "disk", "8m") as disk:
        db = disk / "flywheel.db"
        store = f"sqlite+aiosqlite:///{db}"
        proxy = ProxyProcess(upstream_url=vllm_url, store_url=store, workdir=tmp_path / "logs")
        proxy.start(timeout=START_TIMEOUT_S)
        try:
            episodes = new_group(proxy, 8, "full-disk")
            tally = Tally()

            async def round_of_calls(phase: str) -> list[Outcome]:
                async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as client:
                    outcomes = await asyncio.gather(
                        *(call(client, e, stream=i % 2 == 1) for i, e in enumerate(episodes))
                    )
                for episode, outcome in zip(episodes, outcomes, strict=True):
                    tally.add(phase, episode["id"], outcome)
                return list(outcomes)

            asyncio.run(round_of_calls("before"))
            ballast = fill(disk / "ballast")
            # Calls until every client has been refused (the WAL may hold a little room), bounded.
            for _ in range(10):
                if all(o.response_id is None for o in asyncio.run(round_of_calls("full"))):
                    break
            group_full = httpx.post(f"{proxy.url}/groups", json={"task_id": "t", "size": 2}, headers=ADMIN, timeout=60)
            (disk / "ballast").unlink()
            asyncio.run(round_of_calls("recovered"))
            group_after = httpx.post(f"{proxy.url}/groups", json={"task_id": "t", "size": 2}, headers=ADMIN, timeout=60)
            missing = lost(proxy, tally.acked)
        finally:
            proxy.stop()
        check = sqlite3.connect(db)
        integrity = check.execute("PRAGMA integrity_check").fetchall()
        check.close()
    figures = (
        f"ballast {ballast / 1e6:.1f} MB; acknowledged {len(tally.acked)}, lost {len(missing)}; statuses before "
        f"{tally.statuses('before')}, disk full {tally.statuses('full')}, space back {tally.statuses('recovered')}; "
        f"POST /groups full {group_full.status_code}, after {group_after.status_code}; integrity {integrity}"
    )
    print(f"FIGURES sqlite full disk: {figures}")
    assert tally.statuses("before") == {"200": 8}, figures
    assert tally.refused_in("full"), f"the full disk was never seen by a client: {figures}"
    assert set(tally.statuses("full")) <= {"200", "507 store_full", "stream-error store_full"}, figures
    for outcome in tally.refused_in("full"):
        assert outcome.error is not None and outcome.error["type"] == "insufficient_storage", outcome
        assert "disk is full" in outcome.error["message"], outcome
    assert group_full.status_code == 507 and group_full.json()["error"]["code"] == "store_full", figures
    assert tally.statuses("recovered") == {"200": 8}, figures
    assert group_after.status_code == 201, figures
    assert integrity == [("ok",)], figures
    assert missing == [], f"acknowledged calls lost: {missing[:5]}; {figures}"
