"""A refused call is never invisible, a harmless new field never refused, and every base URL answers a probe.

In-process, on the named fake upstream (``fake_upstream``): what is checked is the proxy's own
work at its front door: a refusal's log line, its counter in ``/metrics``, its failed call on the
episode and the dashboard's episode page saying why; the compatibility policy's notes and
counters on an answered call; ``HEAD``/``GET`` on the base URLs a client may probe.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from tests.proxy.conftest import ADMIN, episode_auth, fake_upstream, make_settings, new_group, running_app

SECRET_TEXT = "do-not-log-this-prompt-text"
MESSAGE = {"model": "policy", "max_tokens": 16, "messages": [{"role": "user", "content": SECRET_TEXT}]}


@pytest.fixture
async def client(store_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with running_app(make_settings(store_url), transport=fake_upstream()) as c:
        yield c


async def _calls(client: httpx.AsyncClient, episode_id: str) -> list[dict[str, Any]]:
    return list((await client.get(f"/episodes/{episode_id}", headers=ADMIN)).json()["calls"])


async def _metric(client: httpx.AsyncClient, line: str) -> float | None:
    for row in (await client.get("/metrics")).text.splitlines():
        if row.startswith(line + " "):
            return float(row.split()[-1])
    return None


async def test_a_refused_call_is_logged_counted_and_recorded_on_its_episode(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    group = await new_group(client, size=1)
    episode = group["episode_keys"][0]["id"]
    body = {**MESSAGE, "sampling_boost": 2}
    with caplog.at_level(logging.WARNING, logger="flywheel.refusals"):
        response = await client.post("/v1/messages", json=body, headers=episode_auth(group))
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    (call,) = await _calls(client, episode)
    assert (call["status_code"], call["api"], call["client_request"], call["choices"]) == (400, "messages", body, [])
    assert call["error"]["param"] == "sampling_boost" and call["notes"] == {"refused": "unsupported_parameter"}
    counted = 'flywheel_refused_calls_total{reason="unsupported_parameter",route="messages"}'
    assert await _metric(client, counted) == 1.0
    (record,) = [r for r in caplog.records if r.name == "flywheel.refusals"]
    assert (record.route, record.reason, record.param, record.episode) == (  # type: ignore[attr-defined]
        "messages",
        "unsupported_parameter",
        "sampling_boost",
        episode,
    )
    assert SECRET_TEXT not in orjson.dumps(vars(record), default=str).decode()  # never the body


async def test_the_episode_page_says_why_an_episode_has_no_answered_call(client: httpx.AsyncClient) -> None:
    group = await new_group(client, size=1)
    episode = group["episode_keys"][0]["id"]
    response = await client.post(
        "/v1/responses", json={"model": "policy", "input": "x", "background": True}, headers=episode_auth(group)
    )
    assert response.status_code == 400
    page = await client.get(f"/ui/episodes/{episode}", headers=ADMIN)
    assert page.status_code == 200
    assert "1 of 1 calls refused before reaching the engine" in page.text
    assert "Refused with 400 before it reached the engine (unsupported_parameter)" in page.text
    assert "background responses are not served" in page.text


async def test_a_sampling_rule_refusal_on_the_chat_route_is_recorded(client: httpx.AsyncClient) -> None:
    group = await new_group(client, size=1)
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}
    response = await client.post("/v1/chat/completions", json=body, headers=episode_auth(group))
    assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
    (call,) = await _calls(client, group["episode_keys"][0]["id"])
    assert (call["status_code"], call["api"], call["request"], call["error"]) == (
        400,
        "chat",
        body,
        response.json()["error"],
    )
    assert await _metric(client, 'flywheel_refused_calls_total{reason="invalid_request_error",route="chat"}') == 1.0


@pytest.mark.parametrize(("field", "value"), [("n", -1), ("temperature", -1), ("top_p", 0)])
async def test_a_sampling_value_the_engine_would_refuse_never_reaches_it(
    sqlite_url: str, field: str, value: float
) -> None:
    """``n: -1`` reached the engine (issue 42): a value out of vLLM's range is the proxy's own 400, in
    OpenAI's shape, and the episode holds the refusal only: nothing sent, nothing answered."""
    seen: list[tuple[str, dict[str, Any]]] = []
    async with running_app(make_settings(sqlite_url), fake_upstream(seen)) as client:
        group = await new_group(client, size=1)
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], field: value}
        response = await client.post("/v1/chat/completions", json=body, headers=episode_auth(group))
        calls = await _calls(client, group["episode_keys"][0]["id"])
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", field)
    assert [path for path, _ in seen if path.endswith("/chat/completions")] == []
    assert [(c["status_code"], c["choices"]) for c in calls] == [(400, [])]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/messages", {**MESSAGE, "request_labels": {"team": "rl"}}, "request_labels"),
        ("/v1/responses", {"model": "policy", "input": "hi", "client_info": {"os": "linux"}}, "client_info"),
    ],
)
async def test_an_unknown_metadata_like_field_is_served_noted_and_counted(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], field: str
) -> None:
    group = await new_group(client, size=1)
    response = await client.post(path, json=body, headers=episode_auth(group))
    assert response.status_code == 200, response.text
    (call,) = await _calls(client, group["episode_keys"][0]["id"])
    assert call["status_code"] == 200 and call["notes"]["compat"] == {"ignored": [field]}
    assert call["client_request"] == body and field not in call["request"]
    api = path.rsplit("/", 1)[1]
    assert await _metric(client, f'flywheel_compat_fields_total{{api="{api}",field="other",rule="ignored"}}') == 1.0


@pytest.mark.parametrize("method", ["HEAD", "GET"])
@pytest.mark.parametrize("base", ["", "/v1", "/passthrough", "/passthrough/v1", "/episodes/{id}/v1"])
async def test_every_base_url_answers_a_probe_without_a_key(client: httpx.AsyncClient, method: str, base: str) -> None:
    group = await new_group(client, size=1)
    base = base.format(id=group["episode_keys"][0]["id"])
    for path in (base or "/", f"{base}/api/hello"):
        response = await client.request(method, path)
        assert response.status_code == 200, (method, path, response.text)
        assert response.content == (b"" if method == "HEAD" else b'{"status":"ok"}')


async def test_an_episode_base_url_answers_head_and_its_get_stays_the_admin_api(client: httpx.AsyncClient) -> None:
    group = await new_group(client, size=1)
    episode = group["episode_keys"][0]["id"]
    assert (await client.head(f"/episodes/{episode}")).status_code == 200
    refused = await client.get(f"/episodes/{episode}")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    assert (await client.get(f"/episodes/{episode}", headers=ADMIN)).json()["id"] == episode
