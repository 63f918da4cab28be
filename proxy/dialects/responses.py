"""The OpenAI Responses API (``POST /v1/responses``) as chat completions.

Request: ``instructions`` become the leading system message; ``input`` (a string, or items:
messages, ``function_call``, ``function_call_output``, ``reasoning``) becomes chat messages, a
run of ``function_call`` items one assistant turn with ``tool_calls`` (so a turn passed back
repeats the recorded choice and the proxy splices its sampled ids, ``proxy/splice.py``);
function tools, ``tool_choice``, ``text.format`` (JSON schema), ``max_output_tokens`` and the
sampling fields map one to one. ``previous_response_id`` is resolved by the route from the store
(``history``): that call's chat messages without its instructions (the API does not carry
instructions over) and its answer.

Answer: output items (``reasoning``, ``message`` with ``output_text``, ``function_call``), the
status (``incomplete`` with ``max_output_tokens`` when vLLM stopped on length) and usage. A
stream is the documented event sequence, ``sequence_number`` counting from 0, ending with
``response.completed`` (or ``response.incomplete``) once the record committed.

Every field the translation does not use gets its rule from ``proxy/compat.py`` (accepted
without effect and echoed, served another way, or refused with a 400 naming it): client
metadata, cache keys, effort and summary hints, hosted tools (dropped or refused), ``namespace``
tool groups (flattened into functions named ``<namespace>__<name>``, their calls named back in
the answer), ``background``, ``conversation``, ``prompt`` templates, ``max_tool_calls``, and any
field unknown here, by kind. Refused here: ``truncation: auto``, ``include`` values other than
``message.output_text.logprobs`` and ``reasoning.encrypted_content``, input items that need
server state (``item_reference``). ``store: false`` answers as usual and is recorded for
training like any call (that is the proxy's job), but its id is then refused as a
``previous_response_id``.
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from contract.vocabulary import CallApi
from proxy import compat
from proxy.compat import Ledger
from proxy.errors import FlywheelError, InvalidRequest
from proxy.store.records import CallRecord

INCLUDABLE = frozenset({"message.output_text.logprobs", "reasoning.encrypted_content"})
_ENCRYPTED_PREFIX = "flywheel:"


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


# -- request ---------------------------------------------------------------------------------


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
    encrypted = item.get("encrypted_content")
    if isinstance(encrypted, str) and encrypted.startswith(_ENCRYPTED_PREFIX):
        return base64.b64decode(encrypted[len(_ENCRYPTED_PREFIX) :]).decode()
    parts = item.get("content") or item.get("summary") or []
    return "".join(p.get("text", "") for p in parts if isinstance(p, dict))


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
        else:
            raise InvalidRequest(
                f"'{where}': input item type {kind!r} is not served "
                "(messages, function_call, function_call_output and reasoning are)",
                param=where,
            )
    return messages


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


def _tools(tools: list[dict[str, Any]], ledger: Ledger) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """Chat's function tools, and the flattened name of each namespaced one -> (namespace, name)."""
    out: list[dict[str, Any] | None] = []
    names: dict[str, tuple[str, str]] = {}
    for i, tool in enumerate(tools):
        kind, where = tool.get("type"), f"tools[{i}]"
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


# -- answer ----------------------------------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {}
    prompt, completion = usage.get("prompt_tokens") or 0, usage.get("completion_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _logprobs(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "token": x.get("token", ""),
            "logprob": x["logprob"],
            "bytes": x.get("bytes") or [],
            "top_logprobs": [
                {"token": t.get("token", ""), "logprob": t["logprob"], "bytes": t.get("bytes") or []}
                for t in x.get("top_logprobs") or ()
            ],
        }
        for x in items
    ]


def _text_logprobs(items: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The sampled tokens' log-probs that spell ``text`` (a tool call's tokens follow it)."""
    out, length = [], 0
    for item in items:
        if length >= len(text):
            break
        out.append(item)
        length += len(item.get("token", ""))
    return _logprobs(out)


class ResponsesTranslation:
    """One Responses request as a chat completions request, and its answer back."""

    api: CallApi = "responses"

    def __init__(
        self,
        request: ResponsesRequest,
        body: dict[str, Any],
        history: list[dict[str, Any]],
        ledger: Ledger | None = None,
    ) -> None:
        self.request = request
        self.ledger = ledger or Ledger()
        """What ``proxy/compat.py`` decided (``parse`` and the tools): the call's ``notes.compat``."""
        self.names: dict[str, tuple[str, str]] = {}
        """Flattened tool name -> (namespace, name), to name the answer's calls back."""
        self.client_request = body
        self.response_id = _id("resp")
        self.created_at = int(time.time())
        include = set(request.include or ())
        self.logprobs = "message.output_text.logprobs" in include
        self.encrypted = "reasoning.encrypted_content" in include
        messages: list[dict[str, Any]] = []
        if request.instructions is not None:
            messages.append({"role": "system", "content": request.instructions})
        messages.extend(history)
        messages.extend(input_messages(request.input))
        if not messages:
            raise InvalidRequest("'input' is empty", param="input")
        chat: dict[str, Any] = {"model": request.model, "messages": messages}
        self._tools(request, chat)
        if request.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = request.parallel_tool_calls
        for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p")):
            if (value := getattr(request, src)) is not None:
                chat[dst] = value
        if self.logprobs:
            chat["logprobs"] = True
            if request.top_logprobs:
                chat["top_logprobs"] = request.top_logprobs
        if request.text and (fmt := _response_format(request.text)) is not None:
            chat["response_format"] = fmt
        if request.stream:
            chat["stream"] = True
            chat["stream_options"] = {"include_usage": True}
        self.chat = chat | self.ledger.chat
        self.compat = self.ledger.note()

    def _tools(self, request: ResponsesRequest, chat: dict[str, Any]) -> None:
        """``tools`` and ``tool_choice``; "auto" or "none" over tools that were all dropped is left out."""
        if request.tools:
            tools, self.names = _tools(request.tools, self.ledger)
            if tools:
                chat["tools"] = tools
        if request.tool_choice is not None:
            if not request.tools and request.tool_choice != "none":
                raise InvalidRequest("'tool_choice' needs 'tools'", param="tool_choice")
            if "tools" in chat or request.tool_choice not in ("auto", "none"):
                chat["tool_choice"] = _tool_choice(request.tool_choice)

    # the Response object --------------------------------------------------------------------

    def envelope(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None, incomplete: bool = False
    ) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status in ("completed", "incomplete") else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.instructions,
            "model": r.model,
            "output": output,
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "top_logprobs": r.top_logprobs,
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": r.tools or [],
            "text": r.text or {"format": {"type": "text"}},
            "reasoning": r.reasoning,
            "max_output_tokens": r.max_output_tokens,
            "previous_response_id": r.previous_response_id,
            "store": r.store if r.store is not None else True,
            "metadata": r.metadata or {},
            "user": r.user,
            "safety_identifier": r.safety_identifier,
            "prompt_cache_key": r.prompt_cache_key,
            "service_tier": r.service_tier or "default",
            "truncation": "disabled",
            "background": False,
            "usage": usage,
        }

    def reasoning_item(self, item_id: str, text: str, status: str) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": item_id,
            "type": "reasoning",
            "summary": [],
            "status": status,
            "content": [{"type": "reasoning_text", "text": text}],
        }
        if self.encrypted:
            item["encrypted_content"] = _ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()
        return item

    @staticmethod
    def message_item(item_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
        part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}

    def named(self, name: str) -> dict[str, str]:
        """A call's ``name`` as the client knows it, with its ``namespace`` when it had one."""
        if name in self.names:
            namespace, own = self.names[name]
            return {"name": own, "namespace": namespace}
        return {"name": name}

    def call_item(self, item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
        function = call.get("function") or {}
        return {
            "id": item_id,
            "type": "function_call",
            "call_id": call.get("id") or item_id,
            **self.named(function.get("name") or ""),
            "arguments": function.get("arguments") or "",
            "status": status,
        }

    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = (chat.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        incomplete = choice.get("finish_reason") == "length"
        status = "incomplete" if incomplete else "completed"
        output: list[dict[str, Any]] = []
        reasoning = message.get("reasoning_content") or message.get("reasoning")
        if reasoning:
            output.append(self.reasoning_item(_id("rs"), reasoning, status))
        text = message.get("content")
        if text:
            logprobs = None
            if self.logprobs:
                logprobs = _text_logprobs((choice.get("logprobs") or {}).get("content") or [], text)
            output.append(self.message_item(_id("msg"), text, status, logprobs))
        for call in message.get("tool_calls") or ():
            output.append(self.call_item(_id("fc"), call, "completed"))
        return self.envelope(status, output, _usage(chat.get("usage")), incomplete)

    def stream(self) -> ResponsesStream:
        return ResponsesStream(self)


def _event(kind: str, seq: int, payload: dict[str, Any]) -> bytes:
    return (
        b"event: "
        + kind.encode()
        + b"\ndata: "
        + orjson.dumps({"type": kind, "sequence_number": seq, **payload})
        + b"\n\n"
    )


class ResponsesStream:
    """Chat chunks in, Responses events out: one open output item at a time, in arrival order."""

    def __init__(self, translation: ResponsesTranslation) -> None:
        self.t = translation
        self.seq = 0
        self.started = False
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.open_kind: str | None = None  # reasoning | message | call
        self.open_call: int | None = None  # the chat tool-call index of the open function_call
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def _emit(self, out: list[bytes], kind: str, **payload: Any) -> None:
        out.append(_event(kind, self.seq, payload))
        self.seq += 1

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        out: list[bytes] = []
        if not self.started:
            self.started = True
            skeleton = self.t.envelope("in_progress", [], None)
            self._emit(out, "response.created", response=skeleton)
            self._emit(out, "response.in_progress", response=skeleton)
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self._open(out, "reasoning")
                self.text.append(reasoning)
                self._emit(
                    out,
                    "response.reasoning_text.delta",
                    item_id=self._item_id(),
                    output_index=self._index(),
                    content_index=0,
                    delta=reasoning,
                )
            if delta.get("content"):
                self._open(out, "message")
                logprobs = _logprobs((choice.get("logprobs") or {}).get("content") or []) if self.t.logprobs else []
                self.text.append(delta["content"])
                self.logprobs.extend(logprobs)
                self._emit(
                    out,
                    "response.output_text.delta",
                    item_id=self._item_id(),
                    output_index=self._index(),
                    content_index=0,
                    delta=delta["content"],
                    logprobs=logprobs,
                )
            for fragment in delta.get("tool_calls") or ():
                index = fragment.get("index", 0)
                if self.open_kind != "call" or self.open_call != index:
                    self._open(out, "call", fragment)
                    self.open_call = index
                function = fragment.get("function") or {}
                assert self.open is not None
                if function.get("name") and not self.open["name"]:  # a server that names the call late
                    self.open.update(self.t.named(function["name"]))
                if function.get("arguments"):
                    self.text.append(function["arguments"])
                    self._emit(
                        out,
                        "response.function_call_arguments.delta",
                        item_id=self._item_id(),
                        output_index=self._index(),
                        delta=function["arguments"],
                    )
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return b"".join(out)

    def _item_id(self) -> str:
        assert self.open is not None
        item_id: str = self.open["id"]
        return item_id

    def _index(self) -> int:
        return len(self.output)

    def _open(self, out: list[bytes], kind: str, fragment: dict[str, Any] | None = None) -> None:
        if self.open_kind == kind and kind != "call":
            return
        self._close(out)
        self.open_kind = kind
        if kind == "reasoning":
            self.open = self.t.reasoning_item(_id("rs"), "", "in_progress")
            self.open["content"] = []
            self._emit(out, "response.output_item.added", output_index=self._index(), item=self.open)
            self._emit(
                out,
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=self._index(),
                content_index=0,
                part={"type": "reasoning_text", "text": ""},
            )
        elif kind == "message":
            self.open = self.t.message_item(_id("msg"), "", "in_progress", None)
            self.open["content"] = []
            self._emit(out, "response.output_item.added", output_index=self._index(), item=self.open)
            self._emit(
                out,
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=self._index(),
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        else:
            assert fragment is not None
            self.open = self.t.call_item(
                _id("fc"),
                {"id": fragment.get("id"), "function": {"name": (fragment.get("function") or {}).get("name")}},
                "in_progress",
            )
            self._emit(out, "response.output_item.added", output_index=self._index(), item=self.open)

    def _close(self, out: list[bytes]) -> None:
        """Finish the open item: its done events, then it joins the output."""
        if self.open is None:
            return
        item_id, index, text = self.open["id"], self._index(), "".join(self.text)
        status = "incomplete" if self.finish_reason == "length" else "completed"
        if self.open_kind == "reasoning":
            self._emit(
                out, "response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0, text=text
            )
            self._emit(
                out,
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part={"type": "reasoning_text", "text": text},
            )
            item = self.t.reasoning_item(item_id, text, status)
        elif self.open_kind == "message":
            logprobs = self.logprobs if self.t.logprobs else []
            self._emit(
                out,
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=logprobs,
            )
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
            self._emit(
                out, "response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part
            )
            item = self.t.message_item(item_id, text, status, logprobs if self.t.logprobs else None)
        else:
            self._emit(
                out,
                "response.function_call_arguments.done",
                item_id=item_id,
                output_index=index,
                name=self.open["name"],
                arguments=text,
            )
            item = {**self.open, "arguments": text, "status": "completed"}
        self._emit(out, "response.output_item.done", output_index=index, item=item)
        self.output.append(item)
        self.open, self.open_kind, self.open_call, self.text, self.logprobs = None, None, None, [], []

    def done(self) -> bytes:
        out: list[bytes] = []
        self._close(out)
        incomplete = self.finish_reason == "length"
        final = self.t.envelope(
            "incomplete" if incomplete else "completed", self.output, _usage(self.usage), incomplete
        )
        self._emit(out, "response.incomplete" if incomplete else "response.completed", response=final)
        return b"".join(out)

    def error(self, error: FlywheelError) -> bytes:
        return _event(
            "error", self.seq, {"code": error.code or error.type, "message": error.message, "param": error.param}
        )
