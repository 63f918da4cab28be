"""``GeminiTranslation``: a Gemini request as a chat request, and vLLM's answer as a ``GenerateContentResponse``."""

from __future__ import annotations

from typing import Any

from contract.vocabulary import CallApi
from proxy.compat import Ledger
from proxy.dialects.gemini.answer import finish_reason, function_call, logprobs_result, usage_metadata
from proxy.dialects.gemini.request import Asked, chat_body
from proxy.dialects.gemini.schema import GenerateContent, validated
from proxy.dialects.gemini.stream import GeminiStream
from proxy.dialects.shared import derived_id, new_id, reasoning_of
from proxy.errors import UpstreamError
from proxy.settings import CompatSettings


class GeminiTranslation:
    """A validated ``generateContent`` request and the chat body that runs it."""

    api: CallApi = "gemini"

    __slots__ = ("client_request", "chat", "response_id", "model", "asked", "sse", "ledger", "compat")

    def __init__(
        self,
        client_request: dict[str, Any],
        chat: dict[str, Any],
        model: str,
        asked: Asked,
        ledger: Ledger,
        *,
        sse: bool = True,
    ) -> None:
        self.client_request = client_request
        self.chat = chat
        self.response_id = new_id("gen")
        self.model = model
        """The model name the path named: the answer's ``modelVersion``."""
        self.asked = asked
        self.sse = sse
        """A streamed answer as server-sent events (``alt=sse``), else as one JSON array sent piece by piece."""
        self.ledger = ledger
        """What ``proxy/compat.py`` decided about the fields the translation does not use."""
        self.compat = ledger.note()

    @classmethod
    def from_request(
        cls,
        body: dict[str, Any],
        model: str,
        *,
        stream: bool = False,
        sse: bool = True,
        settings: CompatSettings | None = None,
    ) -> GeminiTranslation:
        """Validate and translate; ``InvalidRequest`` (with ``param``) for anything not served.
        ``model`` is the path's (``models/<model>:generateContent``)."""
        ledger = Ledger(settings)
        req = validated(GenerateContent, body, ledger)
        chat, asked = chat_body(req, model, stream, ledger)
        return cls(body, chat, model, asked, ledger, sse=sse)

    def candidate(self, choice: dict[str, Any], n: int) -> dict[str, Any]:
        """One choice of a whole chat answer as a ``Candidate``."""
        message = choice.get("message") or {}
        parts: list[dict[str, Any]] = []
        reasoning = reasoning_of(message)
        if reasoning and self.asked.thoughts:
            parts.append({"text": reasoning, "thought": True})
        text = message.get("content")
        if text:
            parts.append({"text": text})
        for k, call in enumerate(message.get("tool_calls") or ()):
            function = call.get("function") or {}
            ident = call.get("id") or derived_id("call", self.response_id, n * 1000 + k)
            parts.append(function_call(ident, function.get("name") or "", function.get("arguments")))
        index = choice.get("index", n)
        out: dict[str, Any] = {
            "content": {"parts": parts, "role": "model"},
            "finishReason": finish_reason(choice.get("finish_reason")),
            "index": index if type(index) is int else n,
        }
        if self.asked.logprobs:
            items = (choice.get("logprobs") or {}).get("content") or []
            out["logprobsResult"] = logprobs_result(items, choice.get("token_ids"), self.asked.top_logprobs)
            if items:
                out["avgLogprobs"] = out["logprobsResult"]["logProbabilitySum"] / len(items)
        return out

    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The ``GenerateContentResponse`` for vLLM's non-streamed chat completion (which is not modified)."""
        choices = chat.get("choices")
        if not choices:
            raise UpstreamError("the engine's answer has no choices")
        usage = chat.get("usage") or {}
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if type(prompt) is not int:
            prompt = len(chat.get("prompt_token_ids") or ())
        if type(completion) is not int:
            completion = sum(len(c.get("token_ids") or ()) for c in choices)
        return {
            "candidates": [self.candidate(choice, n) for n, choice in enumerate(choices)],
            "usageMetadata": usage_metadata(prompt, completion),
            "modelVersion": self.model,
            "responseId": self.response_id,
        }

    def stream(self) -> GeminiStream:
        return GeminiStream(self)
