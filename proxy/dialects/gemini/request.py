"""A validated Gemini request as the chat completions body vLLM runs (the mapping: ``__init__.py``).

Parts are checked one by one as they are translated (``schema.check``), so a refusal names the
part's field and its exact place; what the translation does not use gets its rule from
``proxy/compat.py``. ``count_tokens_chat`` serves ``:countTokens`` with the same translation, so it
refuses exactly what ``:generateContent`` refuses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from proxy import compat
from proxy.compat import Ledger
from proxy.dialects.gemini.schema import (
    DATA_FIELDS,
    Blob,
    Content,
    Conversation,
    CountTokens,
    FunctionCall,
    FunctionDeclaration,
    FunctionResponse,
    GenerateContent,
    GenerationConfig,
    Part,
    check,
    validated,
)
from proxy.dialects.messages.arguments import arguments_text
from proxy.errors import InvalidRequest
from proxy.settings import CompatSettings

JSON_MIME = "application/json"


@dataclass(frozen=True, slots=True)
class Asked:
    """What the client asked of the answer's shape, beyond the chat body."""

    thoughts: bool = False
    """``thinkingConfig.includeThoughts``: the model's reasoning as ``thought`` parts."""
    logprobs: bool = False
    """``responseLogprobs``: each candidate's ``logprobsResult``."""
    top_logprobs: int = 0
    """``logprobs``: how many top candidates per step."""
    stop_sequences: tuple[str, ...] = ()


def chat_body(req: GenerateContent, model: str, stream: bool, ledger: Ledger) -> tuple[dict[str, Any], Asked]:
    """The whole chat body of a ``generateContent`` request, and what its answer must show."""
    chat = _conversation(req, model, ledger)
    config = req.generation_config
    asked = _generation(config, chat, ledger) if config is not None else Asked()
    chat |= ledger.chat
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat, asked


def count_tokens_chat(body: dict[str, Any], model: str, settings: CompatSettings | None = None) -> dict[str, Any]:
    """The chat-shaped body (``model``, ``messages``, ``tools`` if any) whose prompt a ``:countTokens``
    request counts: its ``contents``, or its whole ``generateContentRequest``; ``InvalidRequest`` on
    what ``:generateContent`` refuses."""
    ledger = Ledger(settings)
    req = validated(CountTokens, body, ledger)
    if (req.contents is None) == (req.generate_content_request is None):
        raise InvalidRequest("countTokens takes either 'contents' or 'generateContentRequest'", param="contents")
    if req.generate_content_request is not None:
        inner = validated(GenerateContent, req.generate_content_request, ledger)
        chat = _conversation(inner, model, ledger)
    else:
        chat = _conversation(Conversation(contents=req.contents or []), model, ledger)
    chat.pop("tool_choice", None)
    return chat


# -- the conversation ---------------------------------------------------------------------------


def _conversation(req: Conversation, model: str, ledger: Ledger) -> dict[str, Any]:
    """The chat body's ``model``, ``messages``, ``tools`` and ``tool_choice``."""
    if not req.contents:
        raise InvalidRequest("'contents' must contain at least one content", param="contents")
    messages: list[dict[str, Any]] = []
    if req.system_instruction is not None:
        ledger.screen(req.system_instruction, "systemInstruction")
        system = _system(req.system_instruction, ledger)
        if system:
            messages.append({"role": "system", "content": system})
    _Turns(messages, ledger).read(req.contents)
    chat: dict[str, Any] = {"model": model, "messages": messages}
    tools = _tools(req.tools, ledger) if req.tools else []
    _tool_config(req, tools, chat, ledger)
    if tools:
        chat["tools"] = tools
    return chat


def _system(content: Content, ledger: Ledger) -> str:
    texts = []
    for j, raw in enumerate(content.parts):
        where = f"systemInstruction.parts.{j}"
        part = _part(raw, where, ledger)
        if part.text is None or part.thought:
            raise InvalidRequest("systemInstruction takes only text parts", param=where)
        texts.append(part.text)
    return "\n".join(texts)


def _part(raw: dict[str, Any], where: str, ledger: Ledger) -> Part:
    """One part, checked: exactly one data field, its thought signature accepted without effect."""
    part = check(Part, raw, where, ledger)
    present = [name for name in DATA_FIELDS if getattr(part, name) is not None]
    if len(present) != 1:
        what = "no data field" if not present else f"{len(present)} data fields"
        raise InvalidRequest(
            f"a part carries exactly one of text, inlineData, functionCall, functionResponse, fileData, "
            f"executableCode, codeExecutionResult; this one has {what}",
            param=where,
        )
    if part.thought_signature is not None:
        ledger.ignore("thoughtSignature", "a thought signature: nothing to verify", where=f"{where}.thoughtSignature")
    return part


class _Turns:
    """Contents to chat messages, in order; each function call's id kept to answer its response by."""

    def __init__(self, out: list[dict[str, Any]], ledger: Ledger) -> None:
        self.out = out
        self.ledger = ledger
        self.pending: list[tuple[str, str]] = []
        """(name, id) of the last model turn's function calls not yet answered."""

    def read(self, contents: list[Content]) -> None:
        for i, content in enumerate(contents):
            where = f"contents.{i}"
            self.ledger.screen(content, where)
            if not content.parts:
                raise InvalidRequest(f"'{where}.parts' must contain at least one part", param=f"{where}.parts")
            if content.role == "model":
                self.out.append(self._model(content.parts, where))
            else:
                self._user(content.parts, where)

    def _user(self, parts: list[dict[str, Any]], where: str) -> None:
        """A user turn: its function responses first (as tool messages), then its text and images."""
        texts: list[dict[str, Any]] = []
        images = answered = False
        for j, raw in enumerate(parts):
            at = f"{where}.parts.{j}"
            part = _part(raw, at, self.ledger)
            if part.thought:
                raise InvalidRequest("thought parts are served only in model turns", param=f"{at}.thought")
            if part.text is not None:
                texts.append({"type": "text", "text": part.text})
            elif part.inline_data is not None:
                texts.append({"type": "image_url", "image_url": {"url": _image(part.inline_data, at, self.ledger)}})
                images = True
            elif part.function_response is not None:
                self.out.append(self._result(part.function_response, f"{at}.functionResponse"))
                answered = True
            else:
                raise _unserved(part, at)
        if images:
            self.out.append({"role": "user", "content": texts})
        elif texts or not answered:
            self.out.append({"role": "user", "content": "\n".join(t["text"] for t in texts)})

    def _model(self, parts: list[dict[str, Any]], where: str) -> dict[str, Any]:
        """A model turn: text pieces joined as sampled (no separator), thoughts as reasoning, calls."""
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        self.pending = []
        for j, raw in enumerate(parts):
            at = f"{where}.parts.{j}"
            part = _part(raw, at, self.ledger)
            if part.text is not None:
                (reasoning if part.thought else texts).append(part.text)
            elif part.function_call is not None:
                call = check(FunctionCall, part.function_call, f"{at}.functionCall", self.ledger)
                ident = call.id or f"call_{where.rpartition('.')[2]}_{j}"
                self.pending.append((call.name, ident))
                arguments = arguments_text(call.args or {})
                calls.append({"id": ident, "type": "function", "function": {"name": call.name, "arguments": arguments}})
            else:
                raise _unserved(part, at)
        text = "".join(texts)
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        return message

    def _result(self, raw: dict[str, Any], where: str) -> dict[str, Any]:
        result = check(FunctionResponse, raw, where, self.ledger)
        if result.parts:
            raise InvalidRequest(
                "multimodal function responses are not served; return the result in 'response'",
                param=f"{where}.parts",
            )
        ident = result.id
        if ident is None:  # the older API matches a response to its call by name, in order
            ident = next((i for name, i in self.pending if name == result.name), None)
            if ident is None:
                raise InvalidRequest(
                    f"functionResponse '{result.name}' has no id and answers no functionCall of the model turn "
                    "before it",
                    param=f"{where}.name",
                )
        self.pending = [(name, i) for name, i in self.pending if i != ident]
        return {"role": "tool", "tool_call_id": ident, "content": _result_text(result.response or {})}


def _result_text(response: dict[str, Any]) -> str:
    """A function's result as the tool message's text. Google's rule: ``output`` holds the result and
    ``error`` the failure (said with ``Error:``, as a chat tool message has no error flag); without
    either key the whole object is the result (compact JSON)."""
    if not response:
        return ""
    if not set(response) <= {"output", "error"}:
        return _text(response)
    texts = []
    if "output" in response:
        texts.append(_text(response["output"]))
    if "error" in response:
        texts.append(f"Error: {_text(response['error'])}")
    return "\n".join(texts)


def _text(value: Any) -> str:
    """A value as text: a string as it is, anything else as compact JSON."""
    if isinstance(value, str):
        return value
    try:
        return orjson.dumps(value).decode()
    except TypeError:  # an integer beyond 64 bits, which orjson does not write
        return json.dumps(value, ensure_ascii=False)


def _image(raw: dict[str, Any], where: str, ledger: Ledger) -> str:
    blob = check(Blob, raw, f"{where}.inlineData", ledger)
    if not blob.mime_type.startswith("image/"):
        raise InvalidRequest(
            f"inlineData of type {blob.mime_type!r} is not served (images only)", param=f"{where}.inlineData.mimeType"
        )
    return f"data:{blob.mime_type};base64,{blob.data}"


def _unserved(part: Part, where: str) -> InvalidRequest:
    if part.file_data is not None:
        return InvalidRequest(
            "fileData is not served: this deployment has no Files API; send images as inlineData",
            param=f"{where}.fileData",
        )
    if part.executable_code is not None or part.code_execution_result is not None:
        name = "executableCode" if part.executable_code is not None else "codeExecutionResult"
        return InvalidRequest(
            f"{name} parts come from Google's code execution, which this deployment does not run; drop them "
            "from the history",
            param=f"{where}.{name}",
        )
    kind = "functionCall" if part.function_call is not None else "functionResponse"
    turn = "model" if kind == "functionCall" else "user"
    return InvalidRequest(f"{kind} parts are served only in {turn} turns", param=f"{where}.{kind}")


# -- tools --------------------------------------------------------------------------------------


def _tools(raw: list[dict[str, Any]], ledger: Ledger) -> list[dict[str, Any]]:
    tools = []
    for k, tool in enumerate(raw):
        for key, value in tool.items():
            where = f"tools.{k}.{key}"
            name = compat.camel(key)
            if value is None:
                continue
            if name == "functionDeclarations":
                if not isinstance(value, list) or not all(isinstance(d, dict) for d in value):
                    raise InvalidRequest(f"'{where}' must be an array of function declarations", param=where)
                tools += [_function(d, f"{where}.{j}", ledger) for j, d in enumerate(value)]
            elif name in compat.GEMINI_HOSTED:
                message = (
                    f"tool {name!r} runs on Google's servers and is not served by this deployment; declare "
                    "functionDeclarations and run them in the agent"
                )
                ledger.hosted(name, where=where, message=message)
            elif name in compat.GEMINI_CLIENT_TOOLS:
                raise InvalidRequest(
                    f"tool {name!r} is not served: its actions are known only to Google's models; declare "
                    "functionDeclarations instead",
                    param=where,
                )
            else:
                ledger.unknown(key, value, where=where)
    return tools


def _function(raw: dict[str, Any], where: str, ledger: Ledger) -> dict[str, Any]:
    declared = check(FunctionDeclaration, raw, where, ledger)
    for name in ("response", "response_json_schema", "behavior"):
        if getattr(declared, name) is not None:
            field = compat.camel(name)
            why = "its call is not scheduled" if name == "behavior" else "the result schema is not shown to the model"
            ledger.ignore(f"tools.functionDeclarations.{field}", why, where=f"{where}.{field}")
    if declared.parameters is not None and declared.parameters_json_schema is not None:
        raise InvalidRequest(
            "a function declaration takes 'parameters' or 'parametersJsonSchema', not both",
            param=f"{where}.parametersJsonSchema",
        )
    if declared.parameters_json_schema is not None:
        if not isinstance(declared.parameters_json_schema, dict):
            raise InvalidRequest("'parametersJsonSchema' must be an object", param=f"{where}.parametersJsonSchema")
        parameters = declared.parameters_json_schema
    elif declared.parameters is not None:
        parameters = json_schema(declared.parameters, f"{where}.parameters")
    else:
        parameters = {"type": "object", "properties": {}}
    function: dict[str, Any] = {"name": declared.name}
    if declared.description is not None:
        function["description"] = declared.description
    function["parameters"] = parameters
    return {"type": "function", "function": function}


def _tool_config(req: Conversation, tools: list[dict[str, Any]], chat: dict[str, Any], ledger: Ledger) -> None:
    config = req.tool_config
    if config is None:
        return
    ledger.screen(config, "toolConfig")
    if config.retrieval_config is not None:
        ledger.ignore(
            "toolConfig.retrievalConfig", "settings of Google's retrieval tools", where="toolConfig.retrievalConfig"
        )
    calling = config.function_calling_config
    if calling is None:
        return
    where = "toolConfig.functionCallingConfig"
    ledger.screen(calling, where)
    mode = calling.mode or "AUTO"
    names = calling.allowed_function_names
    if names is not None and mode not in ("ANY", "VALIDATED"):
        raise InvalidRequest(
            "allowedFunctionNames is valid only with mode ANY or VALIDATED", param=f"{where}.allowedFunctionNames"
        )
    if not tools:
        if mode in ("NONE", "AUTO", "MODE_UNSPECIFIED"):
            return
        raise InvalidRequest(f"functionCallingConfig mode {mode} needs function declarations", param=f"{where}.mode")
    if names:
        known = {t["function"]["name"] for t in tools}
        for name in names:
            if name not in known:
                raise InvalidRequest(
                    f"allowedFunctionNames names {name!r}, which is not declared", param=f"{where}.allowedFunctionNames"
                )
    if mode in ("ANY", "VALIDATED"):  # calls held to their declared schema: vLLM's strict functions
        for tool in tools:
            tool["function"]["strict"] = True
    if names and (mode == "VALIDATED" or len(set(names)) > 1):
        ledger.map(where, "only the allowed functions are shown to the model", where=f"{where}.allowedFunctionNames")
        tools[:] = [t for t in tools if t["function"]["name"] in names]
    if mode == "NONE":
        chat["tool_choice"] = "none"
    elif mode == "ANY" and names and len(set(names)) == 1:
        chat["tool_choice"] = {"type": "function", "function": {"name": names[0]}}
    else:
        chat["tool_choice"] = "required" if mode == "ANY" else "auto"


# -- generation config --------------------------------------------------------------------------


def _generation(config: GenerationConfig, chat: dict[str, Any], ledger: Ledger) -> Asked:
    where = "generationConfig"
    ledger.screen(config, where)
    for name, key in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("seed", "seed"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("max_output_tokens", "max_tokens"),
    ):
        value = getattr(config, name)
        if value is not None:
            chat[key] = value
    if config.stop_sequences:
        chat["stop"] = config.stop_sequences
    if config.candidate_count is not None and config.candidate_count > 1:
        chat["n"] = config.candidate_count
    for modality in config.response_modalities or ():
        if modality.upper() != "TEXT":
            raise InvalidRequest(
                f"response modality {modality!r} is not served (TEXT only)", param=f"{where}.responseModalities"
            )
    _format(config, chat)
    thoughts = (
        compat.gemini_thinking(config.thinking_config, f"{where}.thinkingConfig", ledger)
        if (config.thinking_config is not None)
        else False
    )
    top = config.logprobs or 0
    if top and not config.response_logprobs:
        raise InvalidRequest("'logprobs' needs responseLogprobs: true", param=f"{where}.logprobs")
    if config.response_logprobs:
        chat["logprobs"] = True
        if top:
            chat["top_logprobs"] = top
    return Asked(
        thoughts=thoughts,
        logprobs=bool(config.response_logprobs),
        top_logprobs=top,
        stop_sequences=tuple(config.stop_sequences or ()),
    )


def _format(config: GenerationConfig, chat: dict[str, Any]) -> None:
    """``responseMimeType`` and its schema as vLLM's ``response_format`` (structured output)."""
    where = "generationConfig"
    mime = config.response_mime_type
    schema, raw = config.response_schema, config.response_json_schema
    if schema is not None and raw is not None:
        raise InvalidRequest(
            "responseSchema and responseJsonSchema cannot both be set", param=f"{where}.responseJsonSchema"
        )
    if mime in (None, "text/plain"):
        if schema is not None or raw is not None:
            param = f"{where}.{'responseSchema' if schema is not None else 'responseJsonSchema'}"
            raise InvalidRequest("a response schema needs responseMimeType 'application/json'", param=param)
        return
    if mime != JSON_MIME:
        raise InvalidRequest(
            f"responseMimeType {mime!r} is not served (text/plain or application/json)",
            param=f"{where}.responseMimeType",
        )
    if raw is not None and not isinstance(raw, dict):
        raise InvalidRequest("'responseJsonSchema' must be an object", param=f"{where}.responseJsonSchema")
    found = raw if raw is not None else json_schema(schema, f"{where}.responseSchema") if schema is not None else None
    if found is None:
        chat["response_format"] = {"type": "json_object"}
    else:
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "response", "schema": found}}


# -- Google's Schema as JSON Schema -------------------------------------------------------------

_SCHEMA_KEYS = {
    "any_of": "anyOf",
    "min_items": "minItems",
    "max_items": "maxItems",
    "min_length": "minLength",
    "max_length": "maxLength",
    "min_properties": "minProperties",
    "max_properties": "maxProperties",
    "property_ordering": "propertyOrdering",
}
_TYPES = frozenset({"string", "number", "integer", "boolean", "array", "object", "null"})


def json_schema(schema: Any, where: str) -> dict[str, Any]:
    """Google's ``Schema`` (an OpenAPI 3.0 subset: upper-case types, ``nullable``,
    ``propertyOrdering``) as the JSON Schema vLLM's grammar and the chat template read."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"'{where}' must be a schema object", param=where)
    out: dict[str, Any] = {}
    nullable = False
    for key, value in schema.items():
        name = str(_SCHEMA_KEYS.get(key, key))
        if name == "type":
            kind = value.lower() if isinstance(value, str) else value
            if kind not in _TYPES:
                raise InvalidRequest(f"'{where}.type': unknown schema type {value!r}", param=f"{where}.type")
            out["type"] = kind
        elif name == "nullable":
            nullable = value is True
        elif name == "properties":
            if not isinstance(value, dict):
                raise InvalidRequest(f"'{where}.properties' must be an object", param=f"{where}.properties")
            out["properties"] = {k: json_schema(v, f"{where}.properties.{k}") for k, v in value.items()}
        elif name == "items":
            out["items"] = json_schema(value, f"{where}.items")
        elif name == "anyOf":
            if not isinstance(value, list):
                raise InvalidRequest(f"'{where}.anyOf' must be an array", param=f"{where}.anyOf")
            out["anyOf"] = [json_schema(v, f"{where}.anyOf.{i}") for i, v in enumerate(value)]
        elif name in ("propertyOrdering", "example"):
            continue  # the order is applied below; an example is documentation
        else:
            out[name] = value
    ordering = schema.get("propertyOrdering", schema.get("property_ordering"))
    if isinstance(ordering, list) and isinstance(out.get("properties"), dict):
        props = out["properties"]
        out["properties"] = {k: props[k] for k in ordering if k in props} | props
    if nullable and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    return out
