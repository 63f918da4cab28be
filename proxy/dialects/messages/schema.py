"""The shapes of a Messages request, checked by pydantic; a failed check as a 400 naming its place.

Shapes and scalars are checked here; content blocks and tools are checked one by one by their
``type`` as the request is translated (``request.py`` calls ``check``), so a refusal names the
block's type and its exact place. Every model allows extra keys: they get their rule from
``proxy/compat.py`` (``Ledger.screen``). ``_Message`` and ``_ToolChoice`` keep their names: a
client sees them in pydantic's errors ("... a valid dictionary or instance of _Message").
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError

from proxy import compat
from proxy.compat import Ledger
from proxy.errors import InvalidRequest


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
M = TypeVar("M", bound="_Model")


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras get their rule from ``compat`` (``Ledger.screen``)


class Text(_Model):
    type: Literal["text"]
    text: str
    cache_control: Ignored = None
    citations: Ignored = None


class Image(_Model):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: Ignored = None


class Base64Source(_Model):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class UrlSource(_Model):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ToolResult(_Model):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Content = ""
    is_error: bool = False
    cache_control: Ignored = None


class ToolUse(_Model):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: Ignored = None
    caller: dict[str, Any] | None = None
    """Who made the call; SDKs pass back ``{"type": "direct"}`` or null (the model itself)."""
    toolset_name: None = None


class Thinking(_Model):
    type: Literal["thinking"]
    thinking: str
    signature: Ignored = None


class Tool(_Model):
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


class Conversation(_Model):
    """What both ``/v1/messages`` and ``/v1/messages/count_tokens`` take."""

    model: str = Field(min_length=1)
    messages: list[_Message]
    system: Content | None = None
    tools: Objects | None = None
    tool_choice: _ToolChoice | None = None


class Create(Conversation):
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


def check(model: type[M], data: dict[str, Any], where: str, ledger: Ledger) -> M:
    """One block (or tool, or image source) at ``where``, checked; its unused fields screened."""
    try:
        checked = model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, where) from None
    ledger.screen(checked, where)
    return checked


def validated(model: type[M], body: dict[str, Any], ledger: Ledger) -> M:
    """The whole request body, checked; its top-level fields the translation does not use get their rule."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise _invalid(exc) from None
    compat.messages_top(req.model_extra or {}, body, ledger)
    return req
