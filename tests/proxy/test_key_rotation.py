"""Rotating the admin key without a restart (``proxy/keyfile.py``, ``KeyRing.replace``).

What an operator does: write the new key into the key file (replacing it whole), then SIGHUP or
wait for the poll. What the clients see: the new key works at once; the old key, the episode keys
it signed and the dashboard sessions it signed keep working for ``auth.rotation_grace_s`` (or for
as long as the old key stays listed as a second line), then get 401 (sessions: the login page).
The in-process app runs on the named fake upstream (``fake_upstream``): these tests isolate the
proxy's key handling; no model is involved.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.auth import KeyRing, Principal
from proxy.keyfile import KeyFile, KeyFileError, read_keys
from proxy.settings import load_settings
from proxy.ui.session import COOKIE, SessionTokens
from tests.proxy.conftest import fake_upstream, make_settings, running_app

OLD = "old-admin-key-0123456789abcdef"
NEW = "new-admin-key-0123456789abcdef"
NEWER = "newer-admin-key-0123456789abcdef"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def write_key_file(path: Path, *keys: str) -> None:
    """Replace the file whole (write, then rename), as a secret mount or ``mv`` does."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(f"{k}\n" for k in keys))
    os.replace(tmp, path)


def test_a_retired_key_and_its_episode_keys_work_for_the_grace_window_then_not() -> None:
    clock = Clock()
    ring = KeyRing(OLD, [], clock=clock)
    running = str(uuid.uuid4())
    old_episode_key = ring.episode_key(running)
    assert ring.replace([NEW], grace_s=600) == 1
    new_episode = str(uuid.uuid4())
    new_episode_key = ring.episode_key(new_episode)
    assert KeyRing(NEW, []).identify(new_episode_key) == Principal("episode", new_episode)  # signed with NEW
    assert KeyRing(OLD, []).identify(new_episode_key) is None
    assert ring.identify(NEW) == Principal("admin")
    assert ring.identify(OLD) == Principal("admin", retiring=True)
    assert ring.identify(old_episode_key) == Principal("episode", running, retiring=True)
    assert ring.admin_keys() == [NEW, OLD] and ring.retiring == 1
    clock.now += 600.5
    assert ring.identify(OLD) is None and ring.identify(old_episode_key) is None
    assert ring.identify(NEW) == Principal("admin") and ring.identify(new_episode_key) == Principal(
        "episode", new_episode
    )
    assert ring.admin_keys() == [NEW] and ring.retiring == 0


def test_a_listed_earlier_key_stays_until_removed_and_each_retired_key_keeps_its_deadline() -> None:
    clock = Clock()
    ring = KeyRing(OLD, [], clock=clock)
    old_episode_key = ring.episode_key(str(uuid.uuid4()))
    assert ring.replace([NEW, OLD], grace_s=60) == 0  # the old key as a second line: no window
    clock.now += 10_000
    assert ring.identify(OLD) == Principal("admin") and ring.identify(old_episode_key) is not None
    assert ring.replace([NEW], grace_s=60) == 1  # removed: its window starts now
    clock.now += 30
    assert ring.replace([NEWER], grace_s=60) == 1  # NEW retires; OLD keeps its own deadline
    clock.now += 31
    assert ring.identify(OLD) is None and ring.identify(NEW) == Principal("admin", retiring=True)
    assert ring.replace([NEWER, OLD], grace_s=60) == 0  # listed again: accepted again
    assert ring.identify(OLD) == Principal("admin")
    assert ring.replace([NEWER], grace_s=0) == 1  # no grace: gone at once (a leaked key)
    assert ring.identify(OLD) is None


def test_sessions_signed_with_a_retired_key_last_as_long_as_that_key() -> None:
    clock = Clock()
    ring = KeyRing(OLD, [], clock=clock)
    tokens = SessionTokens(ring.admin_keys)
    old_session = tokens.issue()
    ring.replace([NEW], grace_s=60)
    new_session = tokens.issue()
    assert tokens.valid(old_session) and tokens.valid(new_session)
    assert SessionTokens(NEW).valid(new_session) and not SessionTokens(NEW).valid(old_session)
    clock.now += 61
    assert not tokens.valid(old_session) and tokens.valid(new_session)


def test_the_key_file_format_and_what_it_refuses(tmp_path: Path) -> None:
    path = tmp_path / "admin.key"
    path.write_text(f"# rotated on Monday\n\n  {NEW}  \n{OLD}\n{NEW}\n")
    assert read_keys(path) == [NEW, OLD]
    short = "short-key-123"
    for text, why in [("", "holds no key"), ("# only a comment\n", "holds no key"), (f"{NEW}\n{short}\n", "key 2")]:
        path.write_text(text)
        with pytest.raises(KeyFileError, match=why) as refused:
            read_keys(path)
        assert short not in str(refused.value) and NEW not in str(refused.value)
    with pytest.raises(KeyFileError, match="cannot read"):
        read_keys(tmp_path / "missing.key")


def test_a_bad_file_keeps_the_keys_in_use_and_says_why_without_the_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "admin.key"
    write_key_file(path, OLD)
    ring = KeyRing(OLD, [])
    outcomes: list[str] = []
    watcher = KeyFile(path, ring, [OLD], grace_s=60, on_reload=outcomes.append)
    bad = "too-short-key"
    write_key_file(path, bad)
    with caplog.at_level(logging.WARNING, logger="flywheel.auth"):
        assert watcher.reload() == "refused"
        assert watcher.reload() == "refused"  # warned once per distinct problem
    assert ring.identify(OLD) == Principal("admin") and ring.identify(bad) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "key 1" in warnings[0] and bad not in warnings[0]
    path.write_text("")  # a writer that truncates first: read between its two steps
    assert watcher.reload() == "refused" and ring.identify(OLD) == Principal("admin")
    write_key_file(path, NEW)
    assert watcher.reload() == "rotated" and watcher.reload() == "unchanged"
    assert outcomes == ["refused", "refused", "refused", "rotated", "unchanged"]


def test_serve_hands_the_app_the_key_file_so_the_key_can_rotate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m proxy serve`` without FLYWHEEL_ADMIN_KEY: the app is pointed at the key file
    (what it re-reads); with FLYWHEEL_ADMIN_KEY set the key is fixed, as before."""
    from proxy.__main__ import ensure_admin_key

    for name in ("FLYWHEEL_ADMIN_KEY", "FLYWHEEL_ADMIN_KEY_FILE"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    path = tmp_path / "admin.key"
    write_key_file(path, NEW, OLD)
    ensure_admin_key(path)
    assert os.environ["FLYWHEEL_ADMIN_KEY_FILE"] == str(path.resolve()) and os.environ["FLYWHEEL_ADMIN_KEY"] == NEW
    settings = load_settings(upstreams=[{"name": "vllm-0", "url": "http://upstream-0"}])
    assert settings.auth.admin_key_file == str(path.resolve())
    monkeypatch.delenv("FLYWHEEL_ADMIN_KEY_FILE")
    monkeypatch.setenv("FLYWHEEL_ADMIN_KEY", OLD)
    ensure_admin_key(tmp_path / "other.key")
    assert "FLYWHEEL_ADMIN_KEY_FILE" not in os.environ and not (tmp_path / "other.key").exists()


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _until(condition: Callable[[], Any], what: str) -> None:
    """Wait for a condition the app reaches by itself (a signal handled, a poll), failing after 10 s."""
    for _ in range(1000):
        if await condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached: {what}")


@pytest.fixture
async def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin.key"
    write_key_file(path, OLD)
    return path


@pytest.fixture
async def client(sqlite_url: str, key_file: Path) -> AsyncIterator[httpx.AsyncClient]:
    """The app reading its admin key from ``key_file``, re-read on SIGHUP only (no poll)."""
    auth = {"admin_key_file": str(key_file), "key_reload_s": 0, "rotation_grace_s": 600}
    async with running_app(make_settings(sqlite_url, auth=auth), transport=fake_upstream()) as client:
        yield client


async def _chat(client: httpx.AsyncClient, episode: dict[str, str]) -> httpx.Response:
    body = {"model": "policy", "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 4}
    return await client.post(
        f"/episodes/{episode['id']}/v1/chat/completions", json=body, headers=_auth(episode["api_key"])
    )


async def _login(client: httpx.AsyncClient, key: str) -> str:
    response = await client.post("/ui/login", data={"key": key, "next": "/ui/"})
    assert response.status_code == 303, response.text
    return str(response.cookies[COOKIE])


async def _metric(client: httpx.AsyncClient, line: str) -> float | None:
    text = (await client.get("/metrics")).text
    for row in text.splitlines():
        if row.startswith(line + " "):
            return float(row.rsplit(" ", 1)[1])
    return None


async def test_sighup_rotates_the_admin_key_while_running_episodes_keep_working(
    client: httpx.AsyncClient, key_file: Path
) -> None:
    created = await client.post("/groups", json={"task_id": "rotation", "size": 2}, headers=_auth(OLD))
    assert created.status_code == 201, created.text
    running = created.json()["episode_keys"]
    assert (await _chat(client, running[0])).status_code == 200
    old_session = await _login(client, OLD)

    write_key_file(key_file, NEW)
    assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_DFL, None)  # else SIGHUP would end pytest
    os.kill(os.getpid(), signal.SIGHUP)  # the app's handler runs on this test's event loop
    await _until(lambda: _accepted(client, NEW), "the new key accepted after SIGHUP")

    assert (await client.get("/groups", headers=_auth(OLD))).status_code == 200  # grace window
    assert (await _chat(client, running[1])).status_code == 200  # an episode running across the rotation
    client.cookies.set(COOKIE, old_session, path="/ui")
    assert (await client.get("/ui/", follow_redirects=False)).status_code == 200
    created = await client.post("/groups", json={"task_id": "rotation", "size": 1}, headers=_auth(NEW))
    fresh = created.json()["episode_keys"][0]
    assert (await _chat(client, fresh)).status_code == 200
    assert KeyRing(NEW, []).identify(fresh["api_key"]) is not None  # new episodes are signed with the new key
    assert await _metric(client, 'flywheel_admin_key_reloads_total{outcome="rotated"}') == 1
    assert await _metric(client, 'flywheel_auth_retiring_used_total{role="admin"}') == 1
    assert await _metric(client, 'flywheel_auth_retiring_used_total{role="episode"}') == 1
    assert await _metric(client, "flywheel_auth_retiring_keys") == 1

    ring: KeyRing = client.app.state.services.keys  # type: ignore[attr-defined]
    ring._clock = lambda: 10**12  # the grace window is over (no sleeping in tests)
    refused = await client.get("/groups", headers=_auth(OLD))
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert (await _chat(client, running[1])).status_code == 401
    assert (await client.get("/ui/", follow_redirects=False)).status_code == 303  # back to the login form
    assert (await _chat(client, fresh)).status_code == 200
    assert (await client.get("/groups", headers=_auth(NEW))).status_code == 200
    assert await _metric(client, "flywheel_auth_retiring_keys") == 0


async def _accepted(client: httpx.AsyncClient, key: str) -> bool:
    return (await client.get("/policy", headers=_auth(key))).status_code == 200


async def test_replicas_sharing_the_key_file_follow_it_by_polling(sqlite_url: str, key_file: Path) -> None:
    """Two proxies on one store and one key file (a mounted secret), no signal: each re-reads the
    file every ``key_reload_s``, and an episode key one mints after the change is accepted by the
    other."""
    auth = {"admin_key_file": str(key_file), "key_reload_s": 0.05, "rotation_grace_s": 600}
    settings = make_settings(sqlite_url, auth=auth)
    async with running_app(settings, transport=fake_upstream()) as first:
        async with running_app(settings, transport=fake_upstream()) as second:
            write_key_file(key_file, NEW)
            for replica in (first, second):
                await _until(lambda r=replica: _accepted(r, NEW), "every replica accepts the new key")
            created = await first.post("/groups", json={"task_id": "replicas", "size": 1}, headers=_auth(NEW))
            minted = created.json()["episode_keys"][0]
            assert (await _chat(second, minted)).status_code == 200
            assert await _accepted(second, OLD)  # still in its grace window on both


def test_clients_reading_the_key_file_send_its_first_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the old key is listed as a second line, the trainer, the workflows and the launcher
    read the file too: each sends the current key, not both lines."""
    from deploy.stack import admin_key as launcher_key
    from trainer.config import TrainerConfig
    from workflows.__main__ import admin_key as workflows_key

    monkeypatch.delenv("FLYWHEEL_ADMIN_KEY", raising=False)
    path = tmp_path / "admin.key"
    write_key_file(path, "# rotated today", NEW, OLD)
    assert TrainerConfig(admin_key_file=str(path)).admin_key() == NEW
    assert workflows_key(path) == NEW
    assert launcher_key(tmp_path) == NEW
