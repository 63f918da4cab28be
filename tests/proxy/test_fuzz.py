"""Property-based fuzzing of every route: no 5xx of the proxy's own, every error in its documented shape.

Two sources of requests, bounded and derandomized, so every run sends the same examples in seconds:

- Schemathesis generates each operation's parameters and bodies from the app's OpenAPI schema
  (``EXAMPLES`` per operation, with the admin key, so the control routes get past auth);
- the model routes read raw JSON (their schema has no body), so their bodies come from
  ``model_bodies`` here: a valid chat, Responses or Messages request with fields replaced by wrong
  types, huge and negative numbers, odd Unicode and deep nesting, recorded or passthrough, plain or
  streamed.

The upstream is ``vllm_like_upstream``, a named fake that answers as vLLM does (a 400 for an ``n``
it refuses, a whole answer or a stream otherwise): any 5xx is the proxy's own. The app runs in
Starlette's ``TestClient`` (its lifespan in the client's thread), as Hypothesis drives a
synchronous test.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.core.result import Ok
from starlette.testclient import TestClient

from proxy.app import create_app
from proxy.store.db import migrate_async
from tests.proxy.conftest import ADMIN, fake_upstream, fake_vllm_completion, make_settings
from tests.proxy.test_malformed_upstream import SSEBody, good_chunks, sse

EXAMPLES = 25
"""Examples per operation of the schema: bounded, so ``make test`` stays fast (all of them: ~15 s)."""
BODY_EXAMPLES = 100
"""Examples per model API of ``model_bodies``, where the proxy reads most of what it is sent (~2 s each)."""


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


def vllm_like_upstream() -> httpx.MockTransport:
    """A named fake vLLM that refuses what vLLM refuses about ``n`` and answers everything else."""

    def respond(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"count": 7, "max_model_len": 8192, "tokens": []})
        if request.url.path != "/v1/chat/completions":
            return None
        n = body.get("n", 1)
        if n is None:
            n = 1
        if type(n) is not int or not 1 <= n <= 8:
            return httpx.Response(
                400,
                json={"error": {"message": "n must be an integer in [1, 8]", "type": "BadRequestError", "code": 400}},
            )
        if body.get("stream"):
            raw = sse(*(orjson.dumps(c) for c in good_chunks(str(body["model"]))))
            return httpx.Response(200, stream=SSEBody(raw), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json=fake_vllm_completion({**body, "n": n}))

    return fake_upstream(respond=respond)


def _migrated(path: Path) -> str:
    url = f"sqlite+aiosqlite:///{path / 'flywheel.db'}"
    done = threading.Thread(target=asyncio.run, args=(migrate_async(url),))  # off the test loop's thread
    done.start()
    done.join()
    return url


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    app = create_app(make_settings(_migrated(tmp_path_factory.mktemp("fuzz"))), transport=vllm_like_upstream())
    with TestClient(app, base_url="http://proxy", raise_server_exceptions=False) as client:
        yield client


class Reply(Protocol):
    """A response of either HTTP client (Starlette's ``TestClient`` answers with its own ``Response``)."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


def assert_clean(response: Reply, path: str) -> None:
    """Below 500, and an error in the documented shape of the route's API."""
    assert response.status_code < 500, f"{response.status_code} on {path}: {response.text[:500]}"
    if response.status_code < 400:
        return
    body = response.json()
    if path.endswith(("/v1/messages", "/v1/messages/count_tokens")):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    elif path.endswith((":generateContent", ":streamGenerateContent", ":countTokens")):  # Google's shape
        assert set(body) == {"error"} and set(body["error"]) >= {"code", "message", "status"}, body
        assert body["error"]["code"] == response.status_code and body["error"]["status"], body
        assert body["error"]["message"], body
        return
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and body["error"]["type"], body


# -- every operation, from the OpenAPI schema -------------------------------------------------

SCHEMA = schemathesis.openapi.from_dict(create_app(make_settings("sqlite+aiosqlite:///unused.db")).openapi())


def _operations() -> dict[str, Any]:
    """Every operation of the schema by label (``POST /groups``)."""
    found = {}
    for result in SCHEMA.get_all_operations():
        assert isinstance(result, Ok), result  # an operation the schema cannot describe is a finding too
        found[result.ok().label] = result.ok()
    return found


OPERATIONS = _operations()


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_every_operation_answers_below_500_in_its_error_shape(proxy: TestClient, label: str) -> None:
    operation = OPERATIONS[label]
    modes = [operation.as_strategy(mode) for mode in schemathesis.GenerationMode]

    @fuzz(EXAMPLES)
    @given(case=st.one_of(modes))
    def check(case: Any) -> None:
        sent = case.as_transport_kwargs(base_url="http://proxy", headers=ADMIN)
        response = proxy.request(
            sent["method"],
            sent["url"],
            headers=sent["headers"],
            params=sent["params"],
            content=sent.get("data"),
            json=sent.get("json"),
        )
        assert_clean(response, httpx.URL(sent["url"]).path)

    check()


# -- the model routes' bodies ------------------------------------------------------------------

ODD_NUMBERS = st.sampled_from(
    [-1, 0, -(2**31), 2**31, 2**63, -(2**63) - 1, 2**64, 10**30, 1e308, -1e308, 0.5, -0.0, 5e-324]
)
ODD_TEXT = st.sampled_from(
    [
        "",
        "\u0000",
        "\u202e\u202d",
        "\ufeff",
        "\U0001d518\U0001d52b",
        "e\u0301",
        "\uffff",
        "\\",
        '"',
        "policy\n",
        "\U0010ffff",
        "<|im_end|>",
    ]
) | st.text(max_size=8)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | ODD_NUMBERS
    | ODD_TEXT
)
JSON = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ODD_TEXT, inner, max_size=3), max_leaves=8
)


def nested(depth: int, leaf: Any) -> Any:
    for level in range(depth):
        leaf = [leaf] if level % 2 else {"a": leaf}
    return leaf


DEEP = st.builds(nested, st.integers(min_value=1, max_value=400), SCALARS)
ODD = SCALARS | JSON | DEEP

MESSAGES = [{"role": "user", "content": "hi"}]
APIS: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    "chat": (
        "/v1/chat/completions",
        {"model": "policy", "messages": MESSAGES},
        [
            "model",
            "messages",
            "n",
            "temperature",
            "top_p",
            "top_k",
            "max_tokens",
            "max_completion_tokens",
            "seed",
            "logprobs",
            "top_logprobs",
            "stop",
            "tools",
            "tool_choice",
            "stream_options",
            "return_token_ids",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "response_format",
            "logit_bias",
            "min_tokens",
            "guided_json",
            "structured_outputs",
            "extra",
        ],
    ),
    "responses": (
        "/v1/responses",
        {"model": "policy", "input": "hi"},
        [
            "model",
            "input",
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "tools",
            "tool_choice",
            "text",
            "reasoning",
            "metadata",
            "store",
            "previous_response_id",
            "include",
            "top_logprobs",
            "parallel_tool_calls",
            "truncation",
            "extra",
        ],
    ),
    "messages": (
        "/v1/messages",
        {"model": "policy", "max_tokens": 8, "messages": MESSAGES},
        [
            "model",
            "messages",
            "max_tokens",
            "system",
            "temperature",
            "top_p",
            "top_k",
            "stop_sequences",
            "tools",
            "tool_choice",
            "metadata",
            "thinking",
            "service_tier",
            "extra",
        ],
    ),
}


@st.composite
def model_bodies(draw: st.DrawFn, api: str) -> dict[str, Any]:
    """A valid ``api`` request with up to three fields replaced by odd values, or dropped."""
    _, body, fields = APIS[api]
    body = {**body, "stream": draw(st.booleans())}
    for name in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
        if draw(st.integers(0, 5)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(ODD)
    return body


@pytest.fixture(scope="module")
def episode_key(proxy: TestClient) -> dict[str, str]:
    group = proxy.post("/groups", json={"task_id": "fuzz", "size": 1}, headers=ADMIN).json()
    return {"authorization": f"Bearer {group['episode_keys'][0]['api_key']}"}


ENDINGS = {"chat": b"data: [DONE]", "responses": b"response.completed", "messages": b"message_stop"}


@pytest.mark.parametrize("api", APIS)
def test_model_bodies_answer_below_500_in_their_api_error_shape(
    proxy: TestClient, episode_key: dict[str, str], api: str
) -> None:
    path = APIS[api][0]

    @fuzz(BODY_EXAMPLES)
    @given(body=model_bodies(api), recorded=st.booleans())
    def check(body: dict[str, Any], recorded: bool) -> None:
        url, headers = (path, episode_key) if recorded else (f"/passthrough{path}", ADMIN)
        response = proxy.post(url, content=_encoded(body), headers={**headers, "content-type": "application/json"})
        assert_clean(response, url)
        if response.status_code == 200 and body.get("stream") is True:
            assert ENDINGS[api] in response.content, response.text[-500:]  # a stream that failed ends otherwise

    check()


def _encoded(body: dict[str, Any]) -> bytes:
    """``body`` as JSON, also where orjson will not write it (integers past 64 bits, nesting past 254)."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body).encode()


# -- the upstream's answers -------------------------------------------------------------------


class ScriptedUpstream:
    """A named fake vLLM whose next chat answer (plain and streamed) the test sets."""

    def __init__(self) -> None:
        self.answer = b""
        self.stream = b""
        self.transport = fake_upstream(respond=self.respond)

    def respond(self, request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
        if request.url.path != "/v1/chat/completions":
            return None
        if body.get("stream"):
            return httpx.Response(200, stream=SSEBody(self.stream), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, content=self.answer)


def mutated(draw: st.DrawFn, value: Any) -> Any:
    """``value`` with one field somewhere in it replaced by an odd value."""
    if isinstance(value, dict | list) and value and draw(st.booleans()):
        keys = sorted(value) if isinstance(value, dict) else range(len(value))
        key = draw(st.sampled_from(list(keys)))
        copy: Any = dict(value) if isinstance(value, dict) else list(value)
        copy[key] = mutated(draw, value[key])
        return copy
    return draw(ODD)


@st.composite
def upstream_answers(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A vLLM answer and stream (with a tool call), each with odd values somewhere in it."""
    answer = fake_vllm_completion({"model": "policy-base", "logprobs": True, "return_token_ids": True})
    chunks = good_chunks("policy-base")
    chunks[1]["choices"][0]["delta"]["tool_calls"] = [
        {"index": 0, "id": "call-1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    ]
    stream = sse(*(_encoded(mutated(draw, c) if draw(st.booleans()) else c) for c in chunks))
    return _encoded(mutated(draw, answer)), stream


@pytest.mark.parametrize("api", APIS)
def test_odd_upstream_answers_are_answered_or_a_502(tmp_path: Path, api: str) -> None:
    """Whatever the engine answers, the client gets its answer or a clean 502, never a 500."""
    upstream = ScriptedUpstream()
    app = create_app(make_settings(_migrated(tmp_path)), transport=upstream.transport)
    path, body, _ = APIS[api]
    with TestClient(app, base_url="http://proxy", raise_server_exceptions=False) as proxy:
        group = proxy.post("/groups", json={"task_id": "fuzz", "size": 1}, headers=ADMIN).json()
        key = {"authorization": f"Bearer {group['episode_keys'][0]['api_key']}"}

        @fuzz(BODY_EXAMPLES)
        @given(answers=upstream_answers(), stream=st.booleans(), recorded=st.booleans())
        def check(answers: tuple[bytes, bytes], stream: bool, recorded: bool) -> None:
            upstream.answer, upstream.stream = answers
            url, headers = (path, key) if recorded else (f"/passthrough{path}", ADMIN)
            response = proxy.post(url, json={**body, "stream": stream}, headers=headers)
            assert response.status_code in (200, 502), response.text[:500]
            if response.status_code == 502:
                assert_malformed(api, response.json())
            elif stream:
                assert_stream_ends(api, response.content)

        check()


def assert_malformed(api: str, body: dict[str, Any]) -> None:
    """``body`` is the 502 for a malformed answer, in ``api``'s error shape."""
    if api == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "api_error" and body["error"]["message"], body
    elif api == "responses" and body.get("type") == "error":  # a Responses stream's error event
        assert body["code"] == "malformed_answer" and body["message"], body
    else:
        assert (body["error"]["type"], body["error"]["code"]) == ("upstream_error", "malformed_answer"), body


def assert_stream_ends(api: str, content: bytes) -> None:
    """A stream ends with its API's final event, or with the 502's error event after what was sent."""
    last = [event for event in content.split(b"\n\n") if event.strip()][-1]
    if ENDINGS[api] not in last:
        assert_malformed(api, orjson.loads(last.split(b"data: ", 1)[1]))


# -- what the fuzzing found, kept as plain regression tests -------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/trainer/steps?since_step=9223372036854775808", None),  # was a 500: OverflowError in SQLite
        ("GET", "/groups?offset=9223372036854775808", None),
        ("GET", "/episodes?offset=9223372036854775808", None),
        ("POST", "/trainer/steps", {"step": 2**31, "metrics": {}}),  # past PostgreSQL's integer column
        ("POST", "/trainer/claim", {"max_staleness": 2**63}),
        ("POST", "/policy/publish", {"adapter_path": "/adapters/x", "version": 2**31}),
    ],
)
def test_integers_past_what_the_store_holds_are_refused(
    proxy: TestClient, method: str, path: str, body: dict[str, Any] | None
) -> None:
    response = proxy.request(method, path, json=body, headers=ADMIN)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("api", APIS)
def test_a_body_nested_past_what_orjson_writes_is_refused(
    proxy: TestClient, episode_key: dict[str, str], api: str
) -> None:
    """Was a 500: orjson.dumps stops at 254 levels, after the body had been taken."""
    path, body, _ = APIS[api]
    response = proxy.post(
        path,
        content=_encoded({**body, "extra": nested(300, 1)}),
        headers={**episode_key, "content-type": "application/json"},
    )
    assert response.status_code == 400, response.text
    assert_clean(response, path)
    assert "deeper than 128" in response.text
    shallow = proxy.post(f"/passthrough{path}", json={**body, "extra": nested(100, 1)}, headers=ADMIN)
    assert shallow.status_code < 500 and "deeper than" not in shallow.text  # refused, if at all, for the field


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_top_k_past_64_bits_is_refused(proxy: TestClient, episode_key: dict[str, str], api: str) -> None:
    """Was a 500: 2**64 - 1 became a float, then an integer orjson could not send on."""
    path, body, _ = APIS[api]
    response = proxy.post(path, json={**body, "top_k": 2**64 - 1}, headers=episode_key)
    assert response.status_code == 400, response.text
    assert_clean(response, path)
