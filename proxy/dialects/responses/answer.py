"""What the whole answer and the stream build alike from vLLM's: usage, log-probs, sealed reasoning.

``translation.py`` (the ``Response``) and ``stream.py`` (its events) both call these, so an answer
reads the same streamed or not. Reasoning asked for as ``reasoning.encrypted_content`` is sealed
here and unsealed when the client passes the item back (``request.py``).
"""

from __future__ import annotations

import base64
from typing import Any

ENCRYPTED_PREFIX = "flywheel:"
"""Marks ``encrypted_content`` the proxy wrote: the reasoning text itself, base64 (nothing to hide)."""


def usage_of(usage: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's usage as the Responses API counts it (no counts: zeros)."""
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


def logprobs_of(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's per-token log-probs (``logprobs.content``) as ``output_text`` log-probs."""
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


def text_logprobs(items: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The sampled tokens' log-probs that spell ``text`` (a tool call's tokens follow it)."""
    out, length = [], 0
    for item in items:
        if length >= len(text):
            break
        out.append(item)
        length += len(item.get("token", ""))
    return logprobs_of(out)


def sealed(text: str) -> str:
    """Reasoning as the ``encrypted_content`` of its output item."""
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def unsealed(encrypted: Any) -> str | None:
    """The reasoning in ``encrypted_content`` the proxy sealed; None for anything else."""
    if isinstance(encrypted, str) and encrypted.startswith(ENCRYPTED_PREFIX):
        return base64.b64decode(encrypted[len(ENCRYPTED_PREFIX) :]).decode()
    return None
