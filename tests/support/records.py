"""Stored calls made by hand, for tests that write the store (or read records) without an engine.

Every such test needs a complete ``NewCall`` of twenty fields, and most care about two or three of
them; ``chat_call`` fills in a plain exact chat call (prompt ``[1, 2, 3]``, one choice sampling
``[4, 5]``) and a test names only what it is about.
"""

from __future__ import annotations

import time
from typing import Any

from proxy.store.records import CallRecord, NewCall


def _plain(episode_id: str) -> dict[str, Any]:
    """A fresh field set each time: a test may mutate the lists and dicts it gets."""
    return {
        "episode_id": episode_id,
        "kind": "chat",
        "stream": False,
        "request": {"model": "policy", "messages": []},
        "response": {"choices": []},
        "status_code": 200,
        "error": None,
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "token_ids": [4, 5], "logprobs": [-0.1, -0.2], "finish_reason": "stop"}],
        "exact_ids": True,
        "model_requested": "policy",
        "model_served": "policy-base",
        "policy_version": 0,
        "replica": "vllm-0",
        "started_at": time.time(),
        "latency_ms": 1.0,
        "ttft_ms": None,
        "prompt_tokens": 3,
        "completion_tokens": 2,
    }


def chat_call(episode_id: str, **fields: Any) -> NewCall:
    """A finished exact chat call of ``episode_id``, ready to insert; ``fields`` replace the plain values."""
    return NewCall(**(_plain(episode_id) | fields))


def call_record(episode_id: str = "ep", *, id: int = 1, ordinal: int = 0, **fields: Any) -> CallRecord:
    """The same call as the store reads it back (row id and ordinal added)."""
    return CallRecord(id=id, ordinal=ordinal, **(_plain(episode_id) | fields))
