"""Durability: whatever a client received is in the store through SIGTERM (kill -9 under load:
``tests/integration/test_faults_store.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.services import ADMIN_KEY, ProxyProcess

pytestmark = pytest.mark.vllm
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


class Acked(list[tuple[str, str]]):
    """Responses the clients fully received; ``enough`` is set once ``target`` of them are in."""

    def __init__(self, target: int) -> None:
        super().__init__()
        self.target = target
        self.enough = asyncio.Event()

    def add(self, episode_id: str, response_id: str) -> None:
        self.append((episode_id, response_id))
        if len(self) >= self.target:
            self.enough.set()


async def _agent(client: httpx.AsyncClient, episode: dict[str, Any], acked: Acked, stream: bool) -> None:
    """Call the model until the proxy dies; remember every response the client fully received."""
    auth = {"authorization": f"Bearer {episode['api_key']}"}
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Say one word."}],
        "max_tokens": 3,
        "stream": stream,
    }
    url = f"{episode['base_url']}/chat/completions"
    while True:
        try:
            if not stream:
                response = await client.post(url, json=body, headers=auth)
                if response.status_code != 200:
                    return
                acked.add(episode["id"], response.json()["id"])
                continue
            async with client.stream("POST", url, json=body, headers=auth) as response:
                lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
            if response.status_code == 200 and lines and lines[-1] == "data: [DONE]":
                import json

                acked.add(episode["id"], json.loads(lines[0][6:])["id"])
        except httpx.HTTPError:
            return


async def _run_until_killed(
    proxy: ProxyProcess, episodes: list[dict[str, Any]], calls: int, kill: Any
) -> list[tuple[str, str]]:
    """Run the agents until ``calls`` responses were acknowledged (at most 5 minutes on a busy box),
    then ``kill`` while every agent still has a call in flight."""
    acked = Acked(calls)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=200)) as client:
        agents = [asyncio.create_task(_agent(client, e, acked, stream=i % 2 == 1)) for i, e in enumerate(episodes)]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(acked.enough.wait(), timeout=300)
        kill()
        await asyncio.wait_for(asyncio.gather(*agents), timeout=120)
    return acked


def _stored_ids(proxy: ProxyProcess, episode_id: str) -> set[str]:
    calls = httpx.get(f"{proxy.url}/episodes/{episode_id}", headers=ADMIN, timeout=30).json()["calls"]
    return {c["response"]["id"] for c in calls if c["response"]}


def _make_episodes(proxy: ProxyProcess, n: int) -> list[dict[str, Any]]:
    group = httpx.post(f"{proxy.url}/groups", json={"task_id": "crash", "size": n}, headers=ADMIN).json()
    return group["episode_keys"]


def test_sigterm_finishes_in_flight_calls_and_records_them(vllm_url: str, tmp_path: Path) -> None:
    store = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    proxy = ProxyProcess(upstream_url=vllm_url, store_url=store, workdir=tmp_path)
    proxy.start()
    episodes = _make_episodes(proxy, 20)
    assert proxy.proc is not None
    pid = proxy.proc.pid
    started = time.monotonic()
    acked = asyncio.run(_run_until_killed(proxy, episodes, calls=40, kill=lambda: os.kill(pid, signal.SIGTERM)))
    # uvicorn re-raises the signal after a graceful shutdown, so the exit code is -15 either way;
    # the lifespan's last log line is what proves the drain ran to the end.
    assert proxy.proc.wait(timeout=90) in (0, -signal.SIGTERM)
    assert '"proxy stopped"' in proxy.log_path.read_text(), "graceful shutdown did not finish"
    assert time.monotonic() - started < 120
    restarted = ProxyProcess(upstream_url=vllm_url, store_url=store, workdir=tmp_path, port=proxy.port)
    restarted.start()
    try:
        missing = [(e, r) for e, r in acked if r not in _stored_ids(restarted, e)]
        assert acked and missing == []
    finally:
        restarted.stop()
