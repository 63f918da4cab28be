"""The Responses and Messages routes, isolated from the engine by the named fake upstream.

What is checked here is the proxy's own work: what reaches the upstream (a chat request), what
is stored (the chat request, the client's request, its API and answer id), how
``previous_response_id`` is resolved and refused, and that every error comes in the shape of the
API the route serves. Recording exact ids through these routes runs against real vLLM in
``tests/integration/test_dialects_engine.py``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.proxy.conftest import ADMIN, episode_auth, fake_upstream, make_settings, new_group, running_app


def sse_chunks(body: dict[str, Any]) -> bytes:
    """A vLLM-shaped chat stream: role chunk with prompt ids, two content chunks, usage, [DONE]."""
    base = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": body["model"]}
    chunks = [
        {
            **base,
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        },
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "Hel"},
                    "token_ids": [42],
                    "logprobs": {"content": [{"token": "Hel", "logprob": -0.5}]},
                    "finish_reason": None,
                }
            ],
        },
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "lo"},
                    "token_ids": [43],
                    "logprobs": {"content": [{"token": "lo", "logprob": -0.25}]},
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            ],
        },
        {**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    ]
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class Events(httpx.AsyncByteStream):
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.raw


def streaming(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
    if request.url.path == "/v1/chat/completions" and body.get("stream"):
        return httpx.Response(200, stream=Events(sse_chunks(body)), headers={"content-type": "text/event-stream"})
    if request.url.path == "/tokenize":
        return httpx.Response(
            200, json={"count": 7 + len(body.get("tools") or []), "max_model_len": 8192, "tokens": []}
        )
    return None


@pytest.fixture
async def proxy(sqlite_url: str, tmp_path: Path) -> Any:
    seen: list[tuple[str, dict[str, Any]]] = []
    async with running_app(make_settings(sqlite_url), fake_upstream(seen, streaming)) as client:
        client.seen = seen  # type: ignore[attr-defined]
        yield client


async def calls_of(client: httpx.AsyncClient, episode_id: str) -> list[dict[str, Any]]:
    response = await client.get(f"/episodes/{episode_id}", headers=ADMIN)
    return sorted(response.json()["calls"], key=lambda c: c["ordinal"])


# -- Responses -------------------------------------------------------------------------------


async def test_a_response_runs_as_a_recorded_chat_call(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    episode = group["episode_keys"][0]["id"]
    body = {"model": "policy", "input": "hi", "instructions": "Be brief.", "metadata": {"run": "7"}}
    response = await proxy.post("/v1/responses", json=body, headers=episode_auth(group))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["object"] == "response" and answer["output"][0]["content"][0]["text"] == "answer 0"
    assert answer["metadata"] == {"run": "7"} and answer["usage"]["input_tokens"] == 3
    path, sent = proxy.seen[-1]  # type: ignore[attr-defined]
    assert path.endswith("/v1/chat/completions")
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert sent["return_token_ids"] is True and "input" not in sent
    (call,) = await calls_of(proxy, episode)
    assert (call["api"], call["response_id"], call["client_request"]) == ("responses", answer["id"], body)
    assert call["request"]["messages"] == sent["messages"] and call["choices"][0]["token_ids"] == [42, 100]


async def test_previous_response_id_is_resolved_within_the_episode_only(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=2)
    me, other = episode_auth(group, 0), episode_auth(group, 1)
    first = (await proxy.post("/v1/responses", json={"model": "policy", "input": "3*4?"}, headers=me)).json()
    follow = {"model": "policy", "input": "and 5*6?", "previous_response_id": first["id"]}
    assert (await proxy.post("/v1/responses", json=follow, headers=me)).status_code == 200
    _, sent = proxy.seen[-1]  # type: ignore[attr-defined]
    assert sent["messages"] == [
        {"role": "user", "content": "3*4?"},
        {"role": "assistant", "content": "answer 0"},
        {"role": "user", "content": "and 5*6?"},
    ]
    stolen = await proxy.post("/v1/responses", json=follow, headers=other)
    assert stolen.status_code == 403 and stolen.json()["error"]["param"] == "previous_response_id"
    missing = await proxy.post("/v1/responses", json={**follow, "previous_response_id": "resp_nope"}, headers=me)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "previous_response_not_found"
    unstored = (
        await proxy.post("/v1/responses", json={"model": "policy", "input": "x", "store": False}, headers=me)
    ).json()
    refused = await proxy.post("/v1/responses", json={**follow, "previous_response_id": unstored["id"]}, headers=me)
    assert refused.status_code == 404 and "store: false" in refused.json()["error"]["message"]
    passthrough = await proxy.post("/passthrough/v1/responses", json=follow, headers=ADMIN)
    assert passthrough.status_code == 400 and "recorded episode" in passthrough.json()["error"]["message"]


async def test_a_streamed_response_ends_with_completed_after_the_record(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    async with proxy.stream(
        "POST", "/v1/responses", json={"model": "policy", "input": "hi", "stream": True}, headers=episode_auth(group)
    ) as response:
        raw = await response.aread()
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    assert b"[DONE]" not in raw and "chat.completion.chunk" not in raw.decode()
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello" and final["usage"]["output_tokens"] == 2
    episode = group["episode_keys"][0]["id"]
    (call,) = await calls_of(proxy, episode)
    assert call["stream"] is True and call["choices"][0]["token_ids"] == [42, 43] and call["exact_ids"] is True
    assert call["response_id"] == final["id"]


async def test_responses_refusals_are_openai_errors_recorded_as_refused_calls(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    body = {"model": "policy", "input": "x", "background": True}
    response = await proxy.post("/v1/responses", json=body, headers=episode_auth(group))
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": response.json()["error"]["message"],
            "type": "invalid_request_error",
            "param": "background",
            "code": "unsupported_parameter",
        }
    }
    (call,) = await calls_of(proxy, group["episode_keys"][0]["id"])  # the refusal, whole: nothing was sent
    assert (call["status_code"], call["error"], call["api"]) == (400, response.json()["error"], "responses")
    assert (call["client_request"], call["request"], call["choices"]) == (body, {}, [])
    assert call["notes"] == {"refused": "unsupported_parameter"} and call["prompt_token_ids"] is None
    assert len(proxy.seen) == 0 or not any(p.endswith("/chat/completions") for p, _ in proxy.seen)  # type: ignore[attr-defined]


# -- Messages --------------------------------------------------------------------------------


async def test_a_message_runs_as_a_recorded_chat_call(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    body = {"model": "policy", "max_tokens": 16, "system": "Be brief.", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"x-api-key": group["episode_keys"][0]["api_key"], "anthropic-version": "2023-06-01"}
    response = await proxy.post("/v1/messages", json=body, headers=headers)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["type"] == "message" and answer["content"] == [{"type": "text", "text": "answer 0"}]
    assert answer["stop_reason"] == "end_turn" and answer["usage"]["input_tokens"] == 3
    _, sent = proxy.seen[-1]  # type: ignore[attr-defined]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    (call,) = await calls_of(proxy, group["episode_keys"][0]["id"])
    assert (call["api"], call["response_id"], call["client_request"]) == ("messages", answer["id"], body)


async def test_a_streamed_message_holds_message_stop_until_recorded(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    body = {"model": "policy", "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with proxy.stream("POST", "/v1/messages", json=body, headers=episode_auth(group)) as response:
        raw = await response.aread()
    kinds = [line[7:].decode() for line in raw.split(b"\n") if line.startswith(b"event: ")]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds
    (call,) = await calls_of(proxy, group["episode_keys"][0]["id"])
    assert call["api"] == "messages" and call["choices"][0]["token_ids"] == [42, 43]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "kind", "recorded"),
    [
        (
            "/v1/messages",
            {"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
            "episode",
            400,
            "invalid_request_error",
            1,
        ),  # max_tokens is required: a refused call on the episode
        (
            "/v1/messages",
            {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
            "bad",
            401,
            "authentication_error",
            0,  # no episode is known without a key
        ),
        ("/v1/messages/count_tokens", {"model": "policy", "messages": []}, "episode", 400, "invalid_request_error", 0),
        ("/v1/messages", None, "episode", 400, "invalid_request_error", 1),  # not JSON
    ],
)
async def test_messages_errors_come_in_anthropic_shape(
    proxy: httpx.AsyncClient, path: str, body: Any, headers: str, status: int, kind: str, recorded: int
) -> None:
    group = await new_group(proxy, size=1)
    auth = episode_auth(group) if headers == "episode" else {"x-api-key": "wrong"}
    if body is None:
        response = await proxy.post(path, content=b"{not json", headers={**auth, "content-type": "application/json"})
    else:
        response = await proxy.post(path, json=body, headers=auth)
    assert response.status_code == status
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and error["error"]["message"]
    calls = await calls_of(proxy, group["episode_keys"][0]["id"])
    assert [(c["status_code"], c["error"]["type"], c["choices"]) for c in calls] == [(status, kind, [])] * recorded


async def test_an_oversized_message_is_refused_in_anthropic_shape(sqlite_url: str) -> None:
    async with running_app(make_settings(sqlite_url, max_body_bytes=1024), fake_upstream()) as client:
        group = await new_group(client, size=1)
        body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "x" * 4096}]}
        response = await client.post("/v1/messages", json=body, headers=episode_auth(group))
        assert response.status_code == 413
        assert response.json()["error"]["type"] == "request_too_large"


async def test_count_tokens_renders_on_the_engine_and_records_nothing(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    response = await proxy.post("/v1/messages/count_tokens", json=body, headers=episode_auth(group))
    assert response.status_code == 200 and response.json() == {"input_tokens": 8}
    path, sent = proxy.seen[-1]  # type: ignore[attr-defined]
    assert path.endswith("/tokenize") and sent["tools"][0]["function"]["name"] == "f"
    assert await calls_of(proxy, group["episode_keys"][0]["id"]) == []
