"""A Responses call as the ``Translation`` the relay runs: the chat body, the ``Response`` back.

The request becomes its chat body in ``request.py``; here the answer is built: the ``Response``
envelope (the request's settings echoed), its output items (``reasoning``, ``message`` with
``output_text``, ``function_call`` named back into its namespace), the status (``incomplete`` with
``max_output_tokens`` when vLLM stopped on length) and usage. ``stream.py`` builds the same items
event by event.
"""

from __future__ import annotations

import time
from typing import Any

from contract.vocabulary import CallApi
from proxy.compat import Ledger
from proxy.dialects.responses.answer import sealed, text_logprobs, usage_of
from proxy.dialects.responses.request import ResponsesRequest, chat_body
from proxy.dialects.responses.stream import ResponsesStream
from proxy.dialects.shared import derived_id, new_id, reasoning_of


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
        self.client_request = body
        self.response_id = new_id("resp")
        """Replaced by the recorded id when the call is replayed; the items' ids derive from it."""
        self.created_at = int(time.time())
        self.items = 0
        include = set(request.include or ())
        self.logprobs = "message.output_text.logprobs" in include
        self.encrypted = "reasoning.encrypted_content" in include
        chat, names = chat_body(request, history, self.ledger, logprobs=self.logprobs)
        self.chat = chat
        self.names = names
        """Flattened tool name -> (namespace, name), to name the answer's calls back."""
        self.compat = self.ledger.note()

    def item_id(self, prefix: str) -> str:
        """The next output item's id (``rs``, ``msg``, ``fc``), derived from the response's id."""
        self.items += 1
        return derived_id(prefix, self.response_id, self.items)

    def started(self, chat: dict[str, Any]) -> None:
        """Date the response by the engine's answer (its first chunk), so a replay dates it alike."""
        if isinstance(chat.get("created"), int):
            self.created_at = chat["created"]

    def response(self, chat: dict[str, Any]) -> dict[str, Any]:
        self.started(chat)
        choice = (chat.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        incomplete = choice.get("finish_reason") == "length"
        status = "incomplete" if incomplete else "completed"
        output: list[dict[str, Any]] = []
        reasoning = reasoning_of(message)
        if reasoning:
            output.append(self.reasoning_item(self.item_id("rs"), reasoning, status))
        text = message.get("content")
        if text:
            logprobs = None
            if self.logprobs:
                logprobs = text_logprobs((choice.get("logprobs") or {}).get("content") or [], text)
            output.append(self.message_item(self.item_id("msg"), text, status, logprobs))
        for call in message.get("tool_calls") or ():
            output.append(self.call_item(self.item_id("fc"), call, "completed"))
        return self.envelope(status, output, usage_of(chat.get("usage")), incomplete)

    def stream(self) -> ResponsesStream:
        return ResponsesStream(self)

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
            item["encrypted_content"] = sealed(text)
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
