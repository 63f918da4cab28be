"""A Responses request as the chat completions body vLLM runs (the mapping: ``__init__.py``).

``parse`` validates the fields the proxy serves; ``chat_body`` turns instructions, the history of
a ``previous_response_id`` (``history_of``, from the store), input items, tools and sampling into
one chat body. A run of ``function_call`` items becomes one assistant turn with ``tool_calls``, so
a turn passed back repeats the recorded choice and the proxy splices its sampled ids
(``proxy/splice.py``). Anything refused is an ``InvalidRequest`` naming its place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from proxy import compat
from proxy.compat import Ledger
from proxy.dialects.responses.answer import unsealed
from proxy.errors import InvalidRequest
from proxy.store.records import CallRecord

INCLUDABLE = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content"})


class ResponsesRequest(BaseModel):
    """The request fields the proxy serves or echoes; any other field gets its rule from ``compat``."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None


def parse(body: dict[str, Any], ledger: Ledger | None = None) -> ResponsesRequest:
    """The validated request; ``InvalidRequest`` naming the first bad field. ``ledger`` gets what
    ``proxy/compat.py`` decides about the fields the translation does not use."""
    try:
        request = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    compat.responses_top(request, ledger or Ledger())
    for name in request.include or ():
        if name not in INCLUDABLE:
            raise InvalidRequest(
                f"'include' value {name!r} is not served; supported: {sorted(INCLUDABLE)}", param="include"
            )
    return request


def _invalid(exc: ValidationError) -> InvalidRequest:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    if error["type"] == "literal_error" and where == "truncation":
        return InvalidRequest(
            "'truncation: auto' is not served: the proxy never drops context; send what fits", param=where
        )
    return InvalidRequest(f"'{where}': {error['msg']}", param=where)


def chat_body(
    request: ResponsesRequest, history: list[dict[str, Any]], ledger: Ledger, *, logprobs: bool
) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """The chat body, and the flattened name of each namespaced tool -> (namespace, name).

    ``history``: the chat messages ``previous_response_id`` stands for (``history_of``);
    ``logprobs``: the client included ``message.output_text.logprobs``."""
    messages: list[dict[str, Any]] = []
    if request.instructions is not None:
        messages.append({"role": "system", "content": request.instructions})
    messages.extend(history)
    messages.extend(input_messages(request.input))
    if not messages:
        raise InvalidRequest("'input' is empty", param="input")
    chat: dict[str, Any] = {"model": request.model, "messages": messages}
    names = _tools_and_choice(request, chat, ledger)
    if request.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = request.parallel_tool_calls
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
        if (value := getattr(request, src)) is not None:
            chat[dst] = value
    if logprobs:
        chat["logprobs"] = True
        if request.top_logprobs:
            chat["top_logprobs"] = request.top_logprobs
    if request.text and (fmt := _response_format(request.text)) is not None:
        chat["response_format"] = fmt
    if request.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat | ledger.chat, names


def history_of(call: CallRecord) -> list[dict[str, Any]]:
    """The conversation a stored Responses call ended with, as chat messages: its messages
    without its instructions, then its answer (the assistant turn exactly as recorded)."""
    messages = list(call.request.get("messages") or [])
    if (call.client_request or {}).get("instructions") is not None and messages:
        messages = messages[1:]
    choice = call.choices[0] if call.choices else {}
    turn: dict[str, Any] = {"role": "assistant", "content": choice.get("text") or None}
    if choice.get("tool_calls"):
        turn["tool_calls"] = choice["tool_calls"]
    return [*messages, turn]


# -- input items ----------------------------------------------------------------------------------


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages (the order kept; function calls of one turn merged)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(
                    f"'{where}.role' must be user, system, developer or assistant", param=f"{where}.role"
                )
            content = _text_of(item.get("content"), f"{where}.content", images=role == "user")
            message: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": content}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not (isinstance(call_id, str) and isinstance(name, str) and isinstance(arguments, str)):
                raise InvalidRequest(
                    f"'{where}': a function_call needs string call_id, name and arguments", param=where
                )
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                messages.append(last)
            namespace = item.get("namespace")
            if isinstance(namespace, str) and namespace:  # a call of a namespaced tool: the name the model saw
                name = compat.flat_name(namespace, name)
            last.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            )
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise InvalidRequest(f"'{where}.call_id' must be a string", param=f"{where}.call_id")
            text = _text_of(output, f"{where}.output", images=False)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            reasoning = (reasoning or "") + _reasoning_text(item)
        elif kind == "additional_tools":
            continue  # tools, not a turn: served with the request's own (``_tools_and_choice``)
        else:
            raise InvalidRequest(
                f"'{where}': input item type {kind!r} is not served "
                "(messages, function_call, function_call_output and reasoning are)",
                param=where,
            )
    return messages


def _text_of(content: Any, where: str, *, images: bool) -> str | list[dict[str, Any]]:
    """A message's content: one string when all parts are text (what chat templates render best)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}' must be a string or an array of content parts", param=where)
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = part.get("refusal") if kind == "refusal" else part.get("text")
            if not isinstance(text, str):
                raise InvalidRequest(f"'{where}[{i}].text' must be a string", param=f"{where}[{i}]")
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and images:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequest(
                    f"'{where}[{i}]': only images given by 'image_url' are served", param=f"{where}[{i}]"
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise InvalidRequest(f"'{where}[{i}]': content part type {kind!r} is not served", param=f"{where}[{i}]")
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _reasoning_text(item: dict[str, Any]) -> str:
    """The reasoning an item carries back: our own encrypted content, else its text or summary."""
    text = unsealed(item.get("encrypted_content"))
    if text is not None:
        return text
    parts = item.get("content") or item.get("summary") or []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict))


# -- tools ----------------------------------------------------------------------------------------


def _tools_and_choice(request: ResponsesRequest, chat: dict[str, Any], ledger: Ledger) -> dict[str, tuple[str, str]]:
    """``tools`` and ``tool_choice``; "auto" or "none" over tools that were all dropped is left out."""
    names: dict[str, tuple[str, str]] = {}
    offered = [(f"tools[{i}]", tool) for i, tool in enumerate(request.tools or ())]
    for i, item in enumerate(request.input if isinstance(request.input, list) else ()):
        if item.get("type") == "additional_tools":  # Codex sends its tools so for a model it knows
            more = item.get("tools")
            if not isinstance(more, list) or not all(isinstance(t, dict) for t in more):
                raise InvalidRequest(f"'input[{i}].tools' must be an array of tools", param=f"input[{i}].tools")
            for key, value in item.items():
                if key not in ("type", "id", "role", "tools"):
                    ledger.unknown(key, value, where=f"input[{i}].{key}")
            ledger.map(
                "input.additional_tools",
                "tools sent as an input item: served as the request's tools",
                where=f"input[{i}]",
            )
            offered += [(f"input[{i}].tools[{j}]", tool) for j, tool in enumerate(more)]
    if offered:
        tools, names = _tools(offered, ledger)
        if tools:
            chat["tools"] = tools
    if request.tool_choice is not None:
        if not offered and request.tool_choice != "none":
            raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
        if "tools" in chat or request.tool_choice not in ("auto", "none"):
            chat["tool_choice"] = _tool_choice(request.tool_choice)
    return names


def _tools(
    tools: list[tuple[str, dict[str, Any]]], ledger: Ledger
) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """Chat's function tools from (place, tool) pairs, and the flattened name of each namespaced one
    -> (namespace, name)."""
    out: list[dict[str, Any] | None] = []
    names: dict[str, tuple[str, str]] = {}
    for where, tool in tools:
        kind = tool.get("type")
        if kind == "function":
            out.append(_function(tool, where, ledger))
        elif kind == "namespace":
            namespace, members = compat.namespace_members(tool, where, ledger)
            for j, member in enumerate(members):
                flat = compat.flat_name(namespace, str(member.get("name")))
                out.append(_function(member, f"{where}.tools[{j}]", ledger, flat))
                names[flat] = (namespace, member["name"])
        else:
            message = (
                f"'{where}': tool type {kind!r} is not served; only function tools are "
                "(hosted tools run on OpenAI's servers)"
            )
            if not isinstance(kind, str) or kind in compat.CLIENT_TOOLS:
                raise InvalidRequest(message, param=f"{where}.type")
            ledger.hosted(kind, where=f"{where}.type", message=message)
    served = [t for t in out if t is not None]
    seen = [t["function"]["name"] for t in served]
    if len(set(seen)) != len(seen):
        raise InvalidRequest("'tools': two tools have the same name once namespaces are flattened", param="tools")
    return served, names


def _function(tool: dict[str, Any], where: str, ledger: Ledger, name: str | None = None) -> dict[str, Any] | None:
    """A function tool as chat's; None for a deferred one (``compat.deferred``)."""
    if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise InvalidRequest(f"'{where}.name' is required", param=f"{where}.name")
    function: dict[str, Any] = {"name": name or tool["name"]}
    for key, value in tool.items():
        if key in ("description", "parameters", "strict") and value is not None:
            function[key] = value
        elif key == "defer_loading" and value:
            compat.deferred(f"{where}.defer_loading", ledger)
            return None
        elif key not in ("type", "name", "description", "parameters", "strict", "defer_loading"):
            ledger.unknown(key, value, where=f"{where}.{key}")
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise InvalidRequest("'tool_choice' must be auto, none, required or a function", param="tool_choice")
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequest(
        f"'tool_choice' of type {choice.get('type')!r} is not served; "
        "use auto, none, required or {type: function, name}",
        param="tool_choice",
    )


def _response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    spec = text.get("format")
    if spec is None or spec.get("type") == "text":
        return None
    if spec.get("type") == "json_object":
        return {"type": "json_object"}
    if spec.get("type") == "json_schema":
        if not isinstance(spec.get("schema"), dict):
            raise InvalidRequest("'text.format.schema' is required for json_schema", param="text.format.schema")
        schema = {"name": spec.get("name") or "response", "schema": spec["schema"]}
        if spec.get("strict") is not None:
            schema["strict"] = spec["strict"]
        return {"type": "json_schema", "json_schema": schema}
    raise InvalidRequest(f"'text.format.type' {spec.get('type')!r} is not served", param="text.format.type")
