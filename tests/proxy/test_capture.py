"""Stream assembly and field stripping, on chunks shaped exactly as vLLM 0.32 sends them."""

from __future__ import annotations

import copy

from proxy.capture import StreamCapture, Wants, capture_response, prepare, strip_for_client

FIRST = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}], "prompt_token_ids": [1, 2, 3], "prompt_text": None}


def chunk(index: int, ids: list[int], text: str, logprobs: list[float], finish: str | None = None,
          tool: dict | None = None) -> dict:
    delta: dict = {"content": text} if text else {}
    if tool:
        delta["tool_calls"] = [tool]
    return {"id": "c", "choices": [{"index": index, "delta": delta, "finish_reason": finish, "token_ids": ids,
                                    "logprobs": {"content": [{"token": "t", "logprob": lp} for lp in logprobs]}}]}


def test_interleaved_choices_and_tool_call_fragments_assemble() -> None:
    capture = StreamCapture("chat")
    capture.feed(FIRST)
    capture.feed(chunk(0, [10], "Hel", [-0.1]))
    capture.feed(chunk(1, [20], "", [-0.2], tool={"index": 0, "id": "call_1", "type": "function",
                                                   "function": {"name": "add", "arguments": ""}}))
    capture.feed(chunk(0, [11, 12], "lo", [-0.3, -0.4], finish="stop"))
    capture.feed(chunk(1, [21], "", [-0.5], tool={"index": 0, "function": {"arguments": '{"a": 1'}}))
    capture.feed(chunk(1, [22], "", [-0.6], finish="tool_calls", tool={"index": 0, "function": {"arguments": "}"}}))
    result = capture.result()
    assert result.prompt_token_ids == [1, 2, 3] and result.exact_ids
    zero, one = result.choices
    assert zero["token_ids"] == [10, 11, 12] and zero["logprobs"] == [-0.1, -0.3, -0.4] and zero["text"] == "Hello"
    assert one["tool_calls"] == [{"id": "call_1", "type": "function",
                                  "function": {"name": "add", "arguments": '{"a": 1}'}}]
    assert one["finish_reason"] == "tool_calls"
    assert result.response["choices"][1]["message"]["tool_calls"] == one["tool_calls"]
    assert result.completion_tokens == 6 and result.prompt_tokens == 3


def test_missing_ids_are_flagged_not_invented() -> None:
    capture = StreamCapture("chat")
    capture.feed({"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]})
    result = capture.result()
    assert result.exact_ids is False and result.prompt_token_ids is None
    plain = capture_response({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]},
                             "chat")
    assert plain.exact_ids is False and plain.choices[0]["token_ids"] == []


def test_stripping_restores_what_vllm_sends_without_the_additions() -> None:
    upstream, wants = prepare({"model": "m", "messages": []}, "chat")
    assert upstream["return_token_ids"] is True and upstream["logprobs"] is True and wants == Wants(False, False)
    body = chunk(0, [10], "x", [-0.1])
    body["prompt_token_ids"] = [1]
    stripped = copy.deepcopy(body)
    assert strip_for_client(stripped, wants, "chat")
    assert stripped["prompt_token_ids"] is None and stripped["choices"][0]["token_ids"] is None
    assert stripped["choices"][0]["logprobs"] is None and stripped["choices"][0]["delta"] == {"content": "x"}
    kept = copy.deepcopy(body)
    assert not strip_for_client(kept, Wants(token_ids=True, logprobs=True), "chat") and kept == body


def test_completions_logprobs_are_an_int_and_prompt_ids_per_choice() -> None:
    upstream, wants = prepare({"model": "m", "prompt": "x", "logprobs": 2}, "completion")
    assert upstream["logprobs"] == 2 and wants.logprobs and not wants.token_ids
    upstream, wants = prepare({"model": "m", "prompt": "x"}, "completion")
    assert upstream["logprobs"] == 0 and not wants.logprobs
    data = {"choices": [{"index": 0, "text": "11,", "token_ids": [33, 33, 28], "prompt_token_ids": [33, 27],
                         "logprobs": {"token_logprobs": [-1.9, -1.2, -1.3], "tokens": ["1", "1", ","]},
                         "finish_reason": "length"}], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}
    captured = capture_response(data, "completion")
    assert captured.prompt_token_ids == [33, 27] and captured.choices[0]["logprobs"] == [-1.9, -1.2, -1.3]
    assert captured.exact_ids and "logprobs" not in captured.response["choices"][0]
