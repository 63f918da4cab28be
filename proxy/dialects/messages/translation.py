"""A Messages call as the ``Translation`` the relay runs: built from the request, answered as a ``Message``.

``from_request`` validates and translates (``request.py``); ``response`` turns vLLM's chat
completion into the ``Message`` the client reads; ``stream`` gives the event translator
(``stream.py``), which ends with the same ``stop_reason`` (``stop``).
"""

from __future__ import annotations

from typing import Any

from contract.vocabulary import CallApi
from proxy.compat import Ledger
from proxy.dialects.messages.arguments import tool_input
from proxy.dialects.messages.request import chat_body
from proxy.dialects.messages.schema import Create, validated
from proxy.dialects.messages.stream import MessagesStream
from proxy.dialects.shared import new_id, reasoning_of
from proxy.errors import UpstreamError
from proxy.settings import CompatSettings


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
        self.response_id = new_id("msg")
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
        req = validated(Create, body, ledger)
        return cls(body, chat_body(req, ledger), req.model, tuple(req.stop_sequences or ()), ledger)

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
        reasoning = reasoning_of(message)
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
                    "id": call.get("id") or new_id("toolu"),
                    "name": function.get("name") or "",
                    "input": tool_input(function.get("arguments")),
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
