"""Malformed upstream answers on every model API: a clean 502, recorded as a failed call, never a 500.

``malformed_upstream`` is the named fake vLLM for these cases: chat completions get one broken
answer (a whole body, or a stream of given events), every other path is ``fake_upstream``'s. A
negative usage count once raised inside the metrics after the call's record committed, so a
recorded success was answered 500.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import orjson
import pytest

from tests.proxy.conftest import (
    ADMIN,
    episode_auth,
    fake_upstream,
    fake_vllm_completion,
    make_settings,
    new_group,
    running_app,
)


def _deep(depth: int) -> Any:
    """A value nested ``depth`` arrays deep (orjson writes at most 254: written with json)."""
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


Answer = Callable[[dict[str, Any]], bytes]
"""A broken non-streamed answer, made from the upstream body the proxy sent."""


def _with(**fields: Any) -> Answer:
    return lambda body: orjson.dumps({**fake_vllm_completion(body), **fields})


def _choice(**fields: Any) -> Answer:
    def answer(body: dict[str, Any]) -> bytes:
        good = fake_vllm_completion(body)
        return orjson.dumps({**good, "choices": [{**good["choices"][0], **fields}]})

    return answer


BROKEN_ANSWERS: dict[str, Answer] = {
    "negative usage": _with(usage={"prompt_tokens": -3, "completion_tokens": -2, "total_tokens": -5}),
    "non-integer usage": _with(usage={"prompt_tokens": "3", "completion_tokens": 2.5, "total_tokens": 5}),
    "absurd usage": _with(usage={"prompt_tokens": 3, "completion_tokens": 2**40, "total_tokens": 2**40 + 3}),
    "usage not an object": _with(usage=[3, 2]),
    "empty choices": _with(choices=[]),
    "no choices": lambda body: orjson.dumps({k: v for k, v in fake_vllm_completion(body).items() if k != "choices"}),
    "choice not an object": _with(choices=["answer"]),
    "message not an object": _choice(message="answer"),
    "content not a string": _choice(message={"role": "assistant", "content": {"text": "answer"}}),
    "token ids not integers": _choice(token_ids=["42", None]),
    "logprob missing": _choice(logprobs={"content": [{"token": "answer"}]}),
    "tool call not an object": _choice(message={"role": "assistant", "content": None, "tool_calls": ["f()"]}),
    "prompt ids not a list": _with(prompt_token_ids="1 2 3"),
    "nested past 128 levels": lambda body: json.dumps({**fake_vllm_completion(body), "x": _deep(300)}).encode(),
    "malformed JSON": lambda body: b'{"id": "chatcmpl-1", "choices": [',
    "a JSON array": lambda body: b"[1, 2, 3]",
    "empty body": lambda body: b"",
}


def good_chunks(model: str) -> list[dict[str, Any]]:
    base = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": model}
    return [
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
                    "delta": {"content": "Hi"},
                    "token_ids": [42],
                    "logprobs": {"content": [{"token": "Hi", "logprob": -0.5}]},
                    "finish_reason": "stop",
                    "stop_reason": None,
                }
            ],
        },
        {**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}},
    ]


def sse(*payloads: bytes) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads) + b"data: [DONE]\n\n"


Stream = Callable[[dict[str, Any]], bytes]
"""A broken stream's bytes, made from the upstream body the proxy sent."""


def _last_usage(usage: Any) -> Stream:
    def stream(body: dict[str, Any]) -> bytes:
        chunks = good_chunks(body["model"])
        chunks[-1]["usage"] = usage
        return sse(*(orjson.dumps(c) for c in chunks))

    return stream


BROKEN_STREAMS: dict[str, Stream] = {
    "negative usage": _last_usage({"prompt_tokens": 3, "completion_tokens": -1, "total_tokens": 2}),
    "non-integer usage": _last_usage({"prompt_tokens": 3, "completion_tokens": "1", "total_tokens": 4}),
    "absurd usage": _last_usage({"prompt_tokens": 2**63, "completion_tokens": 1, "total_tokens": 4}),
    "empty choices": lambda body: sse(orjson.dumps(good_chunks(body["model"])[-1])),
    "malformed JSON": lambda body: sse(orjson.dumps(good_chunks(body["model"])[0]), b'{"choices": [{"delta"'),
    "a JSON number": lambda body: sse(b"5"),
    "choices not a list": lambda body: sse(orjson.dumps({**good_chunks(body["model"])[0], "choices": "hi"})),
    "delta not an object": lambda body: sse(
        orjson.dumps({**good_chunks(body["model"])[1], "choices": [{"index": 0, "delta": "Hi", "finish_reason": None}]})
    ),
    "choice index null": lambda body: sse(
        orjson.dumps({**good_chunks(body["model"])[1], "choices": [{"index": None, "delta": {"content": "Hi"}}]})
    ),
    "tool call index null": lambda body: sse(
        orjson.dumps(
            {
                **good_chunks(body["model"])[1],
                "choices": [
                    {
                        "index": 0,
                        "delta": {"tool_calls": [{"index": None, "function": {"name": "f", "arguments": "{}"}}]},
                    }
                ],
            }
        )
    ),
    "nested past 128 levels": lambda body: sse(json.dumps({**good_chunks(body["model"])[1], "x": _deep(300)}).encode()),
    "choice index not an integer": lambda body: sse(
        orjson.dumps({**good_chunks(body["model"])[1], "choices": [{"index": [0], "delta": {"content": "Hi"}}]})
    ),
}


class SSEBody(httpx.AsyncByteStream):
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.raw


def malformed_upstream(answer: Answer | None = None, stream: Stream | None = None) -> httpx.MockTransport:
    """A named fake vLLM that answers chat completions with ``answer`` (plain) or ``stream`` (streamed)."""

    def respond(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path != "/v1/chat/completions":
            return None
        if body.get("stream"):
            raw = stream(body) if stream else sse(*(orjson.dumps(c) for c in good_chunks(body["model"])))
            return httpx.Response(200, stream=SSEBody(raw), headers={"content-type": "text/event-stream"})
        raw = answer(body) if answer else orjson.dumps(fake_vllm_completion(body))
        return httpx.Response(200, content=raw, headers={"content-type": "application/json"})

    return fake_upstream(respond=respond)


MESSAGES = [{"role": "user", "content": "hi"}]
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": "policy", "messages": MESSAGES}),
    "responses": ("/v1/responses", {"model": "policy", "input": "hi"}),
    "messages": ("/v1/messages", {"model": "policy", "max_tokens": 8, "messages": MESSAGES}),
}


def assert_api_error(api: str, error: dict[str, Any]) -> None:
    """``error``, a whole error body, is the 502 in ``api``'s own shape."""
    if api == "messages":
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        assert error["error"]["type"] == "api_error" and "malformed answer" in error["error"]["message"]
    else:
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert (error["error"]["type"], error["error"]["code"]) == ("upstream_error", "malformed_answer")


async def assert_recorded_as_failed(client: httpx.AsyncClient, group: dict[str, Any]) -> None:
    episode = await client.get(f"/episodes/{group['episode_keys'][0]['id']}", headers=ADMIN)
    [call] = episode.json()["calls"]
    assert (call["status_code"], call["error"]["type"], call["choices"]) == (502, "upstream_error", [])


@pytest.mark.parametrize("api", BODIES)
@pytest.mark.parametrize("case", BROKEN_ANSWERS)
async def test_a_malformed_answer_is_a_502_recorded_as_failed(sqlite_url: str, api: str, case: str) -> None:
    async with running_app(make_settings(sqlite_url), malformed_upstream(answer=BROKEN_ANSWERS[case])) as client:
        group = await new_group(client, size=1)
        path, body = BODIES[api]
        response = await client.post(path, json=body, headers=episode_auth(group))
        assert response.status_code == 502, response.text
        assert_api_error(api, response.json())
        await assert_recorded_as_failed(client, group)
        passthrough = await client.post(f"/passthrough{path}", json=body, headers=ADMIN)
        assert passthrough.status_code == 502, passthrough.text  # unrecorded: read all the same
        assert_api_error(api, passthrough.json())


def _last_event(api: str, raw: bytes) -> dict[str, Any]:
    events = [e for e in raw.decode().split("\n\n") if e.strip()]
    data = [line[6:] for line in events[-1].split("\n") if line.startswith("data: ")]
    last: dict[str, Any] = orjson.loads(data[0])
    if api == "responses":  # a Responses error event carries the error's fields at its top level
        assert last["type"] == "error"
        return {
            "error": {
                "message": last["message"],
                "type": "upstream_error",
                "param": last["param"],
                "code": last["code"],
            }
        }
    return last


@pytest.mark.parametrize("api", BODIES)
@pytest.mark.parametrize("case", BROKEN_STREAMS)
async def test_a_malformed_stream_ends_in_an_error_event_recorded_as_failed(
    sqlite_url: str, api: str, case: str
) -> None:
    async with running_app(make_settings(sqlite_url), malformed_upstream(stream=BROKEN_STREAMS[case])) as client:
        group = await new_group(client, size=1)
        path, body = BODIES[api]
        response = await client.post(path, json={**body, "stream": True}, headers=episode_auth(group))
        assert response.status_code == 200, response.text  # the stream had begun: its error is its last event
        assert b"[DONE]" not in response.content and b"response.completed" not in response.content
        assert b"message_stop" not in response.content
        assert_api_error(api, _last_event(api, response.content))
        await assert_recorded_as_failed(client, group)


async def test_the_fake_answers_well_when_nothing_is_broken(sqlite_url: str) -> None:
    """The cases above fail for what each breaks, not for the fake itself."""
    async with running_app(make_settings(sqlite_url), malformed_upstream()) as client:
        group = await new_group(client, size=1)
        for path, body in BODIES.values():
            for stream in (False, True):
                response = await client.post(path, json={**body, "stream": stream}, headers=episode_auth(group))
                assert response.status_code == 200, response.text
                assert b"malformed" not in response.content


async def test_count_tokens_with_a_malformed_tokenize_answer_is_a_502(sqlite_url: str) -> None:
    answers = iter([b"{not json", b"[7]", b'{"count": -1}', b'{"count": true}'])

    def tokenize(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/tokenize":
            return httpx.Response(200, content=next(answers))
        return None

    async with running_app(make_settings(sqlite_url), fake_upstream(respond=tokenize)) as client:
        group = await new_group(client, size=1)
        for _ in range(4):
            response = await client.post(
                "/v1/messages/count_tokens", json={"model": "policy", "messages": MESSAGES}, headers=episode_auth(group)
            )
            assert response.status_code == 502, response.text
            assert response.json()["error"]["type"] == "api_error"


async def test_models_with_a_malformed_answer_is_a_502(sqlite_url: str) -> None:
    broken = {"models": False}

    def models(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/v1/models" and broken["models"]:
            return httpx.Response(200, content=next(answers))
        return None

    answers = iter([b"{not json", b'{"data": "policy-base"}', b'{"data": [1]}'])
    async with running_app(make_settings(sqlite_url), fake_upstream(respond=models)) as client:
        broken["models"] = True  # after the start, whose replica sync lists the models too
        for _ in range(3):
            response = await client.get("/passthrough/v1/models", headers=ADMIN)
            assert response.status_code == 502, response.text
            assert response.json()["error"]["code"] == "malformed_answer"
