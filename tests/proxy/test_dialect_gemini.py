"""Google's Gemini API dialect: requests to chat bodies, answers and streams back, Google's errors.

Engine-free: the translation both ways, each 400 with the field it names, the stream's chunks
joined into exactly the non-streamed answer, and the routes in-process on the named fake upstream
(what reaches it, what is stored, Google's key and error shape). The real Gemini CLI runs unchanged
in ``tests/integration/test_harnesses.py``; recording exact ids from real vLLM through these routes
is ``tests/integration/test_dialects_engine.py``'s.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from proxy.dialects.base import EventStream, Translation
from proxy.dialects.gemini import GeminiTranslation, count_tokens_chat, error_body, json_schema, speaks_gemini
from proxy.errors import (
    AuthenticationFailed,
    EpisodeClosed,
    FlywheelError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ServiceUnavailable,
    TooManyRequests,
    UpstreamError,
    UpstreamTimeout,
)
from proxy.settings import CompatSettings
from tests.proxy.conftest import ADMIN, fake_upstream, make_settings, new_group, running_app

MODEL = "policy"
SHELL = {
    "name": "run_shell_command",
    "description": "Run a shell command.",
    "parametersJsonSchema": {
        "type": "object",
        "properties": {"command": {"type": "string"}},
        "required": ["command"],
    },
}
HI = [{"role": "user", "parts": [{"text": "Hi"}]}]


def translate(settings: CompatSettings | None = None, *, stream: bool = False, **fields: Any) -> GeminiTranslation:
    return GeminiTranslation.from_request({"contents": HI, **fields}, MODEL, stream=stream, settings=settings)


def refused(body: dict[str, Any], param: str | None, *words: str, settings: CompatSettings | None = None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        GeminiTranslation.from_request(body, MODEL, settings=settings)
    assert caught.value.param == param, caught.value.message
    for word in words:
        assert word in caught.value.message, caught.value.message


def completion(message: dict[str, Any], finish: str = "stop", **choice: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "choices": [{"index": 0, "message": {"role": "assistant", **message}, "finish_reason": finish, **choice}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15},
        "prompt_token_ids": list(range(11)),
    }


def shell_call(ident: str = "chatcmpl-tool-7", arguments: str = '{"command": "ls"}') -> dict[str, Any]:
    return {"id": ident, "type": "function", "function": {"name": "run_shell_command", "arguments": arguments}}


def events(raw: bytes) -> list[dict[str, Any]]:
    """Server-sent events as Google frames them: ``data: <json>`` and CRLF CRLF."""
    assert raw.endswith(b"\r\n\r\n")
    return [orjson.loads(block[6:]) for block in raw.split(b"\r\n\r\n") if block]


def joined(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Streamed chunks as a client joins them: parts in order (text pieces joined), the last finish and usage."""
    parts: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    for chunk in chunks:
        out["responseId"], out["modelVersion"] = chunk["responseId"], chunk["modelVersion"]
        for candidate in chunk["candidates"]:
            for part in candidate["content"]["parts"]:
                last = parts[-1] if parts else None
                same = last is not None and "text" in part and "text" in last
                if same and bool(last.get("thought")) == bool(part.get("thought")):  # type: ignore[union-attr]
                    last["text"] += part["text"]  # type: ignore[index]
                else:
                    parts.append(dict(part))
            if "finishReason" in candidate:
                out["finishReason"] = candidate["finishReason"]
        if "usageMetadata" in chunk:
            out["usageMetadata"] = chunk["usageMetadata"]
    out["parts"] = parts
    return out


def flat(answer: dict[str, Any]) -> dict[str, Any]:
    (candidate,) = answer["candidates"]
    return {
        "responseId": answer["responseId"],
        "modelVersion": answer["modelVersion"],
        "parts": candidate["content"]["parts"],
        "finishReason": candidate["finishReason"],
        "usageMetadata": answer["usageMetadata"],
    }


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion}}


def run_stream(translation: GeminiTranslation, chunks: list[dict[str, Any]]) -> bytes:
    stream: EventStream = translation.stream()
    return b"".join(stream.chunk(c) for c in chunks) + stream.done()


# -- requests -----------------------------------------------------------------------------------


def test_a_minimal_request_becomes_a_chat_request() -> None:
    t: Translation = translate()  # what the relay takes (checked by mypy)
    assert t.api == "gemini"
    assert t.chat == {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    assert t.compat is None and t.response_id.startswith("gen_")
    streamed = translate(stream=True)
    assert streamed.chat["stream"] is True and streamed.chat["stream_options"] == {"include_usage": True}


def test_system_instruction_and_user_parts() -> None:
    t = translate(
        systemInstruction={"parts": [{"text": "Be brief."}, {"text": "Use tools."}]},
        contents=[{"role": "user", "parts": [{"text": "<context>"}, {"text": "say hi"}]}, {"parts": [{"text": "x"}]}],
    )
    assert t.chat["messages"] == [
        {"role": "system", "content": "Be brief.\nUse tools."},
        {"role": "user", "content": "<context>\nsay hi"},
        {"role": "user", "content": "x"},  # no role: a user turn, as Google reads it
    ]


def test_snake_case_fields_are_read_as_google_reads_them() -> None:
    t = GeminiTranslation.from_request(
        {
            "system_instruction": {"parts": [{"text": "S"}]},
            "contents": HI,
            "generation_config": {"max_output_tokens": 9, "stop_sequences": ["END"], "top_k": 3},
        },
        MODEL,
    )
    assert t.chat["messages"][0] == {"role": "system", "content": "S"}
    assert (t.chat["max_tokens"], t.chat["stop"], t.chat["top_k"]) == (9, ["END"], 3)


def test_images_become_image_url_parts() -> None:
    image = {"inlineData": {"mimeType": "image/png", "data": "iVBORw0KGgo="}}
    t = translate(contents=[{"role": "user", "parts": [image, {"text": "What is this?"}]}])
    assert t.chat["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
                {"type": "text", "text": "What is this?"},
            ],
        }
    ]


def test_a_function_round_trip_keeps_ids_and_arguments() -> None:
    signature = "skip_thought_signature_validator"
    call = {"id": "chatcmpl-tool-7", "name": "run_shell_command", "args": {"command": "ls", "n": 10**20}}
    contents = [
        *HI,
        {"role": "model", "parts": [{"functionCall": call, "thoughtSignature": signature}]},
        {
            "role": "user",
            "parts": [
                {
                    "functionResponse": {
                        "id": "chatcmpl-tool-7",
                        "name": "run_shell_command",
                        "response": {"output": "a"},
                    }
                },
                {"text": "go on"},
            ],
        },
    ]
    t = translate(contents=contents, tools=[{"functionDeclarations": [SHELL]}])
    assert t.chat["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "chatcmpl-tool-7",
                    "type": "function",
                    "function": {
                        "name": "run_shell_command",
                        "arguments": '{"command": "ls", "n": 100000000000000000000}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "chatcmpl-tool-7", "content": "a"},
        {"role": "user", "content": "go on"},
    ]
    assert t.chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": SHELL["name"],
                "description": SHELL["description"],
                "parameters": SHELL["parametersJsonSchema"],
            },
        }
    ]
    assert t.compat == {"ignored": ["thoughtSignature"]}


def test_calls_and_responses_without_ids_are_matched_by_name_in_order() -> None:
    contents = [
        *HI,
        {
            "role": "model",
            "parts": [
                {"functionCall": {"name": "f", "args": {"x": 1}}},
                {"functionCall": {"name": "g"}},
                {"functionCall": {"name": "f", "args": {"x": 2}}},
            ],
        },
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "f", "response": {"v": 1}}},
                {"functionResponse": {"name": "f", "response": {"v": 2}}},
                {"functionResponse": {"name": "g", "response": {}}},
            ],
        },
    ]
    messages = translate(contents=contents).chat["messages"]
    ids = [c["id"] for c in messages[1]["tool_calls"]]
    assert ids == ["call_1_0", "call_1_1", "call_1_2"]
    assert messages[1]["tool_calls"][1]["function"]["arguments"] == "{}"
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:]] == [
        ("call_1_0", '{"v":1}'),
        ("call_1_2", '{"v":2}'),
        ("call_1_1", ""),
    ]


@pytest.mark.parametrize(
    ("response", "text"),
    [
        ({"output": "done"}, "done"),
        ({"output": {"files": ["a"]}}, '{"files":["a"]}'),
        ({"error": "no such file"}, "Error: no such file"),
        ({"output": "partial", "error": "exit 1"}, "partial\nError: exit 1"),
        ({"result": 3, "output": "x"}, '{"result":3,"output":"x"}'),
        ({}, ""),
    ],
)
def test_function_response_text(response: dict[str, Any], text: str) -> None:
    contents = [
        *HI,
        {"role": "model", "parts": [{"functionCall": {"id": "c1", "name": "f", "args": {}}}]},
        {"role": "user", "parts": [{"functionResponse": {"id": "c1", "name": "f", "response": response}}]},
    ]
    assert translate(contents=contents).chat["messages"][-1] == {"role": "tool", "tool_call_id": "c1", "content": text}


def test_model_turns_join_text_as_sampled_and_keep_thoughts_as_reasoning() -> None:
    contents = [
        *HI,
        {
            "role": "model",
            "parts": [{"text": "Let me ", "thought": True}, {"text": "think."}, {"text": "Hel"}, {"text": "lo"}],
        },
    ]
    assert translate(contents=contents).chat["messages"][-1] == {
        "role": "assistant",
        "content": "think.Hello",
        "reasoning_content": "Let me ",
    }


def test_google_schema_becomes_json_schema() -> None:
    schema = {
        "type": "OBJECT",
        "properties": {
            "b": {"type": "STRING", "nullable": True, "format": "date-time"},
            "a": {"type": "ARRAY", "items": {"type": "INTEGER"}, "min_items": 1},
            "c": {"anyOf": [{"type": "NUMBER"}, {"type": "BOOLEAN"}], "example": 3},
        },
        "propertyOrdering": ["a", "b"],
        "required": ["a"],
    }
    converted = json_schema(schema, "p")
    assert converted == {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "integer"}, "minItems": 1},
            "b": {"type": ["string", "null"], "format": "date-time"},
            "c": {"anyOf": [{"type": "number"}, {"type": "boolean"}]},
        },
        "required": ["a"],
    }
    assert list(converted["properties"]) == ["a", "b", "c"]
    t = translate(tools=[{"functionDeclarations": [{"name": "f", "parameters": schema}, {"name": "g"}]}])
    assert t.chat["tools"][0]["function"]["parameters"] == converted
    assert t.chat["tools"][1]["function"] == {"name": "g", "parameters": {"type": "object", "properties": {}}}


@pytest.mark.parametrize(
    ("config", "choice", "shown", "strict"),
    [
        ({"mode": "AUTO"}, "auto", ["f", "g"], False),
        ({}, "auto", ["f", "g"], False),
        ({"mode": "NONE"}, "none", ["f", "g"], False),
        ({"mode": "ANY"}, "required", ["f", "g"], True),
        (
            {"mode": "ANY", "allowedFunctionNames": ["g"]},
            {"type": "function", "function": {"name": "g"}},
            ["f", "g"],
            True,
        ),
        ({"mode": "ANY", "allowedFunctionNames": ["g", "f"]}, "required", ["f", "g"], True),
        ({"mode": "VALIDATED"}, "auto", ["f", "g"], True),
        ({"mode": "VALIDATED", "allowedFunctionNames": ["g"]}, "auto", ["g"], True),
    ],
)
def test_function_calling_config(config: dict[str, Any], choice: Any, shown: list[str], strict: bool) -> None:
    """ANY and VALIDATED hold calls to their schema (vLLM's strict functions); AUTO and NONE leave them free."""
    tools = [{"functionDeclarations": [{"name": "f"}, {"name": "g"}]}]
    t = translate(tools=tools, toolConfig={"functionCallingConfig": config})
    assert t.chat["tool_choice"] == choice
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == shown
    assert [tool["function"].get("strict", False) for tool in t.chat["tools"]] == [strict] * len(shown)


def test_allowed_functions_are_the_only_ones_shown_where_no_one_function_is_named() -> None:
    tools = [{"functionDeclarations": [{"name": "f"}, {"name": "g"}, {"name": "h"}]}]
    t = translate(
        tools=tools, toolConfig={"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f", "h"]}}
    )
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == ["f", "h"] and t.chat["tool_choice"] == "required"
    assert t.compat == {
        "mapped": {"toolConfig.functionCallingConfig": "only the allowed functions are shown to the model"}
    }
    one = translate(tools=tools, toolConfig={"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["h"]}})
    assert one.compat is None  # one named function: exactly what vLLM's tool_choice does
    none = translate(toolConfig={"functionCallingConfig": {"mode": "NONE"}})  # nothing to choose from: dropped
    assert "tool_choice" not in none.chat and "tools" not in none.chat


def test_generation_config_becomes_sampling() -> None:
    t = translate(
        generationConfig={
            "temperature": 0.7,
            "topP": 0.9,
            "topK": 20,
            "maxOutputTokens": 64,
            "stopSequences": ["STOP"],
            "candidateCount": 2,
            "seed": 5,
            "presencePenalty": 0.5,
            "frequencyPenalty": 0.25,
            "responseMimeType": "text/plain",
            "responseModalities": ["TEXT"],
        }
    )
    sampling = {k: v for k, v in t.chat.items() if k not in ("model", "messages")}
    assert sampling == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "max_tokens": 64,
        "stop": ["STOP"],
        "n": 2,
        "seed": 5,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    assert "n" not in translate(generationConfig={"candidateCount": 1}).chat


def test_structured_output() -> None:
    schema = {"type": "OBJECT", "properties": {"n": {"type": "INTEGER"}}}
    typed = translate(generationConfig={"responseMimeType": "application/json", "responseSchema": schema})
    assert typed.chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "response", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    }
    raw = {"type": "object", "properties": {"n": {"type": "integer"}}, "additionalProperties": False}
    exact = translate(generationConfig={"responseMimeType": "application/json", "responseJsonSchema": raw})
    assert exact.chat["response_format"]["json_schema"]["schema"] == raw
    free = translate(generationConfig={"responseMimeType": "application/json"})
    assert free.chat["response_format"] == {"type": "json_object"}


def test_thinking_config_without_and_with_a_thinking_switch() -> None:
    thinking = {"thinkingConfig": {"includeThoughts": True}}
    plain = translate(generationConfig=thinking)  # Gemini CLI's own config, on a model without reasoning
    assert "chat_template_kwargs" not in plain.chat
    assert plain.compat == {
        "mapped": {"generationConfig.thinkingConfig": "served without thoughts: the model has no reasoning"}
    }
    switch = CompatSettings(thinking_switch="enable_thinking")
    assert "chat_template_kwargs" not in translate(switch, generationConfig=thinking).chat  # the template's default
    off = translate(switch, generationConfig={"thinkingConfig": {"thinkingBudget": 0}})
    assert off.chat["chat_template_kwargs"] == {"enable_thinking": False} and off.compat is None
    budget = translate(switch, generationConfig={"thinkingConfig": {"thinkingBudget": 512, "includeThoughts": True}})
    assert budget.chat["chat_template_kwargs"] == {"enable_thinking": True}
    assert list(budget.compat["mapped"]) == ["generationConfig.thinkingConfig.thinkingBudget"]  # type: ignore[index]
    level = translate(
        CompatSettings(reasoning_effort=True), generationConfig={"thinkingConfig": {"thinkingLevel": "LOW"}}
    )
    assert level.chat["reasoning_effort"] == "low"
    ignored = translate(generationConfig={"thinkingConfig": {"thinkingLevel": "HIGH"}})
    assert ignored.compat == {"ignored": ["generationConfig.thinkingConfig.thinkingLevel"]}


def test_log_probabilities_are_asked_of_vllm() -> None:
    t = translate(generationConfig={"responseLogprobs": True, "logprobs": 3})
    assert (t.chat["logprobs"], t.chat["top_logprobs"]) == (True, 3)
    assert "logprobs" not in translate(generationConfig={"responseLogprobs": False}).chat


def test_harmless_and_hosted_fields() -> None:
    t = translate(
        safetySettings=[{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
        labels={"team": "rl"},
        tools=[{"googleSearch": {}}, {"functionDeclarations": [SHELL]}, {"codeExecution": {}}],
        toolConfig={"retrievalConfig": {"latLng": {"latitude": 1, "longitude": 2}}},
        clientTrace="abc",
    )
    assert t.compat == {
        "ignored": ["clientTrace", "labels", "safetySettings", "toolConfig.retrievalConfig"],
        "dropped_tools": ["googleSearch", "codeExecution"],
    }
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == ["run_shell_command"]
    only_hosted = translate(tools=[{"google_search": {}}])
    assert "tools" not in only_hosted.chat and only_hosted.compat == {"dropped_tools": ["googleSearch"]}


STRICT = CompatSettings(mode="strict")
REJECT_HOSTED = CompatSettings(hosted_tools="reject")


@pytest.mark.parametrize(
    ("fields", "param", "words", "settings"),
    [
        ({"contents": []}, "contents", ("at least one",), None),
        ({"contents": [{"role": "user", "parts": []}]}, "contents.0.parts", ("at least one part",), None),
        ({"contents": [{"role": "system", "parts": [{"text": "x"}]}]}, "contents.0.role", (), None),
        (
            {"contents": [{"parts": [{"text": "a", "inlineData": {"mimeType": "image/png", "data": ""}}]}]},
            "contents.0.parts.0",
            ("2 data fields",),
            None,
        ),
        ({"contents": [{"parts": [{"thought": True}]}]}, "contents.0.parts.0", ("no data field",), None),
        (
            {"contents": [{"parts": [{"text": "a", "thought": True}]}]},
            "contents.0.parts.0.thought",
            ("model turns",),
            None,
        ),
        (
            {"contents": [{"parts": [{"fileData": {"fileUri": "files/x", "mimeType": "image/png"}}]}]},
            "contents.0.parts.0.fileData",
            ("Files API",),
            None,
        ),
        (
            {"contents": [{"parts": [{"inlineData": {"mimeType": "audio/wav", "data": "AA=="}}]}]},
            "contents.0.parts.0.inlineData.mimeType",
            ("images only",),
            None,
        ),
        (
            {"contents": [{"parts": [{"functionCall": {"name": "f"}}]}]},
            "contents.0.parts.0.functionCall",
            ("model turns",),
            None,
        ),
        (
            {"contents": [{"role": "model", "parts": [{"functionResponse": {"name": "f"}}]}]},
            "contents.0.parts.0.functionResponse",
            ("user turns",),
            None,
        ),
        (
            {"contents": [{"role": "model", "parts": [{"executableCode": {"code": "1"}}]}]},
            "contents.0.parts.0.executableCode",
            ("code execution",),
            None,
        ),
        (
            {"contents": [{"parts": [{"functionResponse": {"name": "f", "response": {}}}]}]},
            "contents.0.parts.0.functionResponse.name",
            ("answers no functionCall",),
            None,
        ),
        (
            {"contents": [{"parts": [{"functionResponse": {"id": "c", "name": "f", "parts": [{"inlineData": {}}]}}]}]},
            "contents.0.parts.0.functionResponse.parts",
            ("multimodal",),
            None,
        ),
        (
            {"contents": [{"role": "model", "parts": [{"functionCall": {"name": ""}}]}]},
            "contents.0.parts.0.functionCall.name",
            (),
            None,
        ),
        (
            {"systemInstruction": {"parts": [{"inlineData": {"mimeType": "image/png", "data": ""}}]}},
            "systemInstruction.parts.0",
            ("only text",),
            None,
        ),
        ({"cachedContent": "cachedContents/abc"}, "cachedContent", ("not stored",), None),
        ({"cached_content": "cachedContents/abc"}, "cachedContent", ("not stored",), None),
        (
            {"tools": [{"computerUse": {"environment": "ENVIRONMENT_BROWSER"}}]},
            "tools.0.computerUse",
            ("Google's models",),
            None,
        ),
        ({"tools": [{"googleSearch": {}}]}, "tools.0.googleSearch", ("Google's servers",), REJECT_HOSTED),
        ({"tools": [{"functionDeclarations": {"name": "f"}}]}, "tools.0.functionDeclarations", ("array",), None),
        (
            {
                "tools": [
                    {
                        "functionDeclarations": [
                            {"name": "f", "parameters": {"type": "OBJECT"}, "parametersJsonSchema": {}}
                        ]
                    }
                ]
            },
            "tools.0.functionDeclarations.0.parametersJsonSchema",
            ("not both",),
            None,
        ),
        (
            {"tools": [{"functionDeclarations": [{"name": "f", "parameters": {"type": "TUPLE"}}]}]},
            "tools.0.functionDeclarations.0.parameters.type",
            ("unknown schema type",),
            None,
        ),
        (
            {
                "tools": [{"functionDeclarations": [{"name": "f"}]}],
                "toolConfig": {"functionCallingConfig": {"mode": "AUTO", "allowedFunctionNames": ["f"]}},
            },
            "toolConfig.functionCallingConfig.allowedFunctionNames",
            ("only with mode ANY",),
            None,
        ),
        (
            {
                "tools": [{"functionDeclarations": [{"name": "f"}]}],
                "toolConfig": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["g"]}},
            },
            "toolConfig.functionCallingConfig.allowedFunctionNames",
            ("'g'",),
            None,
        ),
        (
            {"toolConfig": {"functionCallingConfig": {"mode": "ANY"}}},
            "toolConfig.functionCallingConfig.mode",
            ("needs function declarations",),
            None,
        ),
        (
            {"toolConfig": {"functionCallingConfig": {"mode": "SOMETIMES"}}},
            "toolConfig.functionCallingConfig.mode",
            (),
            None,
        ),
        ({"generationConfig": {"temperature": 3}}, "generationConfig.temperature", (), None),
        ({"generationConfig": {"candidateCount": 9}}, "generationConfig.candidateCount", (), None),
        ({"generationConfig": {"logprobs": 2}}, "generationConfig.logprobs", ("responseLogprobs",), None),
        (
            {"generationConfig": {"responseSchema": {"type": "STRING"}}},
            "generationConfig.responseSchema",
            ("application/json",),
            None,
        ),
        (
            {"generationConfig": {"responseMimeType": "text/x.enum"}},
            "generationConfig.responseMimeType",
            ("not served",),
            None,
        ),
        (
            {
                "generationConfig": {
                    "responseMimeType": "application/json",
                    "responseSchema": {},
                    "responseJsonSchema": {},
                }
            },
            "generationConfig.responseJsonSchema",
            ("both",),
            None,
        ),
        (
            {"generationConfig": {"responseModalities": ["TEXT", "IMAGE"]}},
            "generationConfig.responseModalities",
            ("TEXT only",),
            None,
        ),
        (
            {"generationConfig": {"thinkingConfig": {"thinkingBudget": -2}}},
            "generationConfig.thinkingConfig.thinkingBudget",
            (),
            None,
        ),
        ({"generationConfig": {"logitBias": {"1": 2}}}, "generationConfig.logitBias", ("could change",), None),
        ({"topLogprobs": 3}, "topLogprobs", ("could change",), None),
        (
            {"generationConfig": {"thinkingConfig": {"includeThoughts": True}}},
            "generationConfig.thinkingConfig.includeThoughts",
            ("strict",),
            STRICT,
        ),
        ({"safetySettings": []}, "safetySettings", ("strict",), STRICT),
        (
            {"contents": [{"role": "model", "parts": [{"text": "a", "thoughtSignature": "x"}]}]},
            "contents.0.parts.0.thoughtSignature",
            ("strict",),
            STRICT,
        ),
    ],
)
def test_refusals(fields: dict[str, Any], param: str, words: tuple[str, ...], settings: CompatSettings | None) -> None:
    refused({"contents": HI, **fields}, param, *words, settings=settings)


def test_a_body_that_is_not_an_object_is_refused() -> None:
    with pytest.raises(InvalidRequest):
        GeminiTranslation.from_request([], MODEL)  # type: ignore[arg-type]


def test_count_tokens_chat_takes_contents_or_a_whole_request() -> None:
    assert count_tokens_chat({"contents": HI}, MODEL) == {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
    }
    whole = {
        "generateContentRequest": {
            "model": "models/policy",
            "contents": HI,
            "systemInstruction": {"parts": [{"text": "S"}]},
            "tools": [{"functionDeclarations": [SHELL]}],
            "toolConfig": {"functionCallingConfig": {"mode": "ANY"}},
            "generationConfig": {"temperature": 0.5},
        }
    }
    chat = count_tokens_chat(whole, MODEL)
    assert [m["role"] for m in chat["messages"]] == ["system", "user"] and "tool_choice" not in chat
    assert chat["tools"][0]["function"]["name"] == "run_shell_command" and "temperature" not in chat
    for body, param in (
        ({}, "contents"),
        ({"contents": HI, "generateContentRequest": {"contents": HI}}, "contents"),
        ({"contents": [{"parts": [{"fileData": {}}]}]}, "contents.0.parts.0.fileData"),
        ({"generateContentRequest": {"contents": HI, "cachedContent": "c"}}, "cachedContent"),
    ):
        with pytest.raises(InvalidRequest) as caught:
            count_tokens_chat(body, MODEL)
        assert caught.value.param == param


# -- answers ------------------------------------------------------------------------------------


def test_a_text_answer() -> None:
    t = translate()
    answer = t.response(completion({"content": "Hello"}))
    assert answer == {
        "candidates": [
            {"content": {"parts": [{"text": "Hello"}], "role": "model"}, "finishReason": "STOP", "index": 0}
        ],
        "usageMetadata": {"promptTokenCount": 11, "candidatesTokenCount": 4, "totalTokenCount": 15},
        "modelVersion": MODEL,
        "responseId": t.response_id,
    }


def test_function_calls_carry_chat_ids_and_parsed_arguments() -> None:
    t = translate(tools=[{"functionDeclarations": [SHELL]}])
    calls = [shell_call(), shell_call("", '{"command": "pwd"'), {"type": "function", "function": {"name": "f"}}]
    answer = t.response(completion({"content": None, "tool_calls": calls}, "tool_calls"))
    parts = answer["candidates"][0]["content"]["parts"]
    assert parts[0] == {
        "functionCall": {"id": "chatcmpl-tool-7", "name": "run_shell_command", "args": {"command": "ls"}}
    }
    assert parts[1]["functionCall"]["args"] == {"_raw_arguments": '{"command": "pwd"'}  # the sampled text, unparsed
    assert parts[1]["functionCall"]["id"].startswith("call_") and parts[2]["functionCall"]["args"] == {}
    assert parts[1]["functionCall"]["id"] != parts[2]["functionCall"]["id"]
    assert answer["candidates"][0]["finishReason"] == "STOP"


def test_an_answer_passed_back_is_the_sampled_turn() -> None:
    t = translate(tools=[{"functionDeclarations": [SHELL]}])
    sampled = {"content": "Running it.", "tool_calls": [shell_call()]}
    answer = t.response(completion(sampled, "tool_calls"))
    back = [*HI, answer["candidates"][0]["content"]]
    assert translate(contents=back).chat["messages"][-1] == {
        "role": "assistant",
        "content": "Running it.",
        "tool_calls": [{**shell_call(), "function": {"name": "run_shell_command", "arguments": '{"command":"ls"}'}}],
    }


def test_thoughts_are_shown_only_when_asked() -> None:
    message = {"content": "4", "reasoning_content": "2+2"}
    hidden = translate().response(completion(message))
    assert hidden["candidates"][0]["content"]["parts"] == [{"text": "4"}]
    asked = translate(generationConfig={"thinkingConfig": {"includeThoughts": True}}).response(completion(message))
    assert asked["candidates"][0]["content"]["parts"] == [{"text": "2+2", "thought": True}, {"text": "4"}]


@pytest.mark.parametrize(
    ("finish", "reason"),
    [
        ("stop", "STOP"),
        ("length", "MAX_TOKENS"),
        ("tool_calls", "STOP"),
        ("content_filter", "SAFETY"),
        ("abort", "OTHER"),
        (None, "OTHER"),
    ],
)
def test_finish_reasons(finish: Any, reason: str) -> None:
    answer = translate().response(completion({"content": "x"}, finish))
    assert answer["candidates"][0]["finishReason"] == reason


def test_log_probabilities_and_candidates() -> None:
    t = translate(generationConfig={"responseLogprobs": True, "logprobs": 1, "candidateCount": 2})
    top = [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.5}]
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": f"a{i}"},
            "finish_reason": "stop",
            "token_ids": [7, 8 + i],
            "logprobs": {
                "content": [
                    {"token": "a", "logprob": -0.5, "top_logprobs": top},
                    {"token": str(i), "logprob": -0.25, "top_logprobs": top},
                ]
            },
        }
        for i in range(2)
    ]
    answer = t.response({"choices": choices, "usage": {"prompt_tokens": 3, "completion_tokens": 4}})
    one, two = answer["candidates"]
    assert (one["index"], two["index"], two["content"]["parts"]) == (0, 1, [{"text": "a1"}])
    assert two["logprobsResult"] == {
        "chosenCandidates": [
            {"token": "a", "logProbability": -0.5, "tokenId": 7},
            {"token": "1", "logProbability": -0.25, "tokenId": 9},
        ],
        "logProbabilitySum": -0.75,
        "topCandidates": [{"candidates": [{"token": "a", "logProbability": -0.5}]}] * 2,
    }
    assert two["avgLogprobs"] == -0.375
    assert "logprobsResult" not in translate().response(completion({"content": "x"}))["candidates"][0]


def test_usage_from_the_ids_when_the_engine_gave_no_counts_and_no_choices_is_an_error() -> None:
    answer = translate().response(
        {"choices": [{"message": {"content": "x"}, "token_ids": [1, 2]}], "prompt_token_ids": [5]}
    )
    assert answer["usageMetadata"] == {"promptTokenCount": 1, "candidatesTokenCount": 2, "totalTokenCount": 3}
    with pytest.raises(UpstreamError):
        translate().response({"choices": []})


# -- streams ------------------------------------------------------------------------------------


def test_a_streamed_text_answer_is_the_whole_answer_and_ends_with_the_finish() -> None:
    t = translate(stream=True)
    raw = run_stream(
        t,
        [
            {**chunk({"role": "assistant", "content": ""}), "prompt_token_ids": [1, 2, 3]},
            chunk({"content": "Hel"}),
            chunk({"content": "lo"}, "stop"),
            usage(3, 2),
        ],
    )
    chunks = events(raw)
    assert [c["candidates"][0]["content"]["parts"] for c in chunks] == [[{"text": "Hel"}], [{"text": "lo"}], []]
    assert "finishReason" not in chunks[0]["candidates"][0] and chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    whole = t.response(
        {
            "choices": [{"index": 0, "message": {"content": "Hello"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2},
        }
    )
    assert joined(chunks) == flat(whole)


def test_a_streamed_tool_call_is_sent_whole_at_its_finish() -> None:
    t = translate(stream=True, tools=[{"functionDeclarations": [SHELL]}])
    opening = {"index": 0, "id": "chatcmpl-tool-7", "function": {"name": "run_shell_command", "arguments": ""}}
    stream = t.stream()
    text = stream.chunk(chunk({"content": "Ok."}))
    assert stream.chunk(chunk({"tool_calls": [opening]})) == b""
    assert stream.chunk(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"command": '}}]})) == b""
    assert stream.chunk(chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"ls"}'}}]})) == b""
    at_finish = stream.chunk(chunk({}, "tool_calls"))
    assert events(at_finish)[0]["candidates"][0]["content"]["parts"] == [
        {"functionCall": {"id": "chatcmpl-tool-7", "name": "run_shell_command", "args": {"command": "ls"}}}
    ]
    assert stream.chunk(usage(11, 4)) == b""
    chunks = events(text + at_finish + stream.done())
    whole = t.response(completion({"content": "Ok.", "tool_calls": [shell_call()]}, "tool_calls"))
    assert joined(chunks) == flat(whole)


def test_streamed_thoughts_only_when_asked_and_log_probabilities_per_chunk() -> None:
    lp = {"content": [{"token": "x", "logprob": -0.5}]}
    t = translate(stream=True, generationConfig={"thinkingConfig": {"includeThoughts": True}, "responseLogprobs": True})
    chunks = events(
        run_stream(t, [chunk({"reasoning_content": "hm"}, logprobs=lp, token_ids=[9]), chunk({"content": "x"}, "stop")])
    )
    assert chunks[0]["candidates"][0]["content"]["parts"] == [{"text": "hm", "thought": True}]
    assert chunks[0]["candidates"][0]["logprobsResult"]["chosenCandidates"] == [
        {"token": "x", "logProbability": -0.5, "tokenId": 9}
    ]
    hidden = events(run_stream(translate(stream=True), [chunk({"reasoning": "hm"}), chunk({"content": "x"}, "stop")]))
    assert [c["candidates"][0]["content"]["parts"] for c in hidden] == [[{"text": "x"}], []]


def test_calls_unsent_when_the_stream_ends_and_an_empty_stream_still_finish() -> None:
    t = translate(stream=True)
    stream = t.stream()
    stream.chunk(chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": "{}"}}]}))
    (final,) = events(stream.done())
    assert final["candidates"][0]["content"]["parts"] == [{"functionCall": {"id": "c", "name": "f", "args": {}}}]
    (empty,) = events(translate(stream=True).stream().done())
    assert empty["candidates"] == [{"content": {"parts": [], "role": "model"}, "finishReason": "OTHER", "index": 0}]
    assert empty["usageMetadata"] == {"promptTokenCount": 0, "candidatesTokenCount": 0, "totalTokenCount": 0}


def test_without_alt_sse_the_stream_is_one_json_array() -> None:
    t = GeminiTranslation.from_request({"contents": HI}, MODEL, stream=True, sse=False)
    raw = run_stream(t, [chunk({"content": "Hel"}), chunk({"content": "lo"}, "stop"), usage(3, 2)])
    parsed = orjson.loads(raw)
    assert isinstance(parsed, list) and len(parsed) == 3 and joined(parsed)["parts"] == [{"text": "Hello"}]
    stream = t.stream()
    stream.chunk(chunk({"content": "x"}))
    cut = orjson.loads(b"".join([b"[\r\n" + orjson.dumps({}), stream.error(UpstreamError("gone"))]))
    assert cut[-1]["error"]["status"] == "UNAVAILABLE"


def test_a_stream_error_event_is_googles_error() -> None:
    t = translate(stream=True)
    (event,) = events(t.stream().error(UpstreamError("the engine went away", code="incomplete_stream")))
    assert event == {
        "error": {
            "code": 502,
            "message": "the engine went away",
            "status": "UNAVAILABLE",
            "details": [
                {
                    "@type": "type.googleapis.com/google.rpc.ErrorInfo",
                    "reason": "INCOMPLETE_STREAM",
                    "domain": "flywheel",
                }
            ],
        }
    }


# -- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (InvalidRequest("x"), "INVALID_ARGUMENT"),
        (AuthenticationFailed("x"), "UNAUTHENTICATED"),
        (PermissionDenied("x"), "PERMISSION_DENIED"),
        (NotFound("x"), "NOT_FOUND"),
        (EpisodeClosed("x"), "ABORTED"),
        (PayloadTooLarge("x"), "INVALID_ARGUMENT"),
        (TooManyRequests("x", retry_after_s=1), "RESOURCE_EXHAUSTED"),
        (ServiceUnavailable("x"), "UNAVAILABLE"),
        (UpstreamTimeout("x"), "DEADLINE_EXCEEDED"),
        (FlywheelError("x"), "INTERNAL"),
    ],
)
def test_error_statuses(error: FlywheelError, status: str) -> None:
    body = error_body(error)
    assert body["error"]["status"] == status and body["error"]["code"] == error.status_code


def test_error_body_of_a_refusal_names_the_field() -> None:
    error = InvalidRequest("nope", param="generationConfig.topK", code="compat_strict")
    assert error_body(error)["error"]["details"] == [
        {
            "@type": "type.googleapis.com/google.rpc.ErrorInfo",
            "reason": "COMPAT_STRICT",
            "domain": "flywheel",
            "metadata": {"param": "generationConfig.topK"},
        },
        {
            "@type": "type.googleapis.com/google.rpc.BadRequest",
            "fieldViolations": [{"field": "generationConfig.topK", "description": "nope"}],
        },
    ]


def test_which_paths_speak_google() -> None:
    assert speaks_gemini("/v1beta/models/policy:generateContent")
    assert speaks_gemini("/episodes/e/v1beta/models") and speaks_gemini("/v1/models/policy:countTokens")
    assert not speaks_gemini("/v1/models/policy") and not speaks_gemini("/v1/chat/completions")


# -- the routes, on the named fake upstream ----------------------------------------------------


def _sse(body: dict[str, Any]) -> bytes:
    base = {"id": "chatcmpl-s", "object": "chat.completion.chunk", "created": 1, "model": body["model"]}
    chunks = [
        {
            **base,
            "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        },
        {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "Hel"},
                    "token_ids": [42],
                    "logprobs": {"content": [{"token": "Hel", "logprob": -0.5}]},
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
                }
            ],
        },
        {**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
    ]
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class _Events(httpx.AsyncByteStream):
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.raw


def _streaming(request: httpx.Request, body: dict[str, Any]) -> httpx.Response | None:
    if request.url.path == "/v1/chat/completions" and body.get("stream"):
        return httpx.Response(200, stream=_Events(_sse(body)), headers={"content-type": "text/event-stream"})
    if request.url.path == "/tokenize":
        return httpx.Response(
            200, json={"count": 7 + len(body.get("tools") or []), "max_model_len": 8192, "tokens": []}
        )
    return None


@pytest.fixture
async def proxy(sqlite_url: str, tmp_path: Path) -> Any:
    seen: list[tuple[str, dict[str, Any]]] = []
    async with running_app(make_settings(sqlite_url), fake_upstream(seen, _streaming)) as client:
        client.seen = seen  # type: ignore[attr-defined]
        yield client


async def calls_of(client: httpx.AsyncClient, episode_id: str) -> list[dict[str, Any]]:
    response = await client.get(f"/episodes/{episode_id}", headers=ADMIN)
    return sorted(response.json()["calls"], key=lambda c: c["ordinal"])


def goog(group: dict[str, Any]) -> dict[str, str]:
    return {"x-goog-api-key": group["episode_keys"][0]["api_key"]}


async def test_generate_content_runs_as_a_recorded_chat_call(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    episode = group["episode_keys"][0]["id"]
    body = {"contents": HI, "systemInstruction": {"parts": [{"text": "Be brief."}]}, "safetySettings": []}
    response = await proxy.post(
        f"/episodes/{episode}/v1beta/models/policy:generateContent", json=body, headers=goog(group)
    )
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["candidates"][0]["content"] == {"parts": [{"text": "answer 0"}], "role": "model"}
    assert answer["usageMetadata"]["promptTokenCount"] == 3 and answer["modelVersion"] == "policy"
    path, sent = proxy.seen[-1]  # type: ignore[attr-defined]
    assert path.endswith("/v1/chat/completions") and sent["return_token_ids"] is True
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (call,) = await calls_of(proxy, episode)
    assert (call["api"], call["response_id"], call["client_request"]) == ("gemini", answer["responseId"], body)
    assert call["request"]["messages"] == sent["messages"] and call["choices"][0]["token_ids"] == [42, 100]
    assert call["notes"]["compat"] == {"ignored": ["safetySettings"]}


async def test_a_streamed_call_holds_its_finish_until_recorded(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    url = "/v1beta/models/policy:streamGenerateContent?alt=sse"
    async with proxy.stream("POST", url, json={"contents": HI}, headers=goog(group)) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = await response.aread()
    chunks = events(raw)
    assert joined(chunks)["parts"] == [{"text": "Hello"}] and b"[DONE]" not in raw
    assert chunks[-1]["usageMetadata"] == {"promptTokenCount": 3, "candidatesTokenCount": 2, "totalTokenCount": 5}
    (call,) = await calls_of(proxy, group["episode_keys"][0]["id"])
    assert (call["api"], call["stream"], call["exact_ids"]) == ("gemini", True, True)
    assert call["choices"][0]["token_ids"] == [42, 43] and call["response_id"] == chunks[-1]["responseId"]
    async with proxy.stream(
        "POST", url.removesuffix("?alt=sse"), json={"contents": HI}, headers=goog(group)
    ) as response:
        assert response.headers["content-type"].startswith("application/json")
        assert joined(orjson.loads(await response.aread()))["parts"] == [{"text": "Hello"}]


async def test_the_key_in_the_query_and_googles_v1(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    key = group["episode_keys"][0]["api_key"]
    response = await proxy.post(f"/v1/models/policy:generateContent?key={key}", json={"contents": HI})
    assert response.status_code == 200, response.text
    elsewhere = await proxy.post(f"/v1/chat/completions?key={key}", json={"model": "policy", "messages": []})
    assert elsewhere.status_code == 401  # only Google's routes read the key from the URL
    passthrough = await proxy.post(
        "/passthrough/v1beta/models/policy:generateContent",
        json={"contents": HI},
        headers={"x-goog-api-key": "agent-key-0123456789abcdef"},
    )
    assert passthrough.status_code == 200
    assert len(await calls_of(proxy, group["episode_keys"][0]["id"])) == 1


async def test_refusals_are_googles_errors_recorded_as_refused_calls(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    body = {"contents": HI, "cachedContent": "cachedContents/x"}
    response = await proxy.post("/v1beta/models/policy:generateContent", json=body, headers=goog(group))
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["status"], error["details"][0]["reason"]) == (
        400,
        "INVALID_ARGUMENT",
        "UNSUPPORTED_PARAMETER",
    )
    assert error["details"][1]["fieldViolations"][0]["field"] == "cachedContent"
    (call,) = await calls_of(proxy, group["episode_keys"][0]["id"])
    assert (call["status_code"], call["api"], call["client_request"], call["choices"]) == (400, "gemini", body, [])
    assert call["notes"] == {"refused": "unsupported_parameter"}
    assert not any(p.endswith("/chat/completions") for p, _ in proxy.seen)  # type: ignore[attr-defined]
    wrong = await proxy.post("/v1beta/models/policy:generateContent", json=body, headers={"x-goog-api-key": "wrong"})
    assert (wrong.status_code, wrong.json()["error"]["status"]) == (401, "UNAUTHENTICATED")
    missing = await proxy.post("/v1beta/models/policy:embedContent", json=body, headers=goog(group))
    assert (missing.status_code, missing.json()["error"]["status"]) == (404, "NOT_FOUND")
    broken = await proxy.post(
        "/v1beta/models/policy:generateContent",
        content=b"{no",
        headers={**goog(group), "content-type": "application/json"},
    )
    assert broken.status_code == 400 and broken.json()["error"]["status"] == "INVALID_ARGUMENT"


async def test_count_tokens_renders_on_the_engine_and_records_nothing(proxy: httpx.AsyncClient) -> None:
    group = await new_group(proxy, size=1)
    body = {"contents": HI, "tools": [{"functionDeclarations": [SHELL]}]}
    response = await proxy.post(
        "/v1beta/models/policy:countTokens", json={"generateContentRequest": body}, headers=goog(group)
    )
    assert response.status_code == 200 and response.json() == {"totalTokens": 8}
    path, sent = proxy.seen[-1]  # type: ignore[attr-defined]
    assert path.endswith("/tokenize") and sent["tools"][0]["function"]["name"] == "run_shell_command"
    refused_ = await proxy.post("/v1beta/models/policy:countTokens", json={}, headers=goog(group))
    assert refused_.status_code == 400 and refused_.json()["error"]["status"] == "INVALID_ARGUMENT"
    assert await calls_of(proxy, group["episode_keys"][0]["id"]) == []


def test_translation_is_not_changed_by_its_answer() -> None:
    body = {"contents": HI, "tools": [{"functionDeclarations": [SHELL]}]}
    kept = copy.deepcopy(body)
    t = GeminiTranslation.from_request(body, MODEL)
    t.response(completion({"content": "x"}))
    assert body == kept and t.client_request is body


async def test_a_gemini_agent_resending_its_contents_is_stored_as_deltas(sqlite_url: str) -> None:
    """Gemini CLI sends its whole conversation every turn: the stored ``client_request`` keeps only
    each turn's new ``contents`` (``contract.tokens.client_list``), and every reader gets it whole."""
    from sqlalchemy import select

    from proxy.store.db import make_engine
    from proxy.store.models import Call

    contents: list[dict[str, Any]] = list(HI)
    sent = []
    async with running_app(make_settings(sqlite_url), fake_upstream()) as client:
        group = await new_group(client, size=1)
        for turn in range(3):
            body = {"contents": list(contents), "systemInstruction": {"parts": [{"text": "Be brief."}]}}
            response = await client.post("/v1beta/models/policy:generateContent", json=body, headers=goog(group))
            assert response.status_code == 200, response.text
            sent.append(body)
            contents += [response.json()["candidates"][0]["content"], {"role": "user", "parts": [{"text": f"{turn}?"}]}]
        stored = await calls_of(client, group["episode_keys"][0]["id"])
    assert [c["client_request"] for c in stored] == sent
    engine = make_engine(sqlite_url)
    try:
        async with engine.connect() as conn:
            raw = (await conn.execute(select(Call.__table__.c.client_request).order_by(Call.ordinal))).scalars().all()
    finally:
        await engine.dispose()
    assert [len(r["contents"]) for r in raw] == [1, 2, 2]  # only what each turn added
