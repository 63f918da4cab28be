"""A validated Messages request as the chat completions body vLLM runs (the mapping: ``__init__.py``).

Blocks are checked one by one as they are translated (``schema.check``), so a refusal names the
block's type and its exact place; what the translation does not use gets its rule from
``proxy/compat.py``. ``count_tokens_chat`` serves ``/v1/messages/count_tokens`` with the same
translation, so it refuses exactly what ``/v1/messages`` refuses.
"""

from __future__ import annotations

from typing import Any

from proxy import compat
from proxy.compat import Ledger
from proxy.dialects.messages.arguments import arguments_text
from proxy.dialects.messages.schema import (
    Base64Source,
    Conversation,
    Create,
    Image,
    Text,
    Thinking,
    Tool,
    ToolResult,
    ToolUse,
    UrlSource,
    check,
    validated,
)
from proxy.errors import InvalidRequest
from proxy.settings import CompatSettings


def chat_body(req: Create, ledger: Ledger) -> dict[str, Any]:
    """The whole chat body of a ``/v1/messages`` request: its conversation, limits and sampling."""
    chat = _conversation(req, ledger) | ledger.chat
    chat["max_tokens"] = req.max_tokens
    if req.stop_sequences:
        chat["stop"] = req.stop_sequences
    if req.temperature is not None:
        chat["temperature"] = req.temperature
    if req.top_p is not None:
        chat["top_p"] = req.top_p
    if req.top_k is not None:
        chat["top_k"] = req.top_k
    if req.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def count_tokens_chat(body: dict[str, Any], settings: CompatSettings | None = None) -> dict[str, Any]:
    """The chat-shaped body (``model``, ``messages``, ``tools`` if any) whose prompt a
    ``/v1/messages/count_tokens`` request counts; ``InvalidRequest`` on what ``/v1/messages`` refuses."""
    ledger = Ledger(settings)
    chat = _conversation(validated(Conversation, body, ledger), ledger) | ledger.chat
    chat.pop("tool_choice", None)
    chat.pop("parallel_tool_calls", None)
    return chat


def _conversation(req: Conversation, ledger: Ledger) -> dict[str, Any]:
    """The chat body's ``model``, ``messages``, ``tools`` and ``tool_choice`` / ``parallel_tool_calls``."""
    if not req.messages:
        raise InvalidRequest("'messages' must contain at least one message", param="messages")
    chat: dict[str, Any] = {"model": req.model, "messages": _messages(req, ledger)}
    tools = _tools(req.tools, ledger) if req.tools else []
    if tools:
        chat["tools"] = tools
    choice = req.tool_choice
    if choice is None:
        return chat
    ledger.screen(choice, "tool_choice")
    if choice.name is not None and choice.type != "tool":
        raise InvalidRequest("tool_choice.name is only valid with type 'tool'", param="tool_choice.name")
    if not tools:
        if choice.type == "none":
            return chat
        raise InvalidRequest(f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequest("tool_choice type 'tool' needs a 'name'", param="tool_choice.name")
        if all(t["function"]["name"] != choice.name for t in tools):
            raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not in tools", param="tool_choice.name")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
    return chat


# -- messages -----------------------------------------------------------------------------------


def _messages(req: Conversation, ledger: Ledger) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        system = _text_of(req.system, "system", "system", ledger)
        if system:
            out.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
        extra = message.model_extra or {}
        if "output_config" in extra:  # the top level's rule, where it stands (screen would judge it unknown)
            compat.output_config(extra.pop("output_config"), f"{where}.output_config", ledger)
        ledger.screen(message, where)
        if message.role == "user":
            _user(message.content, f"{where}.content", out, ledger)
        elif message.role == "assistant":
            out.append(_assistant(message.content, f"{where}.content", ledger))
        else:
            text = _text_of(message.content, f"{where}.content", "a system message", ledger)
            compat.system_turn(out, text, f"{where}.role", ledger)
    compat.clear_thinking(out, ledger)
    return out


def _user(content: str | list[dict[str, Any]], where: str, out: list[dict[str, Any]], ledger: Ledger) -> None:
    """Append a user turn: its tool results first (as tool messages), then its text and images."""
    if isinstance(content, str):
        out.append({"role": "user", "content": content})
        return
    parts: list[dict[str, Any]] = []
    images = tools = False
    for j, block in enumerate(content):
        kind = block.get("type")
        at = f"{where}.{j}"
        if kind == "text":
            parts.append({"type": "text", "text": check(Text, block, at, ledger).text})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at, ledger)}})
            images = True
        elif kind == "tool_result":
            result = check(ToolResult, block, at, ledger)
            text = _text_of(result.content, f"{at}.content", "tool_result content", ledger)
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": result.tool_use_id,
                    "content": f"Error: {text}" if result.is_error else text,
                }
            )
            tools = True
        else:
            raise _unserved(kind, "user", at)
    if images:
        out.append({"role": "user", "content": parts})
    elif parts or not tools:
        out.append({"role": "user", "content": "\n".join(p["text"] for p in parts)})


def _assistant(content: str | list[dict[str, Any]], where: str, ledger: Ledger) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        kind = block.get("type")
        at = f"{where}.{j}"
        if kind == "text":
            texts.append(check(Text, block, at, ledger).text)
        elif kind == "tool_use":
            use = check(ToolUse, block, at, ledger)
            if use.caller is not None and use.caller.get("type") != "direct":
                raise InvalidRequest(
                    f"{at}.caller: tool calls made by server tools are not served", param=f"{at}.caller"
                )
            calls.append(
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": use.name, "arguments": arguments_text(use.input)},
                }
            )
        elif kind == "thinking":
            reasoning.append(check(Thinking, block, at, ledger).thinking)
        else:
            raise _unserved(kind, "assistant", at)
    text = "\n".join(texts)
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def _text_of(content: str | list[dict[str, Any]], where: str, what: str, ledger: Ledger) -> str:
    """Text-only content (system, tool_result) as one string, blocks joined with "\\n"."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind != "text":
            raise InvalidRequest(f"{what} takes only text blocks, not {kind!r}", param=f"{where}.{j}.type")
        texts.append(check(Text, block, f"{where}.{j}", ledger).text)
    return "\n".join(texts)


def _image_url(block: dict[str, Any], where: str, ledger: Ledger) -> str:
    source = check(Image, block, where, ledger).source
    kind = source.get("type")
    if kind == "base64":
        b64 = check(Base64Source, source, f"{where}.source", ledger)
        return f"data:{b64.media_type};base64,{b64.data}"
    if kind == "url":
        return check(UrlSource, source, f"{where}.source", ledger).url
    if kind == "file":
        raise InvalidRequest(
            "image sources from the Files API are not served; send base64 data or a url", param=f"{where}.source.type"
        )
    raise InvalidRequest(f"image source type {kind!r} is not accepted (base64 or url)", param=f"{where}.source.type")


def _unserved(kind: Any, role: str, where: str) -> InvalidRequest:
    if kind == "redacted_thinking":
        return InvalidRequest(
            "redacted_thinking blocks cannot be passed on: this engine has no encrypted "
            "reasoning to restore; drop them from the history",
            param=f"{where}.type",
        )
    accepted = "text, image and tool_result" if role == "user" else "text, tool_use and thinking"
    if kind is None:
        return InvalidRequest("a content block needs a 'type'", param=f"{where}.type")
    return InvalidRequest(
        f"content block type {kind!r} is not served in {role} messages by this deployment (accepted: {accepted})",
        param=f"{where}.type",
    )


# -- tools --------------------------------------------------------------------------------------


def _tools(raw: list[dict[str, Any]], ledger: Ledger) -> list[dict[str, Any]]:
    tools = []
    for k, item in enumerate(raw):
        kind = item.get("type")
        if kind is not None and kind != "custom":
            message = (
                f"built-in tool {kind!r} is not served by this deployment; define client tools "
                "(name, description, input_schema) and run them in the agent"
            )
            if not isinstance(kind, str) or kind.startswith(compat.CLIENT_BUILTINS):
                raise InvalidRequest(message, param=f"tools.{k}.type")
            ledger.hosted(kind, where=f"tools.{k}.type", message=message)
            continue
        tool = check(Tool, item, f"tools.{k}", ledger)
        if tool.defer_loading:
            compat.deferred(f"tools.{k}.defer_loading", ledger)
            continue
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema
        if tool.strict is not None:
            function["strict"] = tool.strict
        tools.append({"type": "function", "function": function})
    return tools
