"""The compatibility policy (``proxy/compat.py``) through the two translators that call it.

Each rule on the fields today's harnesses send (Claude Code 2.1.332, Codex CLI 0.169.0, as captured
from the real CLIs), the lenient and the strict mode, the settings that say what the model can
do, and the rule by kind that keeps a newer harness working: an unknown metadata-like field is
accepted and noted, an unknown sampling-like one refused.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from proxy.compat import Ledger, sampling_like
from proxy.dialects.messages import MessagesTranslation, count_tokens_chat
from proxy.dialects.responses import ResponsesStream, ResponsesTranslation, parse
from proxy.errors import InvalidRequest
from proxy.settings import CompatSettings

STRICT = CompatSettings(mode="strict")
SCHEMA = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


def claude_code(**fields: Any) -> dict[str, Any]:
    """The shape of Claude Code 2.1.332's first request (its fields, shortened texts)."""
    cached = {"type": "ephemeral"}
    return {
        "model": "policy",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "create hello.txt", "cache_control": cached}]},
            {"role": "system", "content": [{"type": "text", "text": "# Environment\nPlatform: linux"}]},
        ],
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332"},
            {"type": "text", "text": "You are a Claude agent.", "cache_control": cached},
        ],
        "tools": [
            {"name": "Bash", "description": "Run a command.", "input_schema": SCHEMA},
            {
                "name": "Placeholder",
                "description": "never call",
                "input_schema": {"type": "object"},
                "defer_loading": True,
            },
        ],
        "metadata": {"user_id": '{"device_id": "d", "session_id": "s"}'},
        "max_tokens": 32000,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "stream": True,
        **fields,
    }


def codex(**fields: Any) -> dict[str, Any]:
    """The shape of Codex CLI 0.169.0's first request."""
    function = {
        "type": "function",
        "name": "exec_command",
        "description": "Run.",
        "strict": False,
        "parameters": SCHEMA,
    }
    member = {**function, "name": "spawn_agent", "description": "Spawn an agent."}
    return {
        "model": "policy",
        "instructions": None,
        "input": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Be a coder."}],
            },
            {
                "type": "message",
                "id": "msg_2",
                "role": "user",
                "content": [{"type": "input_text", "text": "create hello.txt"}],
            },
        ],
        "tools": [
            function,
            {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [member]},
            {"type": "web_search", "external_web_access": True},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"thread_id": "thread-1", "x-codex-turn-metadata": "{}"},
        **fields,
    }


def responses(body: dict[str, Any], settings: CompatSettings | None = None) -> ResponsesTranslation:
    ledger = Ledger(settings)
    return ResponsesTranslation(parse(body, ledger), body, [], ledger)


# -- by kind ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "sampling"),
    [
        ("request_labels", {"team": "rl"}, False),
        ("client_info", {"os": "linux", "version": "2.2"}, False),
        ("trace_id", "abc", False),
        ("temperature_boost", 2, True),
        ("maxOutputTokens", 64, True),
        ("generation", {"top_p": 0.5}, True),
        ("hints", [{"stop": ["x"]}], True),
        ("speculative_grammar", True, True),
    ],
)
def test_a_field_is_classified_by_its_kind(name: str, value: Any, sampling: bool) -> None:
    assert sampling_like(name, value) is sampling


# -- Messages (Claude Code) -------------------------------------------------------------------------


def test_claude_code_is_served_lenient_with_every_decision_noted() -> None:
    body = claude_code()
    before = copy.deepcopy(body)
    t = MessagesTranslation.from_request(body)
    assert body == before  # the client's request is stored as it came
    assert t.chat["messages"] == [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=2.1.332\nYou are a Claude agent."},
        {"role": "user", "content": "create hello.txt"},
        {"role": "system", "content": "# Environment\nPlatform: linux"},  # a system turn where it stands
    ]
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == ["Bash"]  # the deferred tool is not shown
    assert "reasoning_effort" not in t.chat and "chat_template_kwargs" not in t.chat
    assert t.compat == {
        "ignored": ["cache_control", "context_management", "metadata", "output_config.effort"],
        "mapped": {
            "messages.role": "a system message in the conversation: a system turn where it stands",
            "thinking": "served as disabled: the model has no reasoning",
            "tools.defer_loading": "a deferred tool is not shown to the model",
        },
    }
    assert sorted(t.ledger.counts()) == [
        ("ignored", "cache_control"),
        ("ignored", "context_management"),
        ("ignored", "metadata"),
        ("ignored", "output_config.effort"),
        ("mapped", "messages.role"),
        ("mapped", "thinking"),
        ("mapped", "tools.defer_loading"),
    ]


def test_output_config_on_a_message_gets_the_top_levels_rule() -> None:
    """Claude Code under its default model name sends ``output_config`` on its system message inside
    ``messages`` (seen with 2.1.332 and ``claude-opus-5-5``): accepted as at the top level, and an
    unknown key in it refused by the same rule, named where it stands."""
    body = claude_code()
    body["messages"][1]["output_config"] = {"effort": "medium"}
    before = copy.deepcopy(body)
    t = MessagesTranslation.from_request(body)
    assert body == before
    assert t.chat == MessagesTranslation.from_request(claude_code()).chat
    assert "messages.output_config.effort" in t.compat["ignored"]  # type: ignore[index]
    body["messages"][1]["output_config"] = {"effort": "medium", "format": {"type": "json_schema"}}
    with pytest.raises(InvalidRequest) as caught:
        MessagesTranslation.from_request(body)
    assert caught.value.param == "messages.1.output_config.format"
    with pytest.raises(InvalidRequest) as caught:  # strict: not used, so refused, like the top level's
        MessagesTranslation.from_request({**claude_code(), "messages": before["messages"]}, STRICT)
    assert caught.value.code == "compat_strict"


def test_a_new_harmless_field_keeps_a_harness_working_and_is_noted() -> None:
    t = MessagesTranslation.from_request(claude_code(request_labels={"team": "rl"}))
    assert "request_labels" in t.compat["ignored"]  # type: ignore[index]
    assert ("ignored", "other") in list(t.ledger.counts())
    assert t.chat == MessagesTranslation.from_request(claude_code()).chat


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"sampling_seed_offset": 3}, "sampling_seed_offset"),
        ({"output_config": {"effort": "high", "format": {"type": "json_schema"}}}, "output_config.format"),
        ({"thinking": {"type": "adaptive", "temperature": 0.1}}, "thinking.temperature"),
    ],
)
def test_an_unknown_sampling_like_field_is_refused_naming_it(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        MessagesTranslation.from_request(claude_code(**fields))
    assert (caught.value.status_code, caught.value.type, caught.value.param) == (400, "invalid_request_error", param)
    assert caught.value.code == "unsupported_parameter" and param in caught.value.message


@pytest.mark.parametrize(
    ("drop", "param"),
    [
        ((), "metadata"),
        (("metadata",), "thinking.type"),
        (("metadata", "thinking"), "context_management.edits.0"),
        (("metadata", "thinking", "context_management"), "output_config.effort"),
        (("metadata", "thinking", "context_management", "output_config"), "system.1.cache_control"),
    ],
)
def test_strict_refuses_every_field_that_is_not_used(drop: tuple[str, ...], param: str) -> None:
    body = {k: v for k, v in claude_code().items() if k not in drop}
    with pytest.raises(InvalidRequest) as caught:
        MessagesTranslation.from_request(body, STRICT)
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, param, "compat_strict")
    assert f"'{param}'" in caught.value.message and "strict" in caught.value.message


def test_strict_serves_a_request_of_used_fields_only() -> None:
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.5}
    t = MessagesTranslation.from_request(body, STRICT)
    assert t.compat is None and t.chat["temperature"] == 0.5


def test_a_reasoning_model_gets_the_template_switch_and_the_effort() -> None:
    settings = CompatSettings(thinking_switch="enable_thinking", reasoning_effort=True)
    on = MessagesTranslation.from_request(claude_code(), settings)
    assert on.chat["chat_template_kwargs"] == {"enable_thinking": True} and on.chat["reasoning_effort"] == "high"
    assert "thinking" not in (on.compat or {}).get("mapped", {})  # used, not mapped
    off = MessagesTranslation.from_request(claude_code(thinking={"type": "disabled"}), settings)
    assert off.chat["chat_template_kwargs"] == {"enable_thinking": False}
    count = count_tokens_chat({k: v for k, v in claude_code().items() if k not in ("max_tokens", "stream")}, settings)
    assert count["chat_template_kwargs"] == {"enable_thinking": True}  # the prompt the call would render


def test_without_thinking_a_reasoning_model_is_served_with_thinking_off() -> None:
    """Anthropic's default is no thinking; the chat template's may be on (Qwen3's is): with the switch
    configured, a request without ``thinking`` sends it off rather than leave the template's default."""
    settings = CompatSettings(thinking_switch="enable_thinking")
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    switch = {
        kind: MessagesTranslation.from_request({**body, "thinking": {"type": kind}} if kind else body, settings)
        for kind in (None, "enabled", "disabled")
    }
    assert {kind: t.chat["chat_template_kwargs"] for kind, t in switch.items()} == {
        None: {"enable_thinking": False},
        "enabled": {"enable_thinking": True},
        "disabled": {"enable_thinking": False},
    }
    count = count_tokens_chat({k: v for k, v in body.items() if k != "max_tokens"}, settings)
    assert count["chat_template_kwargs"] == {"enable_thinking": False}  # the prompt the call would render
    assert "chat_template_kwargs" not in MessagesTranslation.from_request(body).chat  # no switch: nothing to set


def test_merge_puts_a_conversation_system_message_into_the_leading_one() -> None:
    t = MessagesTranslation.from_request(claude_code(), CompatSettings(system_messages="merge"))
    assert [m["role"] for m in t.chat["messages"]] == ["system", "user"]
    assert t.chat["messages"][0]["content"].endswith("You are a Claude agent.\n\n# Environment\nPlatform: linux")


def _thinking_turns(turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Go"}]
    for i in range(turns):
        thinking = {"type": "thinking", "thinking": f"step {i}", "signature": "s"}
        messages += [
            {"role": "assistant", "content": [thinking, {"type": "text", "text": f"did {i}"}]},
            {"role": "user", "content": "next"},
        ]
    return messages


def test_clear_thinking_drops_older_turns_reasoning_only_when_there_is_some_to_drop() -> None:
    edit = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}}]}
    t = MessagesTranslation.from_request(claude_code(messages=_thinking_turns(3), context_management=edit))
    reasoning = [m.get("reasoning_content") for m in t.chat["messages"] if m["role"] == "assistant"]
    assert reasoning == [None, None, "step 2"]
    assert "context_management.edits" in t.compat["mapped"]  # type: ignore[index]
    untouched = MessagesTranslation.from_request(claude_code(messages=_thinking_turns(1), context_management=edit))
    assert "context_management" in untouched.compat["ignored"]  # type: ignore[index]


def test_clearing_tool_results_is_refused_once_there_are_tool_results() -> None:
    edit = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    assert (
        "context_management" in MessagesTranslation.from_request(claude_code(context_management=edit)).compat["ignored"]
    )  # type: ignore[index]
    messages = [
        {"role": "user", "content": "Go"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}]},
    ]
    with pytest.raises(InvalidRequest) as caught:
        MessagesTranslation.from_request(claude_code(messages=messages, context_management=edit))
    assert (caught.value.status_code, caught.value.param) == (400, "context_management.edits.0.type")


@pytest.mark.parametrize(
    ("settings", "dropped"),
    [(CompatSettings(), True), (CompatSettings(hosted_tools="reject"), False), (STRICT, False)],
)
def test_a_hosted_tool_is_dropped_or_refused(settings: CompatSettings, dropped: bool) -> None:
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    tools = [{"name": "Bash", "input_schema": SCHEMA}, search]
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "tools": tools}
    if dropped:
        t = MessagesTranslation.from_request(body, settings)
        assert [x["function"]["name"] for x in t.chat["tools"]] == ["Bash"]
        assert t.compat == {"dropped_tools": ["web_search_20250305"]}
        return
    with pytest.raises(InvalidRequest) as caught:
        MessagesTranslation.from_request(body, settings)
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, "tools.1.type", "hosted_tool")


# -- Responses (Codex) ------------------------------------------------------------------------------


def test_codex_is_served_lenient_with_namespaces_flattened_and_hosted_tools_dropped() -> None:
    t = responses(codex())
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == ["exec_command", "multi_agent_v1__spawn_agent"]
    assert t.chat["messages"][0] == {"role": "system", "content": "Be a coder."}
    assert t.chat["tool_choice"] == "auto" and "reasoning_effort" not in t.chat
    assert t.compat == {
        "ignored": ["client_metadata", "prompt_cache_key", "reasoning.summary"],
        "mapped": {"tools.namespace": "flattened into function tools named <namespace>__<name>"},
        "dropped_tools": ["web_search"],
    }


def test_a_namespaced_call_is_named_back_in_the_answer_and_in_the_history() -> None:
    t = responses(codex(stream=False))
    call = {"id": "call_1", "type": "function", "function": {"name": "multi_agent_v1__spawn_agent", "arguments": "{}"}}
    answer = {
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"content": None, "tool_calls": [call]}}]
    }
    (item,) = t.response(answer)["output"]
    assert (item["name"], item["namespace"], item["call_id"]) == ("spawn_agent", "multi_agent_v1", "call_1")
    stream = ResponsesStream(t)
    fragment = {"index": 0, "id": "call_1", "type": "function", "function": {"name": call["function"]["name"]}}
    stream.chunk({"choices": [{"index": 0, "delta": {"tool_calls": [fragment]}, "finish_reason": "tool_calls"}]})
    stream.done()
    assert (stream.output[0]["name"], stream.output[0]["namespace"]) == ("spawn_agent", "multi_agent_v1")
    back = {**item, "type": "function_call", "arguments": "{}"}
    follow = responses(
        codex(input=[*codex()["input"], back, {"type": "function_call_output", "call_id": "call_1", "output": "ok"}])
    )
    assert follow.chat["messages"][-2]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"


def _known_model(members: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """Codex (0.169.0) under a model name it knows (``gpt-6.1-sol``): its tools in an ``additional_tools``
    input item (a namespace), none at the top level, and ``reasoning.context``."""
    body = codex(**fields)
    extra = {"type": "additional_tools", "id": "at_1", "role": "developer"}
    extra["tools"] = [{"type": "namespace", "name": "functions", "description": "", "tools": members}]
    body["input"] = [extra, *body["input"]]
    del body["tools"]
    body["reasoning"] = {"effort": "low", "context": "all_turns"}
    return body


def test_codex_under_a_model_name_it_knows_gets_its_input_item_tools_served() -> None:
    function = {"type": "function", "name": "exec_command", "description": "Run.", "parameters": SCHEMA}
    t = responses(_known_model([function]))
    assert [tool["function"]["name"] for tool in t.chat["tools"]] == ["functions__exec_command"]
    assert t.chat["tool_choice"] == "auto"
    assert [m["role"] for m in t.chat["messages"]] == ["system", "user"]  # the tools item is no turn
    assert t.compat is not None and "reasoning.context" in t.compat["ignored"]
    assert "input.additional_tools" in t.compat["mapped"]
    with pytest.raises(InvalidRequest) as caught:  # with a reasoning model it may change what is rendered
        responses(_known_model([function]), CompatSettings(thinking_switch="enable_thinking"))
    assert caught.value.param == "reasoning.context"
    with pytest.raises(InvalidRequest) as caught:
        unused = ("prompt_cache_key", "client_metadata", "reasoning")
        responses({k: v for k, v in _known_model([function]).items() if k not in unused}, STRICT)
    assert (caught.value.param, caught.value.code) == ("input[0]", "compat_strict")


def test_codex_freeform_tools_are_refused_naming_the_model_name_that_avoids_them() -> None:
    """Its freeform tools (``custom``: a grammar only OpenAI's models know) are refused with a 400
    naming the tool and the fix, never dropped into a request without tools."""
    with pytest.raises(InvalidRequest) as caught:
        responses(_known_model([{"type": "custom", "name": "exec", "description": "Run JavaScript."}]))
    assert caught.value.param == "input[0].tools[0].tools[0].type"
    assert "'custom'" in caught.value.message and "such as policy" in caught.value.message


def test_a_new_harmless_responses_field_is_noted_and_a_sampling_like_one_refused() -> None:
    assert "client_info" in responses(codex(client_info={"os": "linux"})).compat["ignored"]  # type: ignore[index]
    with pytest.raises(InvalidRequest) as caught:
        responses(codex(top_k=5))
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, "top_k", "unsupported_parameter")


@pytest.mark.parametrize(
    ("drop", "param"),
    [
        ((), "prompt_cache_key"),
        (("prompt_cache_key",), "reasoning.summary"),
        (("prompt_cache_key", "reasoning"), "client_metadata"),
        (("prompt_cache_key", "reasoning", "client_metadata"), "tools[1]"),
    ],
)
def test_strict_refuses_what_codex_sends_beyond_the_used_fields(drop: tuple[str, ...], param: str) -> None:
    body = {k: v for k, v in codex().items() if k not in drop}
    with pytest.raises(InvalidRequest) as caught:
        responses(body, STRICT)
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, param, "compat_strict")


def test_rejecting_hosted_tools_keeps_the_400() -> None:
    with pytest.raises(InvalidRequest) as caught:
        responses(codex(), CompatSettings(hosted_tools="reject"))
    assert (caught.value.status_code, caught.value.param, caught.value.code) == (400, "tools[2].type", "hosted_tool")


def test_an_effort_is_sent_only_to_a_model_that_has_one() -> None:
    assert "reasoning.effort" in responses(codex(reasoning={"effort": "low"})).compat["ignored"]  # type: ignore[index]
    used = responses(codex(reasoning={"effort": "low"}), CompatSettings(reasoning_effort=True))
    assert used.chat["reasoning_effort"] == "low"
