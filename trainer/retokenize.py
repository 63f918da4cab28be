"""Token ids for calls recorded without exact ones, rebuilt from their messages (opt-in: ``retokenize_inexact``).

A rebuilt call has no engine log-probs, and its ids are the chat template's, not necessarily the
engine's: ``turns.py`` counts every call rebuilt (``calls_retokenized``) or dropped
(``calls_dropped_inexact``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from contract.client import Call

Retokenizer = Callable[[Call], tuple[list[int], list[int]] | None]
"""(prompt ids, completion ids) rebuilt from a call's messages and reply text, or None."""


class ChatRetokenizer:
    """Rebuild a call's token ids from its messages and reply with the chat template (opt-in).

    The completion is the rendered assistant turn minus the prompt, cut after its last end-of-turn
    token, so it ends like an engine completion that stopped on EOS.
    """

    def __init__(self, tokenizer: Any, chat_template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.eos = tokenizer.eos_token_id

    def _render(self, messages: list[dict[str, Any]], tools: Any, generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            chat_template=self.chat_template,
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    def __call__(self, call: Call) -> tuple[list[int], list[int]] | None:
        messages = call.request.get("messages")
        choice = call.choices[0]
        if call.kind != "chat" or not isinstance(messages, list):
            prompt = call.request.get("prompt")
            if not isinstance(prompt, str):
                return None
            return (
                list(self.tokenizer.encode(prompt)),
                list(self.tokenizer.encode(choice.get("text") or "", add_special_tokens=False)),
            )
        tools = call.request.get("tools")
        prompt = self._render(messages, tools, True)
        reply = {"role": "assistant", "content": choice.get("text") or ""}
        if choice.get("tool_calls"):
            reply["tool_calls"] = choice["tool_calls"]
        full = self._render([*messages, reply], tools, False)
        if full[: len(prompt)] != prompt:
            return None
        completion = full[len(prompt) :]
        if self.eos in completion:
            completion = completion[: len(completion) - completion[::-1].index(self.eos)]
        return (prompt, completion) if completion else None
