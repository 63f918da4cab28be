"""What both dialects do alike: the ids the client sees, the reasoning of a chat answer, one event.

The Messages and Responses translators (``messages/``, ``responses/``) read vLLM's chat answer and
frame their server-sent events the same way; doing it here keeps the two from drifting apart.
"""

from __future__ import annotations

import hashlib
from typing import Any
from uuid import uuid4

import orjson


def new_id(prefix: str) -> str:
    """A fresh id in the client's API: ``<prefix>_<32 hex digits>`` (``msg``, ``toolu``, ``resp``, ``fc``, ...)."""
    return f"{prefix}_{uuid4().hex}"


def derived_id(prefix: str, seed: str, n: int) -> str:
    """The ``n``-th id of an answer whose own id is ``seed``: as unique as the seed (a fresh one is
    random), and the same again when the answer is replayed under its recorded id (``proxy/replay.py``)."""
    return f"{prefix}_{hashlib.sha256(f'{seed}/{n}'.encode()).hexdigest()[:32]}"


def reasoning_of(message: dict[str, Any]) -> Any:
    """The reasoning of a chat message or delta: vLLM fills ``reasoning_content`` or ``reasoning``."""
    return message.get("reasoning_content") or message.get("reasoning")


def sse(name: bytes, data: dict[str, Any]) -> bytes:
    """One server-sent event, ready to send: its ``event`` name and its ``data`` as compact JSON."""
    return b"event: " + name + b"\ndata: " + orjson.dumps(data) + b"\n\n"
