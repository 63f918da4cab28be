"""The Responses translator, checked against the official ``openai`` SDK's own types.

Requests in the SDK's ``ResponseCreateParams`` shape become chat bodies; answers and stream events
must validate as the SDK's ``Response`` and ``ResponseStreamEvent``, and the SDK's own stream
accumulator must assemble the events into the answer the non-streamed path gives.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from openai.types.responses.response_create_params import ResponseCreateParamsNonStreaming
from pydantic import TypeAdapter

from proxy.dialects.responses import ResponsesTranslation, history_of, input_messages, parse
from proxy.errors import InvalidRequest, UpstreamError
from tests.support.records import call_record

EVENTS: TypeAdapter[ResponseStreamEvent] = TypeAdapter(ResponseStreamEvent)
PARAMS: TypeAdapter[ResponseCreateParamsNonStreaming] = TypeAdapter(ResponseCreateParamsNonStreaming)

TOOL = {
    "type": "function",
    "name": "calculator",
    "description": "compute a op b",
    "strict": True,
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


def translate(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> ResponsesTranslation:
    PARAMS.validate_python({k: v for k, v in body.items() if k != "stream"})  # a request the SDK could send
    return ResponsesTranslation(parse(body), body, history or [])


def chat_answer(
    content: str | None,
    tool_calls: list[dict[str, Any]] | None = None,
    *,
    finish: str = "stop",
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A vLLM chat completion as the proxy receives it (token ids and sampled log-probs included)."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "policy",
        "choices": [
            {
                "index": 0,
                "finish_reason": finish,
                "stop_reason": None,
                "token_ids": [5, 6, 7],
                "logprobs": {"content": logprobs or []},
                "message": {"role": "assistant", "content": content, "tool_calls": tool_calls or []},
            }
        ],
        "prompt_token_ids": [1, 2, 3],
        "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
    }


def call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- requests --------------------------------------------------------------------------------


def test_string_input_with_instructions_and_sampling() -> None:
    t = translate(
        {
            "model": "policy",
            "input": "2+2?",
            "instructions": "Be brief.",
            "max_output_tokens": 16,
            "temperature": 0.7,
            "top_p": 0.9,
        }
    )
    assert t.chat == {
        "model": "policy",
        "max_tokens": 16,
        "temperature": 0.7,
        "top_p": 0.9,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    }
    assert t.api == "responses" and t.response_id.startswith("resp_")


def test_items_become_chat_turns_with_one_assistant_turn_per_call_run() -> None:
    items = [
        {"role": "developer", "content": "Use tools."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "3*4"}, {"type": "input_text", "text": " and 5*6"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "multiply twice"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Computing."}]},
        {"type": "function_call", "call_id": "c1", "name": "calculator", "arguments": '{"a": 3, "b": 4}'},
        {"type": "function_call", "call_id": "c2", "name": "calculator", "arguments": '{"a": 5, "b": 6}'},
        {"type": "function_call_output", "call_id": "c1", "output": "12"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "30"}]},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "3*4 and 5*6"},
        {
            "role": "assistant",
            "content": "Computing.",
            "reasoning_content": "multiply twice",
            "tool_calls": [call("c1", "calculator", '{"a": 3, "b": 4}'), call("c2", "calculator", '{"a": 5, "b": 6}')],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "12"},
        {"role": "tool", "tool_call_id": "c2", "content": "30"},
    ]


def test_tools_tool_choice_and_json_schema_format() -> None:
    t = translate(
        {
            "model": "policy",
            "input": "go",
            "tools": [TOOL],
            "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "name": "calculator"},
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
        }
    )
    assert t.chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "description": "compute a op b",
                "parameters": TOOL["parameters"],
                "strict": True,
            },
        }
    ]
    assert t.chat["tool_choice"] == {"type": "function", "function": {"name": "calculator"}}
    assert t.chat["parallel_tool_calls"] is False
    assert t.chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }


def test_stream_asks_for_usage_and_logprobs_when_included() -> None:
    body = {
        "model": "policy",
        "input": "hi",
        "stream": True,
        "include": ["message.output_text.logprobs"],
        "top_logprobs": 2,
    }
    t = ResponsesTranslation(parse(body), body, [])
    assert t.chat["stream"] is True and t.chat["stream_options"] == {"include_usage": True}
    assert t.chat["logprobs"] is True and t.chat["top_logprobs"] == 2


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "policy", "input": "x", "background": True}, "background", "background"),
        ({"model": "policy", "input": "x", "conversation": "conv_1"}, "conversation", "conversation"),
        ({"model": "policy", "input": "x", "truncation": "auto"}, "truncation", "never drops context"),
        ({"model": "policy", "input": "x", "max_tool_calls": 3}, "max_tool_calls", "max_tool_calls"),
        ({"model": "policy", "input": "x", "include": ["file_search_call.results"]}, "include", "not served"),
        ({"model": "policy", "input": "x", "top_k": 1}, "top_k", "unknown parameter"),
        ({"model": "policy", "input": "x", "temperature": 3}, "temperature", "less than or equal"),
        ({"model": "", "input": "x"}, "model", "at least 1"),
        ({"model": "policy", "input": "x", "tools": [{"type": "custom", "name": "f"}]}, "tools[0].type", "function"),
        ({"model": "policy", "input": "x", "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"model": "policy", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item_reference"),
        (
            {"model": "policy", "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0]",
            "input_file",
        ),
        (
            {"model": "policy", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
            "input[0]",
            "arguments",
        ),
        ({"model": "policy", "input": []}, "input", "empty"),
    ],
)
def test_refusals_name_the_field(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        ResponsesTranslation(parse(body), body, [])
    assert err.value.param == param
    assert words in err.value.message


def test_previous_response_history_drops_its_instructions_and_replays_its_answer() -> None:
    prev = call_record(
        "e",
        request={
            "model": "policy",
            "messages": [{"role": "system", "content": "old rules"}, {"role": "user", "content": "3*4?"}],
        },
        response=None,
        prompt_token_ids=[1],
        choices=[{"index": 0, "token_ids": [9], "text": "", "tool_calls": [call("c1", "calculator", '{"a":3}')]}],
        model_served="policy",
        replica="r",
        started_at=0.0,
        prompt_tokens=1,
        completion_tokens=1,
        api="responses",
        client_request={"model": "policy", "input": "3*4?", "instructions": "old rules"},
        response_id="resp_1",
    )
    history = history_of(prev)
    assert history == [
        {"role": "user", "content": "3*4?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "calculator", '{"a":3}')]},
    ]
    t = translate(
        {
            "model": "policy",
            "instructions": "new rules",
            "previous_response_id": "resp_1",
            "input": [{"type": "function_call_output", "call_id": "c1", "output": "12"}],
        },
        history,
    )
    assert t.chat["messages"] == [
        {"role": "system", "content": "new rules"},
        *history,
        {"role": "tool", "tool_call_id": "c1", "content": "12"},
    ]


# -- answers ---------------------------------------------------------------------------------


def test_text_answer_validates_as_the_sdk_response_with_logprobs() -> None:
    body = {"model": "policy", "input": "hi", "include": ["message.output_text.logprobs"], "metadata": {"k": "v"}}
    t = translate(body)
    logprobs = [
        {"token": "Hel", "logprob": -0.1, "bytes": [72, 101, 108], "top_logprobs": []},
        {"token": "lo", "logprob": -0.2, "bytes": [108, 111], "top_logprobs": []},
    ]
    out = Response.model_validate(t.response(chat_answer("Hello", logprobs=logprobs)))
    assert out.status == "completed" and out.output_text == "Hello"
    assert out.metadata == {"k": "v"} and out.model == "policy" and out.id == t.response_id
    assert out.usage is not None and (out.usage.input_tokens, out.usage.output_tokens) == (3, 3)
    part = out.output[0].content[0]  # type: ignore[union-attr]
    assert [(lp.token, lp.logprob) for lp in part.logprobs] == [("Hel", -0.1), ("lo", -0.2)]  # type: ignore[union-attr]


def test_tool_calls_become_function_call_items() -> None:
    t = translate({"model": "policy", "input": "3*4 and 5*6", "tools": [TOOL]})
    answer = chat_answer(
        None,
        [call("c1", "calculator", '{"a": 3, "b": 4}'), call("c2", "calculator", '{"a": 5, "b": 6}')],
        finish="tool_calls",
    )
    out = Response.model_validate(t.response(answer))
    assert [(o.type, o.call_id, o.arguments) for o in out.output] == [  # type: ignore[union-attr]
        ("function_call", "c1", '{"a": 3, "b": 4}'),
        ("function_call", "c2", '{"a": 5, "b": 6}'),
    ]
    passed_back = [o.model_dump(exclude_none=True) for o in out.output]
    again = input_messages([{"role": "user", "content": "3*4 and 5*6"}, *passed_back])
    sampled = answer["choices"][0]["message"]["tool_calls"]
    assert again[1] == {"role": "assistant", "content": None, "tool_calls": sampled}


def test_length_stop_is_incomplete() -> None:
    out = Response.model_validate(
        translate({"model": "policy", "input": "hi"}).response(chat_answer("Hel", finish="length"))
    )
    assert out.status == "incomplete"
    assert out.incomplete_details is not None and out.incomplete_details.reason == "max_output_tokens"


def test_reasoning_round_trips_through_encrypted_content() -> None:
    t = translate({"model": "policy", "input": "hi", "include": ["reasoning.encrypted_content"]})
    answer = chat_answer("4")
    answer["choices"][0]["message"]["reasoning_content"] = "2+2 is 4"
    out = Response.model_validate(t.response(answer))
    reasoning = out.output[0].model_dump(exclude_none=True)
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"]
    messages = input_messages([{"role": "user", "content": "hi"}, reasoning, out.output[1].model_dump()])
    assert messages[1] == {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4"}


# -- streams ---------------------------------------------------------------------------------


def chunks(pieces: list[dict[str, Any]], finish: str) -> list[dict[str, Any]]:
    """vLLM chat chunks: role first (with the prompt ids), the deltas, the finish, then usage."""
    out = [
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "policy",
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
    ]
    for delta in pieces:
        out.append(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "policy",
                "choices": [{"index": 0, "delta": delta, "finish_reason": None, "token_ids": [7]}],
            }
        )
    out[-1]["choices"][0]["finish_reason"] = finish
    out.append(
        {
            "id": "c",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "policy",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(pieces), "total_tokens": 3 + len(pieces)},
        }
    )
    return out


def events_of(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.split(b"\n\n"):
        if not block:
            continue
        kind, data = block.split(b"\n")
        event = orjson.loads(data.removeprefix(b"data: "))
        assert kind == b"event: " + event["type"].encode()
        out.append(event)
    return out


def run_stream(t: ResponsesTranslation, pieces: list[dict[str, Any]], finish: str) -> list[dict[str, Any]]:
    stream = t.stream()
    raw = b"".join(stream.chunk(c) for c in chunks(pieces, finish)) + stream.done()
    return events_of(raw)


def assembled(events: list[dict[str, Any]], body: dict[str, Any]) -> Response:
    """What the SDK's own stream accumulator builds from the events."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=[], text_format=omit)
    final = None
    for event in events:
        for typed in state.handle_event(EVENTS.validate_python(event)):
            if typed.type in ("response.completed", "response.incomplete"):
                final = typed.response
    assert final is not None
    return Response.model_validate(final.model_dump())


def test_text_stream_is_the_documented_sequence_and_assembles_to_the_answer() -> None:
    body = {"model": "policy", "input": "hi", "stream": True}
    t = ResponsesTranslation(parse(body), body, [])
    events = run_stream(t, [{"content": "Hel"}, {"content": "lo"}], "stop")
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = assembled(events, body)
    assert final.output_text == "Hello" and final.status == "completed" and final.id == t.response_id
    assert final.usage is not None and final.usage.output_tokens == 2


def test_tool_call_stream_after_text() -> None:
    body = {"model": "policy", "input": "go", "stream": True, "tools": [TOOL]}
    t = ResponsesTranslation(parse(body), body, [])
    pieces = [
        {"content": "Let me compute."},
        {
            "tool_calls": [
                {"index": 0, "id": "c1", "type": "function", "function": {"name": "calculator", "arguments": ""}}
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 3, '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"b": 4}'}}]},
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"a": 5, "b": 6}'},
                }
            ]
        },
    ]
    events = run_stream(t, pieces, "tool_calls")
    kinds = [e["type"] for e in events]
    assert kinds.count("response.function_call_arguments.delta") == 3
    assert kinds.count("response.output_item.done") == 3
    final = assembled(events, body)
    assert final.output_text == "Let me compute."
    calls = [(o.call_id, o.name, o.arguments) for o in final.output if o.type == "function_call"]
    assert calls == [("c1", "calculator", '{"a": 3, "b": 4}'), ("c2", "calculator", '{"a": 5, "b": 6}')]


def test_stream_error_event_validates() -> None:
    stream = ResponsesTranslation(parse({"model": "p", "input": "x"}), {}, []).stream()
    stream.chunk(chunks([{"content": "a"}], "stop")[0])
    event = events_of(stream.error(UpstreamError("upstream closed the stream", code="incomplete_stream")))[0]
    typed = EVENTS.validate_python(event)
    assert typed.type == "error" and typed.code == "incomplete_stream" and typed.sequence_number == 2
