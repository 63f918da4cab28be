"""Upstream failures, engine protection and replica choice, isolated with the named fake upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest

from tests.proxy.conftest import ADMIN, episode_auth, fake_upstream, make_settings, new_group, running_app
from tests.proxy.test_errors_and_auth import assert_error

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def _calls(client: httpx.AsyncClient, episode_id: str) -> list[dict[str, Any]]:
    return (await client.get(f"/episodes/{episode_id}", headers=ADMIN)).json()["calls"]


@pytest.mark.parametrize(
    "failure,status,type_",
    [
        (httpx.ConnectError("refused"), 502, "upstream_error"),
        (httpx.ReadTimeout("slow"), 504, "timeout_error"),
        (httpx.RemoteProtocolError("garbled"), 502, "upstream_error"),
    ],
)
async def test_transport_failures_become_errors_and_are_recorded(
    sqlite_url: str, failure: Exception, status: int, type_: str
) -> None:
    def fail(request: httpx.Request, _body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/v1/chat/completions":
            raise failure
        return None

    async with running_app(make_settings(sqlite_url), transport=fake_upstream(respond=fail)) as client:
        group = await new_group(client)
        episode_id = group["episode_keys"][0]["id"]
        assert_error(
            await client.post(f"/episodes/{episode_id}/v1/chat/completions", json=CHAT, headers=episode_auth(group)),
            status,
            type_,
        )
        [call] = await _calls(client, episode_id)
        assert call["status_code"] == status and call["error"]["type"] == type_ and call["choices"] == []


@pytest.mark.parametrize(
    "upstream_status,status,type_,code",
    [
        (400, 400, "invalid_request_error", "upstream_rejected"),
        (422, 422, "invalid_request_error", "upstream_rejected"),
        (404, 404, "not_found_error", "model_not_found"),
        (500, 502, "upstream_error", "upstream_error"),
        # The replica refused the proxy's own key: a bad gateway, not the client's request or key.
        (401, 502, "upstream_error", "upstream_auth_failed"),
    ],
)
async def test_upstream_error_answers_keep_their_message(
    sqlite_url: str, upstream_status: int, status: int, type_: str, code: str
) -> None:
    def answer(request: httpx.Request, _body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(
                upstream_status,
                json={
                    "error": {"message": "max_tokens is too large", "type": "BadRequestError", "code": upstream_status}
                },
            )
        return None

    async with running_app(make_settings(sqlite_url), transport=fake_upstream(respond=answer)) as client:
        group = await new_group(client)
        for stream in (False, True):
            response = await client.post(
                "/v1/chat/completions", json={**CHAT, "stream": stream}, headers=episode_auth(group)
            )
            assert "max_tokens is too large" in assert_error(response, status, type_, code)["message"]
        assert [c["status_code"] for c in await _calls(client, group["episode_keys"][0]["id"])] == [status, status]


async def test_mid_stream_failure_sends_an_sse_error_event(sqlite_url: str) -> None:
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            chunk = {
                "id": "c1",
                "choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [5]}],
                "prompt_token_ids": [1, 2],
            }
            yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            raise httpx.ReadError("connection reset")

    def answer(request: httpx.Request, _body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(200, stream=Broken(), headers={"content-type": "text/event-stream"})
        return None

    async with running_app(make_settings(sqlite_url), transport=fake_upstream(respond=answer)) as client:
        group = await new_group(client)
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=episode_auth(group))
        events = [e for e in response.text.split("\n\n") if e]
        assert response.status_code == 200 and len(events) == 2
        assert orjson.loads(events[0][6:])["choices"][0]["delta"]["content"] == "Hel"
        assert orjson.loads(events[1][6:])["error"]["type"] == "upstream_error"
        assert "data: [DONE]" not in response.text
        [call] = await _calls(client, group["episode_keys"][0]["id"])
        assert call["status_code"] == 502 and call["error"]["type"] == "upstream_error"


@pytest.mark.parametrize(
    "policy,body,status,dropped",
    [
        ("drop", {"seed": 3, "temperature": 0.8}, 200, True),
        ("drop", {"seed": 3}, 200, True),  # vLLM's default temperature is 1.0: sampled
        ("drop", {"seed": 3, "temperature": 0}, 200, False),  # greedy with a seed is harmless
        ("refuse", {"seed": 3, "temperature": 0.8}, 400, False),
        ("pass", {"seed": 3, "temperature": 0.8}, 200, False),
    ],
)
async def test_the_seed_rule_protects_the_engine(
    sqlite_url: str, policy: str, body: dict[str, Any], status: int, dropped: bool
) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    settings = make_settings(sqlite_url, upstreams=[{"name": "cpu", "url": "http://cpu", "seed_rule": policy}])
    async with running_app(settings, transport=fake_upstream(seen=seen)) as client:
        group = await new_group(client)
        response = await client.post("/v1/chat/completions", json={**CHAT, **body}, headers=episode_auth(group))
        assert response.status_code == status, response.text
        sent = [b for path, b in seen if path.endswith("/chat/completions")]
        if status == 400:
            assert response.json()["error"]["param"] == "seed" and sent == []
            return
        assert ("seed" not in sent[0]) is dropped
        assert (response.headers.get("x-flywheel-dropped") == "seed") is dropped


async def test_client_fields_are_passed_and_additions_removed(sqlite_url: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    async with running_app(make_settings(sqlite_url), transport=fake_upstream(seen=seen)) as client:
        group = await new_group(client)
        body = {
            **CHAT,
            "n": 2,
            "stop": ["x"],
            "response_format": {"type": "json_object"},
            "tool_choice": "none",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "top_k": 5,
        }
        response = await client.post("/v1/chat/completions", json=body, headers=episode_auth(group))
        sent = [b for path, b in seen if path.endswith("/chat/completions")][0]
        assert {k: sent[k] for k in body if k != "model"} == {k: v for k, v in body.items() if k != "model"}
        assert sent["model"] == "policy-base" and sent["return_token_ids"] is True and sent["logprobs"] is True
        data = response.json()
        assert data["prompt_token_ids"] is None
        assert all(c["token_ids"] is None and c["logprobs"] is None for c in data["choices"])
        asked = await client.post(
            "/v1/chat/completions",
            json={**CHAT, "return_token_ids": True, "logprobs": True},
            headers=episode_auth(group),
        )
        assert asked.json()["prompt_token_ids"] == [1, 2, 3]
        assert asked.json()["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.5


async def test_episodes_stick_to_a_replica_and_move_only_when_it_fails(sqlite_url: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    down: set[str] = set()

    def answer(request: httpx.Request, _body: dict[str, Any]) -> httpx.Response | None:
        if request.url.host in down:
            raise httpx.ConnectError("refused")
        return None

    upstreams = [{"name": f"r{i}", "url": f"http://r{i}"} for i in range(3)]
    async with running_app(
        make_settings(sqlite_url, upstreams=upstreams), transport=fake_upstream(seen=seen, respond=answer)
    ) as client:
        group = await new_group(client, size=12)
        hosts: dict[str, set[str]] = {}
        for i, key in enumerate(group["episode_keys"]):
            for _ in range(3):
                seen.clear()
                response = await client.post("/v1/chat/completions", json=CHAT, headers=episode_auth(group, i))
                assert response.status_code == 200
                hosts.setdefault(key["id"], set()).add(next(p for p, _ in seen if p.endswith("completions"))[:2])
        assert all(len(h) == 1 for h in hosts.values())  # sticky
        assert len(set().union(*hosts.values())) > 1  # spread over replicas
        victim_episode, victim_host = next((e, next(iter(h))) for e, h in hosts.items())
        down.add(victim_host)
        index = [k["id"] for k in group["episode_keys"]].index(victim_episode)
        response = await client.post("/v1/chat/completions", json=CHAT, headers=episode_auth(group, index))
        assert response.status_code == 200  # retried on another replica
        calls = await _calls(client, victim_episode)
        assert calls[-1]["replica"] != victim_host and calls[-1]["status_code"] == 200
        health = (await client.get("/healthz")).json()
        assert health["replicas"][victim_host] is False


async def test_policy_aliases_route_to_the_published_adapter(sqlite_url: str) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    settings = make_settings(sqlite_url, policy={"aliases": ["policy", "gpt-4o"], "keep_versions": 2})
    async with running_app(settings, transport=fake_upstream(seen=seen)) as client:
        group = await new_group(client)
        for version in (1, 2, 3):
            published = await client.post("/policy/publish", json={"adapter_path": f"/a/{version}"}, headers=ADMIN)
            assert published.status_code == 201 and published.json()["version"] == version
        unloaded = [b["lora_name"] for p, b in seen if p.endswith("unload_lora_adapter")]
        assert unloaded == ["policy-v1"]  # keep_versions=2: v2 and v3 stay loaded
        seen.clear()
        for model in ("policy", "gpt-4o", "policy-base", "policy-v2"):
            response = await client.post(
                "/v1/chat/completions", json={**CHAT, "model": model}, headers=episode_auth(group)
            )
            assert response.status_code == 200
        assert [b["model"] for p, b in seen if p.endswith("completions")] == [
            "policy-v3",
            "policy-v3",
            "policy-base",
            "policy-v2",
        ]
        calls = await _calls(client, group["episode_keys"][0]["id"])
        assert [c["policy_version"] for c in calls] == [3, 3, 0, 2]
        assert [c["model_requested"] for c in calls] == ["policy", "gpt-4o", "policy-base", "policy-v2"]


async def test_replicas_agree_on_the_policy_through_the_store(sqlite_url: str) -> None:
    """Two proxy replicas on one store: a publish through one routes calls on the other."""
    seen: list[tuple[str, dict[str, Any]]] = []
    settings = make_settings(sqlite_url, policy={"refresh_s": 0.05})
    async with (
        running_app(settings, transport=fake_upstream(seen=seen)) as first,
        running_app(settings, transport=fake_upstream(seen=seen)) as second,
    ):
        group = await new_group(first)
        assert (await first.post("/policy/publish", json={"adapter_path": "/a/1"}, headers=ADMIN)).status_code == 201
        import asyncio

        await asyncio.sleep(0.3)
        response = await second.post("/v1/chat/completions", json=CHAT, headers=episode_auth(group))
        assert response.headers["x-policy-version"] == "1"


async def test_old_versions_are_unloaded_whichever_replica_published_them(sqlite_url: str) -> None:
    engine: dict[str, str] = {}  # one fake engine behind two proxy replicas
    settings = make_settings(sqlite_url, policy={"keep_versions": 3, "refresh_s": 0.05})
    async with (
        running_app(settings, transport=fake_upstream(adapters=engine)) as first,
        running_app(settings, transport=fake_upstream(adapters=engine)) as second,
    ):
        assert (await first.post("/policy/publish", json={"adapter_path": "/a/1"}, headers=ADMIN)).status_code == 201
        for version in range(2, 6):
            published = await second.post("/policy/publish", json={"adapter_path": f"/a/{version}"}, headers=ADMIN)
            assert published.status_code == 201 and published.json()["version"] == version
        assert engine == {"policy-v3": "/a/3", "policy-v4": "/a/4", "policy-v5": "/a/5"}


async def test_a_restarted_replica_gets_the_kept_adapters_back(sqlite_url: str) -> None:
    engine: dict[str, str] = {}
    async with running_app(
        make_settings(sqlite_url, policy={"keep_versions": 2}), transport=fake_upstream(adapters=engine)
    ) as client:
        for version in (1, 2, 3):
            await client.post("/policy/publish", json={"adapter_path": f"/a/{version}"}, headers=ADMIN)
        engine.clear()  # the engine restarted: it lost its adapters
        services = client.app.state.services  # type: ignore[attr-defined]
        replica = services.upstreams.replicas[0]
        replica.healthy = False
        await services.upstreams.check_all(services.adapters.sync_replica)
        assert replica.healthy and engine == {"policy-v2": "/a/2", "policy-v3": "/a/3"}


async def test_a_restarted_replica_without_its_adapters_answers_503_until_synced(sqlite_url: str) -> None:
    """The only replica is down, so the proxy tries it anyway; back up but not yet given its adapters,
    its 404 for the published version is the proxy's state, not the client's bad model: a retryable 503."""
    engine: dict[str, str] = {}

    def missing_adapter(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/v1/chat/completions" and body["model"] not in {"policy-base", *engine}:
            return httpx.Response(404, json={"error": {"message": f"The model `{body['model']}` does not exist."}})
        return None

    async with running_app(
        make_settings(sqlite_url), transport=fake_upstream(respond=missing_adapter, adapters=engine)
    ) as client:
        group = await new_group(client)
        await client.post("/policy/publish", json={"adapter_path": "/a/1"}, headers=ADMIN)
        engine.clear()  # the engine restarted
        services = client.app.state.services  # type: ignore[attr-defined]
        replica = services.upstreams.replicas[0]
        replica.healthy = False
        error = assert_error(
            await client.post("/v1/chat/completions", json=CHAT, headers=episode_auth(group)),
            503,
            "service_unavailable",
            "upstream_not_synced",
        )
        assert "retry" in error["message"]
        await services.upstreams.check_all(services.adapters.sync_replica)
        response = await client.post("/v1/chat/completions", json=CHAT, headers=episode_auth(group))
        assert response.status_code == 200 and response.headers["x-policy-version"] == "1"
        # A healthy replica's 404 stays the client's: a model nobody published.
        assert_error(
            await client.post("/v1/chat/completions", json={**CHAT, "model": "policy-v7"}, headers=episode_auth(group)),
            404,
            "not_found_error",
        )


async def test_a_stale_adapter_under_a_published_name_is_replaced(sqlite_url: str) -> None:
    engine = {"policy-v1": "/old/run/adapter"}  # left over from another run on a shared engine
    async with running_app(make_settings(sqlite_url), transport=fake_upstream(adapters=engine)) as client:
        assert (
            await client.post("/policy/publish", json={"adapter_path": "/new/adapter"}, headers=ADMIN)
        ).status_code == 201
        assert engine == {"policy-v1": "/new/adapter"}
