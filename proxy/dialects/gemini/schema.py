"""The shapes of a Gemini ``generateContent`` request, checked by pydantic; a failed check a 400 naming its place.

Google's REST API reads proto3 JSON: every field may be sent in lowerCamelCase (what the SDKs and
Gemini CLI send) or in its proto name, snake_case (the API's curl examples write
``system_instruction``). The models here take both (``alias_generator=to_camel``,
``populate_by_name``); a refusal names the field as the client spelt it where pydantic knows it.

A part is one object with exactly one data field (``text``, ``inlineData``, ``functionCall``, ...)
and optional metadata (``thought``, ``thoughtSignature``). Parts, tools and function declarations
are checked one by one as they are translated (``check``), so a refusal names its exact place.
Every model allows extra keys: they get their rule from ``proxy/compat.py`` (``Ledger.screen``).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from proxy import compat
from proxy.compat import Ledger
from proxy.dialects.messages.schema import _invalid
from proxy.errors import InvalidRequest

Ignored = Any
"""A field accepted for compatibility and not used."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="allow", alias_generator=to_camel, populate_by_name=True)


M = TypeVar("M", bound=_Model)


def check(model: type[M], data: dict[str, Any], where: str, ledger: Ledger) -> M:
    """One object (a part, a declaration, the body) at ``where``, checked; its unknown fields screened.
    A 400 names the first failing place as the client spelt it (pydantic reports the alias)."""
    try:
        checked = model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, where) from None
    ledger.screen(checked, where)
    return checked


class FunctionCall(_Model):
    id: str | None = None
    name: str = Field(min_length=1)
    args: dict[str, Any] | None = None


class FunctionResponse(_Model):
    id: str | None = None
    name: str = Field(min_length=1)
    response: dict[str, Any] | None = None
    parts: list[dict[str, Any]] | None = None
    """Multimodal results (images a tool returns): not served, refused when not empty."""


class Blob(_Model):
    mime_type: str = Field(min_length=1)
    data: str


class Part(_Model):
    text: str | None = None
    inline_data: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    function_response: dict[str, Any] | None = None
    file_data: dict[str, Any] | None = None
    executable_code: dict[str, Any] | None = None
    code_execution_result: dict[str, Any] | None = None
    thought: bool | None = None
    thought_signature: Ignored = None
    """The model's opaque thought signature, passed back by clients: nothing to verify here."""


DATA_FIELDS = (
    "text",
    "inline_data",
    "function_call",
    "function_response",
    "file_data",
    "executable_code",
    "code_execution_result",
)
"""A part's data fields, exactly one of which it carries (a oneof in Google's proto)."""


class Content(_Model):
    role: Literal["user", "model", "function"] | None = None
    """``function`` is the older API's role for function responses: read as ``user``."""
    parts: list[dict[str, Any]]


class FunctionDeclaration(_Model):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """An OpenAPI 3.0 schema subset (Google's ``Schema``), converted to JSON Schema."""
    parameters_json_schema: Any = None
    """JSON Schema as is (what Gemini CLI sends)."""
    response: Ignored = None
    response_json_schema: Ignored = None
    behavior: Ignored = None


class FunctionCallingConfig(_Model):
    mode: Literal["AUTO", "ANY", "NONE", "VALIDATED", "MODE_UNSPECIFIED"] | None = None
    allowed_function_names: list[str] | None = None


class ToolConfig(_Model):
    function_calling_config: FunctionCallingConfig | None = None
    retrieval_config: Ignored = None


class ThinkingConfig(_Model):
    include_thoughts: bool | None = None
    thinking_budget: int | None = Field(None, ge=-1)
    thinking_level: str | None = None


class GenerationConfig(_Model):
    stop_sequences: list[str] | None = None
    response_mime_type: str | None = None
    response_schema: dict[str, Any] | None = None
    response_json_schema: Any = None
    response_modalities: list[str] | None = None
    candidate_count: int | None = Field(None, ge=1, le=8)
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    response_logprobs: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    thinking_config: ThinkingConfig | None = None


class Conversation(_Model):
    """What both ``generateContent`` and ``countTokens`` (its ``generateContentRequest``) take."""

    contents: list[Content]
    system_instruction: Content | None = None
    tools: list[dict[str, Any]] | None = None
    tool_config: ToolConfig | None = None
    model: Ignored = None
    """``models/<name>`` in a ``countTokens`` request's ``generateContentRequest``; the path names the model."""


class GenerateContent(Conversation):
    generation_config: GenerationConfig | None = None


class CountTokens(_Model):
    contents: list[Content] | None = None
    generate_content_request: dict[str, Any] | None = None


def validated(model: type[M], body: Any, ledger: Ledger) -> M:
    """The whole request body, checked; its top-level fields the translation does not use get their rule."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if model is CountTokens:
        return check(model, body, "", ledger)
    req = check(model, {k: v for k, v in body.items() if k not in compat.GEMINI_TOP}, "", ledger)
    compat.gemini_top({k: v for k, v in body.items() if k in compat.GEMINI_TOP}, ledger)
    return req
