"""Bad input and auth scope on every route: one exact status and OpenAI error type each.

The upstream is the named ``fake_upstream``: these tests isolate the proxy's own validation.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from proxy.app import path_shape
from proxy.metrics import UNSERVED_SHAPES, Metrics
from tests.proxy.conftest import ADMIN, episode_auth, fake_upstream, make_settings, new_group, running_app

AGENT = {"authorization": "Bearer agent-key-0123456789abcdef"}
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def assert_error(response: httpx.Response, status: int, type_: str, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == type_
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    return error


@pytest.fixture
async def client(sqlite_url: str):
    async with running_app(make_settings(sqlite_url), transport=fake_upstream()) as c:
        yield c


# -- authentication and scope ---------------------------------------------------------------------


async def test_model_route_needs_a_key(client: httpx.AsyncClient) -> None:
    group = await new_group(client)
    url = f"/episodes/{group['episode_keys'][0]['id']}/v1/chat/completions"
    assert_error(await client.post(url, json=CHAT), 401, "authentication_error", "invalid_api_key")
    assert_error(
        await client.post(url, json=CHAT, headers={"authorization": "Bearer nope"}), 401, "authentication_error"
    )


async def test_tampered_episode_key_is_refused(client: httpx.AsyncClient) -> None:
    group = await new_group(client)
    key = group["episode_keys"][0]["api_key"]
    forged = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    assert_error(
        await client.post("/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {forged}"}),
        401,
        "authentication_error",
    )


async def test_episode_key_reaches_only_its_own_episode(client: httpx.AsyncClient) -> None:
    group = await new_group(client)
    a, b = group["episode_keys"]
    mine = await client.post(f"/episodes/{a['id']}/v1/chat/completions", json=CHAT, headers=episode_auth(group, 0))
    assert mine.status_code == 200
    by_key = await client.post("/v1/chat/completions", json=CHAT, headers=episode_auth(group, 0))
    assert by_key.status_code == 200  # the key alone names the episode
    assert_error(
        await client.post(f"/episodes/{b['id']}/v1/chat/completions", json=CHAT, headers=episode_auth(group, 0)),
        403,
        "permission_error",
        "wrong_episode",
    )
    assert_error(
        await client.post(
            "/v1/chat/completions", json=CHAT, headers={**episode_auth(group, 0), "x-episode-id": b["id"]}
        ),
        403,
        "permission_error",
        "wrong_episode",
    )
    calls_b = (await client.get(f"/episodes/{b['id']}", headers=ADMIN)).json()["calls"]
    assert calls_b == []


@pytest.mark.parametrize(
    "method,path,body",
    [
        ("POST", "/groups", {"task_id": "t", "size": 2}),
        ("GET", "/groups", None),
        ("POST", "/episodes", {"task_id": "t"}),
        ("GET", "/episodes", None),
        ("GET", "/episodes/{id}", None),
        ("POST", "/episodes/{id}/reward", {"reward": 1.0}),
        ("POST", "/episodes/{id}/abandon", {"reason": "x"}),
        ("GET", "/policy", None),
        ("POST", "/policy/publish", {"adapter_path": "/tmp/x"}),
        ("POST", "/trainer/claim", {}),
        ("POST", "/trainer/ack", {"lease_id": "l", "group_ids": ["g"], "step": 1}),
        ("POST", "/trainer/release", {"lease_id": "l"}),
        ("POST", "/trainer/steps", {"step": 1, "metrics": {}}),
        ("GET", "/trainer/steps", None),
    ],
)
async def test_control_routes_refuse_agent_and_episode_keys(
    client: httpx.AsyncClient, method: str, path: str, body: Any
) -> None:
    group = await new_group(client)
    path = path.replace("{id}", group["episode_keys"][0]["id"])
    for headers in (episode_auth(group, 0), AGENT):
        response = await client.request(method, path, json=body, headers=headers)
        assert_error(response, 403, "permission_error", "admin_only")
    assert_error(await client.request(method, path, json=body), 401, "authentication_error")
    episode = (await client.get(f"/episodes/{group['episode_keys'][0]['id']}", headers=ADMIN)).json()
    assert episode["status"] == "open" and episode["reward"] is None  # an agent cannot reward itself


async def test_agent_key_needs_an_episode_except_on_passthrough(client: httpx.AsyncClient) -> None:
    assert_error(
        await client.post("/v1/chat/completions", json=CHAT, headers=AGENT),
        400,
        "invalid_request_error",
        "missing_episode",
    )
    group = await new_group(client)
    episode_id = group["episode_keys"][0]["id"]
    ok = await client.post("/v1/chat/completions", json=CHAT, headers={**AGENT, "x-episode-id": episode_id})
    assert ok.status_code == 200
    ok = await client.post("/v1/chat/completions", json=CHAT, headers={**AGENT, "x-litellm-session-id": episode_id})
    assert ok.status_code == 200
    passthrough = await client.post("/passthrough/v1/chat/completions", json=CHAT, headers=AGENT)
    assert passthrough.status_code == 200
    assert passthrough.json()["choices"][0]["message"]["content"] == "answer 0"
    calls = (await client.get(f"/episodes/{episode_id}", headers=ADMIN)).json()["calls"]
    assert len(calls) == 2  # the passthrough call was not recorded anywhere


async def test_a_passthrough_call_naming_its_episode_is_recorded_beside_it_never_trained(
    client: httpx.AsyncClient,
) -> None:
    group = await new_group(client)
    mine, other = group["episode_keys"][0], group["episode_keys"][1]
    side = {**AGENT, "x-flywheel-side-of": mine["id"]}
    assert (await client.post("/passthrough/v1/chat/completions", json=CHAT, headers=side)).status_code == 200
    (call,) = (await client.get(f"/episodes/{mine['id']}", headers=ADMIN)).json()["calls"]
    assert call["notes"]["side"] is True and call["policy_version"] is None  # the trainer leaves it out
    assert call["choices"][0]["token_ids"]  # recorded exactly, like any call: a fork can replay it
    assert_error(
        await client.post("/passthrough/v1/chat/completions", json=CHAT, headers={**AGENT, "x-flywheel-side-of": "x"}),
        400,
        "invalid_request_error",
    )
    own_key = {"authorization": f"Bearer {mine['api_key']}", "x-flywheel-side-of": other["id"]}
    assert_error(
        await client.post("/passthrough/v1/chat/completions", json=CHAT, headers=own_key),
        403,
        "permission_error",
        "wrong_episode",
    )
    await client.post(f"/episodes/{mine['id']}/reward", json={"reward": 1.0}, headers=ADMIN)
    closed = await client.post("/passthrough/v1/chat/completions", json=CHAT, headers=side)
    assert closed.status_code == 409  # asked to be recorded on a finished episode: refused, not dropped


# -- malformed model calls ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content,param",
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b"", None),
        (b'{"messages": [{"role": "user", "content": "x"}]}', "model"),
        (b'{"model": "policy", "messages": []}', "messages"),
        (b'{"model": "policy"}', "messages"),
        (b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}', "stream"),
        (b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}', None),
    ],
)
async def test_malformed_chat_is_400(client: httpx.AsyncClient, content: bytes, param: str | None) -> None:
    group = await new_group(client)
    url = f"/episodes/{group['episode_keys'][0]['id']}/v1/chat/completions"
    response = await client.post(
        url, content=content, headers={**episode_auth(group), "content-type": "application/json"}
    )
    error = assert_error(response, 400, "invalid_request_error")
    assert error["param"] == param
    (call,) = (await client.get(f"/episodes/{group['episode_keys'][0]['id']}", headers=ADMIN)).json()["calls"]
    assert (call["status_code"], call["error"], call["choices"]) == (400, error, [])  # the refusal, nothing sent


async def test_completion_without_prompt_is_400(client: httpx.AsyncClient) -> None:
    group = await new_group(client)
    response = await client.post("/v1/completions", json={"model": "policy"}, headers=episode_auth(group))
    assert assert_error(response, 400, "invalid_request_error")["param"] == "prompt"


async def test_unknown_and_malformed_episode_ids(client: httpx.AsyncClient) -> None:
    unknown = str(uuid.uuid4())
    assert_error(
        await client.post(f"/episodes/{unknown}/v1/chat/completions", json=CHAT, headers=ADMIN),
        404,
        "not_found_error",
        "episode_not_found",
    )
    assert_error(
        await client.post("/episodes/not-a-uuid/v1/chat/completions", json=CHAT, headers=ADMIN),
        400,
        "invalid_request_error",
    )
    assert_error(
        await client.post("/v1/chat/completions", json=CHAT, headers={**ADMIN, "x-episode-id": "zzz"}),
        400,
        "invalid_request_error",
    )
    assert_error(await client.get(f"/episodes/{unknown}", headers=ADMIN), 404, "not_found_error")
    assert_error(
        await client.post(f"/episodes/{unknown}/reward", json={"reward": 1}, headers=ADMIN), 404, "not_found_error"
    )
    assert_error(await client.get(f"/groups/{unknown}", headers=ADMIN), 404, "not_found_error")


async def test_body_over_the_limit_is_413(sqlite_url: str) -> None:
    async with running_app(make_settings(sqlite_url, max_body_bytes=4096), transport=fake_upstream()) as client:
        group = await new_group(client)
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
        assert_error(
            await client.post("/v1/chat/completions", json=big, headers=episode_auth(group)),
            413,
            "invalid_request_error",
        )
        assert_error(
            await client.post("/groups", json={"task_id": "t" * 5000, "size": 1}, headers=ADMIN),
            413,
            "invalid_request_error",
        )


async def test_unknown_route_and_method(client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    """Each is answered in the API's shape, logged (the query never: Google's clients put keys there)
    and counted by path shape, an episode's id as ``{id}``: a harness speaking a route the proxy
    lacks leaves a trace."""
    episode = str(uuid.uuid4())
    gemini = f"/episodes/{episode}/v1beta/models/policy:embedContent?key=secret-in-query"
    with caplog.at_level("WARNING", logger="flywheel.app"):
        assert_error(await client.get("/nope", headers=ADMIN), 404, "not_found_error")
        assert_error(await client.get("/v1/chat/completions", headers=ADMIN), 405, "invalid_request_error")
        for _ in range(2):  # under a Gemini mount, in Google's error shape
            answer = await client.post(gemini, json={}, headers=ADMIN)
            assert (answer.status_code, answer.json()["error"]["status"]) == (404, "NOT_FOUND"), answer.text
    logged = [(r.method, r.path, r.status) for r in caplog.records if r.getMessage() == "unserved route"]  # type: ignore[attr-defined]
    shape = "/episodes/{id}/v1beta/models/{model}:embedContent"
    assert logged == [("GET", "/nope", 404), ("GET", "/v1/chat/completions", 405), *[("POST", shape, 404)] * 2]
    assert "secret-in-query" not in caplog.text and episode not in caplog.text
    metrics = (await client.get("/metrics", headers=ADMIN)).text
    assert f'flywheel_unserved_routes_total{{method="POST",path="{shape}"}} 2.0' in metrics
    assert 'flywheel_unserved_routes_total{method="GET",path="/v1/chat/completions"} 1.0' in metrics


def test_unserved_path_shapes_are_bounded() -> None:
    """Past 64 distinct shapes the rest count as ``other``: a scanner cannot grow the label set."""
    metrics = Metrics()
    for i in range(UNSERVED_SHAPES + 10):
        metrics.on_unserved("GET", path_shape(f"/probe-{i}"))
    metrics.on_unserved("GET", path_shape("/probe-0"))
    counted = {s.labels["path"]: s.value for s in metrics.unserved.collect()[0].samples if s.name.endswith("_total")}
    assert len(counted) == UNSERVED_SHAPES + 1 and counted["other"] == 10 and counted["/probe-0"] == 2


# -- control API input ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body,param",
    [
        ({"task_id": "t", "size": 0}, "size"),
        ({"task_id": "", "size": 2}, "task_id"),
        ({"size": 2}, "task_id"),
        ({"task_id": "t", "size": 2, "bogus": 1}, "bogus"),
        ({"task_id": "t", "size": 2, "episode_metadata": [{}]}, "episode_metadata"),
        ({"task_id": "t", "size": 5000}, "size"),
        ({"task_id": "t", "size": 2, "metadata": {"x": float("inf")}}, "metadata"),
    ],
)
async def test_bad_group_is_400_and_writes_nothing(client: httpx.AsyncClient, body: dict[str, Any], param: str) -> None:
    import json

    content = json.dumps(body).encode()  # json.dumps writes Infinity: the proxy must refuse it
    response = await client.post("/groups", content=content, headers={**ADMIN, "content-type": "application/json"})
    error = assert_error(response, 400, "invalid_request_error")
    assert param in (error["param"] or "") or param in error["message"]
    assert (await client.get("/groups", headers=ADMIN)).json()["data"] == []


@pytest.mark.parametrize(
    "content",
    [
        b'{"reward": NaN}',
        b'{"reward": Infinity}',
        b'{"reward": -Infinity}',
        b'{"reward": 1e999}',
        b'{"reward": "high"}',
        b"{}",
        b'{"reward": 1, "extra": 2}',
        b'{"reward": 1, "metadata": {"a": NaN}}',
        b'{"reward": 1, "call_rewards": {"0": NaN}}',
        b"not json",
    ],
)
async def test_bad_reward_is_400_and_episode_stays_open(client: httpx.AsyncClient, content: bytes) -> None:
    group = await new_group(client)
    episode_id = group["episode_keys"][0]["id"]
    response = await client.post(
        f"/episodes/{episode_id}/reward", content=content, headers={**ADMIN, "content-type": "application/json"}
    )
    assert_error(response, 400, "invalid_request_error")
    episode = (await client.get(f"/episodes/{episode_id}", headers=ADMIN)).json()
    assert episode["status"] == "open" and episode["reward"] is None


async def test_reward_is_idempotent_and_conflicts_are_409(client: httpx.AsyncClient) -> None:
    group = await new_group(client)
    episode_id = group["episode_keys"][0]["id"]
    first = await client.post(
        f"/episodes/{episode_id}/reward", json={"reward": 0.5, "metadata": {"a": 1}}, headers=ADMIN
    )
    assert first.status_code == 200 and first.json()["status"] == "rewarded"
    again = await client.post(
        f"/episodes/{episode_id}/reward", json={"reward": 0.5, "metadata": {"a": 1}}, headers=ADMIN
    )
    assert again.status_code == 200 and again.json()["finished_at"] == first.json()["finished_at"]
    assert_error(
        await client.post(f"/episodes/{episode_id}/reward", json={"reward": 1.0}, headers=ADMIN),
        409,
        "conflict_error",
        "reward_conflict",
    )
    assert (await client.get(f"/episodes/{episode_id}", headers=ADMIN)).json()["reward"] == 0.5
    assert_error(
        await client.post(f"/episodes/{episode_id}/abandon", json={"reason": "x"}, headers=ADMIN), 409, "conflict_error"
    )
    # A finished episode takes no more model calls.
    assert_error(
        await client.post(f"/episodes/{episode_id}/v1/chat/completions", json=CHAT, headers=episode_auth(group)),
        409,
        "conflict_error",
        "episode_closed",
    )


async def test_reward_on_abandoned_episode_and_bad_call_ordinal(client: httpx.AsyncClient) -> None:
    group = await new_group(client)
    a, b = (k["id"] for k in group["episode_keys"])
    assert (
        await client.post(f"/episodes/{a}/abandon", json={"reason": "agent crashed"}, headers=ADMIN)
    ).status_code == 200
    assert_error(
        await client.post(f"/episodes/{a}/reward", json={"reward": 1}, headers=ADMIN),
        409,
        "conflict_error",
        "episode_abandoned",
    )
    await client.post(f"/episodes/{b}/v1/chat/completions", json=CHAT, headers=episode_auth(group, 1))
    response = await client.post(f"/episodes/{b}/reward", json={"reward": 1, "call_rewards": {"3": 1.0}}, headers=ADMIN)
    assert assert_error(response, 400, "invalid_request_error")["param"] == "call_rewards"
    ok = await client.post(f"/episodes/{b}/reward", json={"reward": 1, "call_rewards": {"0": 0.25}}, headers=ADMIN)
    assert ok.status_code == 200 and ok.json()["call_rewards"] == {"0": 0.25}
    # One rewarded, one abandoned: finished, but below min_rewarded=2, so the group failed (never trained).
    assert (await client.get(f"/groups/{group['id']}", headers=ADMIN)).json()["status"] == "failed"


@pytest.mark.parametrize("query", ["status=bogus", "limit=0", "limit=100000", "offset=-1", "group_id=xyz"])
async def test_bad_list_filters_are_400(client: httpx.AsyncClient, query: str) -> None:
    assert_error(await client.get(f"/episodes?{query}", headers=ADMIN), 400, "invalid_request_error")


async def test_trainer_api_input(client: httpx.AsyncClient) -> None:
    assert_error(
        await client.post("/trainer/claim", json={"max_groups": 0}, headers=ADMIN), 400, "invalid_request_error"
    )
    assert_error(
        await client.post("/trainer/claim", json={"lease_id": "x"}, headers=ADMIN), 400, "invalid_request_error"
    )
    assert_error(await client.post("/trainer/release", json={}, headers=ADMIN), 400, "invalid_request_error")
    released = await client.post("/trainer/release", json={"lease_id": "nobody-holds-this"}, headers=ADMIN)
    assert released.status_code == 200 and released.json() == {"released": 0}
    assert_error(
        await client.post("/trainer/ack", json={"lease_id": "l", "group_ids": [], "step": 1}, headers=ADMIN),
        400,
        "invalid_request_error",
    )
    assert_error(
        await client.post(
            "/trainer/ack", json={"lease_id": "l", "group_ids": [str(uuid.uuid4())], "step": 1}, headers=ADMIN
        ),
        404,
        "not_found_error",
    )
    assert_error(
        await client.post(
            "/trainer/steps",
            content=b'{"step": 1, "metrics": {"loss": NaN}}',
            headers={**ADMIN, "content-type": "application/json"},
        ),
        400,
        "invalid_request_error",
    )


async def test_publish_input_and_conflicts(sqlite_url: str) -> None:
    def refuse_bad_path(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/v1/load_lora_adapter" and body["lora_path"] == "/missing":
            return httpx.Response(400, json={"error": {"message": "No adapter found for /missing", "code": 400}})
        return None

    async with running_app(make_settings(sqlite_url), transport=fake_upstream(respond=refuse_bad_path)) as client:
        assert_error(
            await client.post("/policy/publish", json={"adapter_path": "/missing"}, headers=ADMIN),
            400,
            "invalid_request_error",
            "adapter_rejected",
        )
        assert (await client.get("/policy", headers=ADMIN)).json()["version"] == 0  # nothing switched
        assert_error(await client.post("/policy/publish", json={}, headers=ADMIN), 400, "invalid_request_error")
        ok = await client.post("/policy/publish", json={"adapter_path": "/adapters/v3", "version": 3}, headers=ADMIN)
        assert ok.status_code == 201 and ok.json()["name"] == "policy-v3"
        assert_error(
            await client.post("/policy/publish", json={"adapter_path": "/adapters/v2", "version": 2}, headers=ADMIN),
            409,
            "conflict_error",
            "version_conflict",
        )
        assert (await client.get("/policy", headers=ADMIN)).json()["version"] == 3
