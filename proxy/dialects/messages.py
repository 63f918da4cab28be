"""The Anthropic Messages API (``POST /v1/messages``) served as chat completions.

An agent on the ``anthropic`` SDK (``messages.create`` / ``messages.stream``) sends Messages
requests; they are validated, translated to one chat completions body for vLLM, and the chat
answer (or its chunks) is translated back into a Messages ``Message`` (or its server-sent events).

    system (str | text blocks)        -> a leading system message (blocks joined with "\\n")
    user text / image blocks          -> a user message (one string unless images are present)
    user tool_result blocks           -> tool messages, placed before the user's own text
    assistant text / tool_use         -> content (joined with "\\n") / tool_calls
    assistant thinking                -> reasoning_content (what vLLM's chat templates read)
    tools / tool_choice               -> function tools / "auto", "required", a named function, "none"
    stop_sequences, sampling, stream  -> stop, temperature / top_p / top_k, stream + include_usage

Choices this file makes where the Messages API and chat completions differ:

- Tool-use ``input`` becomes arguments text with orjson (compact, UTF-8 kept; ``json.dumps`` only
  for integers beyond 64 bits): the text's layout changes nothing, since vLLM parses arguments back
  into an object before the chat template renders them, and the splicer compares parsed JSON.
  orjson is an order of magnitude faster than ``json.dumps`` here, on the proxy's hot path.
- Tool-call arguments the model sampled that are not a JSON object (malformed, or an array) are
  answered as ``input: {"_raw_arguments": <text>}``: the agent's tool sees a call it cannot run and
  answers with an error the model can learn from, instead of a silent ``{}`` or a failed request.
  Passed back in a later turn, such an input becomes the raw text again, so the history the
  engine reads (and the splicer matches) is the text that was sampled. Empty arguments are ``{}``.
- A ``tool_result`` with ``is_error: true`` has its text prefixed with ``"Error: "``: a chat tool
  message has no error flag, and the model should still be told that the tool failed.
- Every field the translation does not use (``metadata``, ``cache_control``, ``thinking``,
  ``context_management``, ``output_config``, a ``system`` message inside ``messages``, deferred
  and hosted tools, and any field unknown here) gets its rule from ``proxy/compat.py``: accepted
  without effect, served another way, or refused with a 400 naming it; ``tool_choice: {"type":
  "none"}`` without tools is dropped (nothing to choose from).

Streamed tool calls are sent whole (start, one ``input_json_delta``, stop) once the choice
finishes: their arguments must be checked before the client's SDK parses them, and the events then
assemble into exactly the ``Message`` the non-streamed answer gives.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar
from uuid import uuid4

import orjson
from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError

from contract.vocabulary import CallApi
from proxy import compat
from proxy.compat import Ledger
from proxy.errors import (
    AuthenticationFailed,
    Conflict,
    FlywheelError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ServiceUnavailable,
    TooManyRequests,
    UpstreamError,
    UpstreamNotSynced,
    UpstreamTimeout,
)
from proxy.settings import CompatSettings

RAW_ARGUMENTS = "_raw_arguments"
"""The key of a tool_use ``input`` that carries arguments text which is not a JSON object."""


# -- request models -----------------------------------------------------------------------------
# Shapes and scalars are checked by pydantic; content blocks and tools are checked one by one by
# their ``type`` (``_check``), so a refusal names the block's type and its exact place.


def _content(value: Any) -> str | list[dict[str, Any]]:
    """A content field as sent (no copy): a string, or an array of block objects."""
    if isinstance(value, str) or (isinstance(value, list) and all(type(b) is dict for b in value)):
        return value
    raise ValueError("must be a string or an array of content blocks (objects)")


def _objects(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, list) and all(type(b) is dict for b in value):
        return value
    raise ValueError("must be an array of objects")


Content = Annotated[str | list[dict[str, Any]], PlainValidator(_content)]
Objects = Annotated[list[dict[str, Any]], PlainValidator(_objects)]
Ignored = Any
"""A field accepted for compatibility and not used."""
_M = TypeVar("_M", bound="_Model")


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras get their rule from ``compat`` (``Ledger.screen``)


class _Text(_Model):
    type: Literal["text"]
    text: str
    cache_control: Ignored = None
    citations: Ignored = None


class _Image(_Model):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: Ignored = None


class _Base64Source(_Model):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class _UrlSource(_Model):
    type: Literal["url"]
    url: str = Field(min_length=1)


class _ToolResult(_Model):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Content = ""
    is_error: bool = False
    cache_control: Ignored = None


class _ToolUse(_Model):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: Ignored = None
    caller: dict[str, Any] | None = None
    """Who made the call; SDKs pass back ``{"type": "direct"}`` or null (the model itself)."""
    toolset_name: None = None


class _Thinking(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: Ignored = None


class _Tool(_Model):
    name: str = Field(min_length=1)
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    """Schema-valid inputs: vLLM (0.32) pins a tool's arguments to its schema only for ``strict`` tools."""
    cache_control: Ignored = None
    eager_input_streaming: Ignored = None
    defer_loading: bool | None = None


class _ToolChoice(_Model):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, min_length=1)
    disable_parallel_tool_use: bool = False


class _Message(_Model):
    role: Literal["user", "assistant", "system"]
    content: Content


class _Conversation(_Model):
    """What both ``/v1/messages`` and ``/v1/messages/count_tokens`` take."""

    model: str = Field(min_length=1)
    messages: list[_Message]
    system: Content | None = None
    tools: Objects | None = None
    tool_choice: _ToolChoice | None = None


class _Create(_Conversation):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False


# -- validation errors --------------------------------------------------------------------------


def _invalid(error: ValidationError, prefix: str = "") -> InvalidRequest:
    """The first pydantic error as a 400 whose ``param`` is its dotted location."""
    first = error.errors(include_url=False)[0]
    loc = ".".join(str(part) for part in first["loc"])
    param = f"{prefix}.{loc}" if prefix and loc else (prefix or loc or None)
    kind = first["type"]
    if kind == "extra_forbidden":
        what = "parameter" if "." not in (param or "") else "field"
        return InvalidRequest(f"unknown {what} '{param}'", param=param)
    if kind == "missing":
        return InvalidRequest(f"'{param}' is required", param=param)
    message = str(first["ctx"]["error"]) if kind == "value_error" else first["msg"]
    got = first.get("input")
    if isinstance(got, str | int | float | bool) and len(repr(got)) <= 60 and kind != "value_error":
        message = f"{message} (got {got!r})"
    return InvalidRequest(f"{param}: {message}" if param else message, param=param)


def _check(model: type[_M], data: dict[str, Any], where: str, ledger: Ledger) -> _M:
    try:
        checked = model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, where) from None
    ledger.screen(checked, where)
    return checked


# -- request translation ------------------------------------------------------------------------


def _text_of(content: str | list[dict[str, Any]], where: str, what: str, ledger: Ledger) -> str:
    """Text-only content (system, tool_result) as one string, blocks joined with "\\n"."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        kind = block.get("type")
        if kind != "text":
            raise InvalidRequest(f"{what} takes only text blocks, not {kind!r}", param=f"{where}.{j}.type")
        texts.append(_check(_Text, block, f"{where}.{j}", ledger).text)
    return "\n".join(texts)


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


def _image_url(block: dict[str, Any], where: str, ledger: Ledger) -> str:
    source = _check(_Image, block, where, ledger).source
    kind = source.get("type")
    if kind == "base64":
        b64 = _check(_Base64Source, source, f"{where}.source", ledger)
        return f"data:{b64.media_type};base64,{b64.data}"
    if kind == "url":
        return _check(_UrlSource, source, f"{where}.source", ledger).url
    if kind == "file":
        raise InvalidRequest(
            "image sources from the Files API are not served; send base64 data or a url", param=f"{where}.source.type"
        )
    raise InvalidRequest(f"image source type {kind!r} is not accepted (base64 or url)", param=f"{where}.source.type")


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
            parts.append({"type": "text", "text": _check(_Text, block, at, ledger).text})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at, ledger)}})
            images = True
        elif kind == "tool_result":
            result = _check(_ToolResult, block, at, ledger)
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


def _arguments(tool_input: dict[str, Any]) -> str:
    raw = tool_input.get(RAW_ARGUMENTS)
    if len(tool_input) == 1 and isinstance(raw, str):
        return raw  # our own answer to arguments that were not a JSON object: the sampled text again
    try:
        return orjson.dumps(tool_input).decode()
    except TypeError:  # an integer beyond 64 bits, which orjson does not write
        return json.dumps(tool_input, ensure_ascii=False)


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
            texts.append(_check(_Text, block, at, ledger).text)
        elif kind == "tool_use":
            use = _check(_ToolUse, block, at, ledger)
            if use.caller is not None and use.caller.get("type") != "direct":
                raise InvalidRequest(
                    f"{at}.caller: tool calls made by server tools are not served", param=f"{at}.caller"
                )
            calls.append(
                {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": _arguments(use.input)}}
            )
        elif kind == "thinking":
            reasoning.append(_check(_Thinking, block, at, ledger).thinking)
        else:
            raise _unserved(kind, "assistant", at)
    text = "\n".join(texts)
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "\n".join(reasoning)
    return message


def _messages(req: _Conversation, ledger: Ledger) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        system = _text_of(req.system, "system", "system", ledger)
        if system:
            out.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        where = f"messages.{i}"
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
        tool = _check(_Tool, item, f"tools.{k}", ledger)
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


def _conversation(req: _Conversation, ledger: Ledger) -> dict[str, Any]:
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


def _validated(model: type[_M], body: dict[str, Any], ledger: Ledger) -> _M:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    compat.messages_top(req.model_extra or {}, body, ledger)
    return req


def count_tokens_chat(body: dict[str, Any], settings: CompatSettings | None = None) -> dict[str, Any]:
    """The chat-shaped body (``model``, ``messages``, ``tools`` if any) whose prompt a
    ``/v1/messages/count_tokens`` request counts; ``InvalidRequest`` on what ``/v1/messages`` refuses."""
    ledger = Ledger(settings)
    chat = _conversation(_validated(_Conversation, body, ledger), ledger) | ledger.chat
    chat.pop("tool_choice", None)
    chat.pop("parallel_tool_calls", None)
    return chat


# -- answers ------------------------------------------------------------------------------------


def _parsed(arguments: str) -> dict[str, Any] | None:
    """Arguments text as a JSON object (``{}`` for no text), or None when it is not one."""
    if not arguments:
        return {}
    try:
        parsed = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _tool_input(arguments: Any) -> dict[str, Any]:
    """Parsed arguments; text that is not a JSON object is kept whole under ``_raw_arguments``."""
    if isinstance(arguments, dict):
        return arguments
    text = arguments if isinstance(arguments, str) else ("" if arguments is None else str(arguments))
    parsed = _parsed(text)
    return {RAW_ARGUMENTS: text} if parsed is None else parsed


def _tool_id() -> str:
    return "toolu_" + uuid4().hex


class MessagesTranslation:
    """A validated Messages request and the chat body that runs it."""

    api: CallApi = "messages"

    __slots__ = ("client_request", "chat", "response_id", "model", "stop_sequences", "ledger", "compat")

    def __init__(
        self,
        client_request: dict[str, Any],
        chat: dict[str, Any],
        model: str,
        stop_sequences: tuple[str, ...],
        ledger: Ledger,
    ) -> None:
        self.client_request = client_request
        self.chat = chat
        self.response_id = "msg_" + uuid4().hex
        self.model = model
        """The model name the client asked for: the one its answers carry."""
        self.stop_sequences = stop_sequences
        self.ledger = ledger
        """What ``proxy/compat.py`` decided about the fields the translation does not use."""
        self.compat = ledger.note()

    @classmethod
    def from_request(cls, body: dict[str, Any], settings: CompatSettings | None = None) -> MessagesTranslation:
        """Validate and translate; ``InvalidRequest`` (with ``param``) for anything not served."""
        ledger = Ledger(settings)
        req = _validated(_Create, body, ledger)
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
        return cls(body, chat, req.model, tuple(req.stop_sequences or ()), ledger)

    def stop(self, finish_reason: Any, matched: Any, tool_use: bool) -> tuple[str, str | None]:
        """``stop_reason`` and ``stop_sequence`` from vLLM's ``finish_reason`` and ``stop_reason``."""
        if tool_use:
            return "tool_use", None
        if finish_reason == "length":
            return "max_tokens", None
        if finish_reason == "stop" and isinstance(matched, str) and matched in self.stop_sequences:
            return "stop_sequence", matched
        return "end_turn", None

    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The ``Message`` for vLLM's non-streamed chat completion (which is not modified)."""
        choices = chat.get("choices")
        if not choices:
            raise UpstreamError("the engine's answer has no choices")
        choice = choices[0]
        message = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        text = message.get("content")
        if text:
            content.append({"type": "text", "text": text})
        calls = message.get("tool_calls") or ()
        for call in calls:
            function = call.get("function") or {}
            content.append(
                {
                    "type": "tool_use",
                    "id": call.get("id") or _tool_id(),
                    "name": function.get("name") or "",
                    "input": _tool_input(function.get("arguments")),
                }
            )
        stop_reason, stop_sequence = self.stop(choice.get("finish_reason"), choice.get("stop_reason"), bool(calls))
        usage = chat.get("usage") or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        return {
            "id": self.response_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {
                "input_tokens": prompt if type(prompt) is int else len(chat.get("prompt_token_ids") or ()),
                "output_tokens": completion if type(completion) is int else len(choice.get("token_ids") or ()),
            },
        }

    def stream(self) -> MessagesStream:
        return MessagesStream(self)


# -- streaming ----------------------------------------------------------------------------------


def _sse(name: bytes, data: dict[str, Any]) -> bytes:
    return b"event: " + name + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class _Call:
    """One streamed tool call, gathered until the choice finishes."""

    __slots__ = ("id", "name", "arguments")

    def __init__(self) -> None:
        self.id: str | None = None
        self.name = ""
        self.arguments: list[str] = []


class MessagesStream:
    """vLLM chat chunks in, Messages events out.

    Thinking and text blocks are streamed as their deltas arrive (a block closes when the other
    kind starts); tool_use blocks follow, each whole, when the choice finishes. ``message_delta``
    (stop reason, output tokens) and ``message_stop`` come from ``done``.
    """

    __slots__ = (
        "_t",
        "_started",
        "_index",
        "_open",
        "_calls",
        "_tool_use",
        "_finish",
        "_matched",
        "_prompt",
        "_completion",
    )

    def __init__(self, translation: MessagesTranslation) -> None:
        self._t = translation
        self._started = False
        self._index = -1
        self._open: Literal["text", "thinking"] | None = None  # the block that takes deltas
        self._calls: dict[int, _Call] | None = {}  # None once sent, at the finish
        self._tool_use = False
        self._finish: Any = None
        self._matched: Any = None
        self._prompt: int | None = None
        self._completion: int | None = None

    def _start(self, chunk: dict[str, Any] | None) -> bytes:
        self._started = True
        ids = chunk.get("prompt_token_ids") if chunk else None
        message: dict[str, Any] = {
            "id": self._t.response_id,
            "type": "message",
            "role": "assistant",
            "model": self._t.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(ids) if ids else 0, "output_tokens": 0},
        }
        return _sse(b"message_start", {"type": "message_start", "message": message})

    def _close(self, out: list[bytes]) -> None:
        if self._open is not None:
            out.append(_sse(b"content_block_stop", {"type": "content_block_stop", "index": self._index}))
            self._open = None

    def _block(self, block: dict[str, Any], out: list[bytes]) -> None:
        self._index += 1
        out.append(
            _sse(b"content_block_start", {"type": "content_block_start", "index": self._index, "content_block": block})
        )

    def _delta(self, kind: Literal["text", "thinking"], text: str, out: list[bytes]) -> None:
        if self._open != kind:
            self._close(out)
            self._open = kind
            self._block(
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""},
                out,
            )
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        out.append(_sse(b"content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}))

    def _merge(self, fragment: dict[str, Any]) -> None:
        if self._calls is None:
            return  # after the finish: vLLM sends nothing more for a choice
        index = fragment.get("index", 0)
        call = self._calls.get(index)
        if call is None:
            call = self._calls[index] = _Call()
        if fragment.get("id"):
            call.id = fragment["id"]
        function = fragment.get("function") or {}
        if function.get("name"):
            call.name += function["name"]
        if function.get("arguments"):
            call.arguments.append(function["arguments"])

    def _send_calls(self, out: list[bytes]) -> None:
        calls, self._calls = self._calls, None
        if not calls:
            return
        self._close(out)
        self._tool_use = True
        for i in sorted(calls):
            call = calls[i]
            self._block({"type": "tool_use", "id": call.id or _tool_id(), "name": call.name, "input": {}}, out)
            text = "".join(call.arguments)
            parsed = _parsed(text)
            partial = orjson.dumps({RAW_ARGUMENTS: text}).decode() if parsed is None else text if parsed else ""
            if partial:
                delta = {"type": "input_json_delta", "partial_json": partial}
                out.append(
                    _sse(b"content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta})
                )
            out.append(_sse(b"content_block_stop", {"type": "content_block_stop", "index": self._index}))

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if not self._started:
            out.append(self._start(chunk))
        usage = chunk.get("usage")
        if usage:
            self._prompt = usage.get("prompt_tokens")
            self._completion = usage.get("completion_tokens")
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self._delta("thinking", reasoning, out)
            text = delta.get("content")
            if text:
                self._delta("text", text, out)
            for fragment in delta.get("tool_calls") or ():
                self._merge(fragment)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]
                self._matched = choice.get("stop_reason")
                self._send_calls(out)
        return b"".join(out)

    def done(self) -> bytes:
        out: list[bytes] = []
        if not self._started:
            out.append(self._start(None))
        self._send_calls(out)
        self._close(out)
        stop_reason, stop_sequence = self._t.stop(self._finish, self._matched, self._tool_use)
        usage: dict[str, int] = {"output_tokens": self._completion if type(self._completion) is int else 0}
        if type(self._prompt) is int:
            usage["input_tokens"] = self._prompt
        out.append(
            _sse(
                b"message_delta",
                {
                    "type": "message_delta",
                    "usage": usage,
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                },
            )
        )
        out.append(b'event: message_stop\ndata: {"type":"message_stop"}\n\n')
        return b"".join(out)

    def error(self, error: FlywheelError) -> bytes:
        return _sse(b"error", error_body(error))


# -- errors -------------------------------------------------------------------------------------

_ERROR_TYPES: dict[type[FlywheelError], str] = {
    InvalidRequest: "invalid_request_error",
    AuthenticationFailed: "authentication_error",
    PermissionDenied: "permission_error",
    NotFound: "not_found_error",
    PayloadTooLarge: "request_too_large",  # Anthropic's documented 413 type
    Conflict: "invalid_request_error",  # Anthropic uses invalid_request_error for unlisted 4xx
    ServiceUnavailable: "overloaded_error",  # retryable: the SDK retries it as it does a 529
    UpstreamNotSynced: "overloaded_error",  # a 503 too: retry once the replica has its adapters back
    TooManyRequests: "rate_limit_error",
    UpstreamTimeout: "timeout_error",  # the SDK's GatewayTimeoutErrorObject (504)
}


def error_type(error: FlywheelError) -> str:
    """The Anthropic error ``type`` for a proxy error (the nearest mapped class; else ``api_error``)."""
    for cls in type(error).__mro__:
        found = _ERROR_TYPES.get(cls)
        if found is not None:
            return found
    return "api_error"


def error_body(error: FlywheelError) -> dict[str, Any]:
    """An error as the Messages API answers it: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(error), "message": error.message}}
