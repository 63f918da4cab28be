"""Failed key checks per client (``proxy/throttle.py``): 429 with Retry-After after too many wrong
keys, in each API's error shape, on the control API, the model routes and the dashboard's login."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from proxy.errors import TooManyRequests
from proxy.store.db import migrate_async
from proxy.throttle import MAX_CLIENTS, FailedAuth
from tests.proxy.conftest import ADMIN, fake_upstream, make_settings, running_app
from tests.support.services import ADMIN_KEY

WRONG = {"Authorization": "Bearer wrong-key-0123456789abcdef"}


def test_a_client_over_the_limit_waits_until_its_oldest_failure_leaves_the_window() -> None:
    now = [1000.0]
    failures = FailedAuth(3, 60.0, clock=lambda: now[0])
    for _ in range(2):
        failures.failed("10.0.0.1")
        now[0] += 10
    failures.check("10.0.0.1")  # two failures: still allowed
    failures.failed("10.0.0.1")  # third, at t=1020
    with pytest.raises(TooManyRequests) as refused:
        failures.check("10.0.0.1")
    assert refused.value.status_code == 429 and refused.value.headers() == {"retry-after": "40"}
    failures.check("10.0.0.2")  # another client is not affected
    now[0] = 1060.5  # the first failure (t=1000) has left the window
    failures.check("10.0.0.1")
    assert failures.refused == 1
    off = FailedAuth(0, 60.0)
    for _ in range(100):
        off.failed("10.0.0.1")
    off.check("10.0.0.1")


def test_memory_is_bounded() -> None:
    failures = FailedAuth(3, 60.0)
    for i in range(MAX_CLIENTS + 50):
        failures.failed(f"client-{i}")
    assert len(failures._failures) == MAX_CLIENTS and "client-0" not in failures._failures


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
    await migrate_async(url)
    settings = make_settings(url, auth={"admin_key": ADMIN_KEY, "failed_limit": 3, "failed_window_s": 60})
    async with running_app(settings, transport=fake_upstream()) as client:
        yield client


async def test_wrong_keys_then_429_with_retry_after_even_for_the_right_key(client: httpx.AsyncClient) -> None:
    for _ in range(5):  # no key at all is not a guess: never counted
        assert (await client.get("/groups")).status_code == 401
    for _ in range(3):
        response = await client.get("/groups", headers=WRONG)
        assert response.status_code == 401
    refused = await client.get("/groups", headers=ADMIN)
    assert refused.status_code == 429
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_failed_auth"
    # Every keyed route, in its own API's error shape.
    chat = await client.post("/v1/chat/completions", headers=ADMIN, json={"model": "policy", "messages": []})
    assert chat.status_code == 429 and chat.json()["error"]["type"] == "rate_limit_error"
    messages = await client.post(
        "/v1/messages", headers={"x-api-key": ADMIN_KEY}, json={"model": "policy", "max_tokens": 8, "messages": []}
    )
    assert messages.status_code == 429 and "retry-after" in messages.headers
    assert messages.json() == {"type": "error", "error": {"type": "rate_limit_error", "message": error["message"]}}
    dashboard = await client.get("/ui/", headers=ADMIN)
    assert dashboard.status_code == 429
    assert (await client.get("/healthz")).status_code == 200  # unkeyed routes stay open


async def test_the_login_form_is_limited_too(client: httpx.AsyncClient) -> None:
    form = {"content-type": "application/x-www-form-urlencoded"}
    for _ in range(3):
        response = await client.post("/ui/login", content="key=not-the-admin-key&next=/ui/", headers=form)
        assert response.status_code == 401
    response = await client.post("/ui/login", content=f"key={ADMIN_KEY}&next=/ui/", headers=form)
    assert response.status_code == 429 and "retry-after" in response.headers
    assert "too many failed key checks" in response.text and ADMIN_KEY not in response.text
    assert "fw_ui_session" not in response.headers.get("set-cookie", "")
