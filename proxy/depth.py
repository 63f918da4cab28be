"""The JSON depth limit every model-call body and upstream answer passes.

The proxy sends, stores and translates what it takes, and orjson writes at most 254 levels: a
deeper body would fail after it was accepted, so it is refused up front. A server concern (orjson),
so it lives here, not with the wire models in ``contract/schemas.py``.
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_DEPTH = 128
"""The deepest nesting of arrays and objects in a model call's body or an upstream answer: the proxy
sends, stores and translates what it takes, and orjson writes at most 254 levels (a deeper body
would fail after it was accepted)."""


def _writable_depth() -> int:
    """The deepest nesting orjson writes (254 in orjson 3.x), found once by trying, not assumed."""
    value: Any = 0
    for depth in range(1, 4096):
        value = [value]
        try:
            orjson.dumps(value)
        except orjson.JSONEncodeError:
            return depth - 1
    return 4095


_PAD = _writable_depth() - MAX_DEPTH


def too_deep(raw: bytes, value: Any) -> bool:
    """True if ``value``, parsed from ``raw``, nests arrays and objects deeper than ``MAX_DEPTH``.

    Counting brackets is cheap and bounds the depth, so only JSON with many of them is measured,
    by orjson itself: ``value`` wrapped in ``_PAD`` lists is writable exactly when ``value`` is at
    most ``MAX_DEPTH`` deep. One C pass: a model answer with log-probs (a few thousand containers)
    cost 3x its own parse when walked in Python, and the check runs on every body and answer."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    for _ in range(_PAD):
        value = [value]
    try:
        orjson.dumps(value)
    except orjson.JSONEncodeError as exc:
        return "recursion" in str(exc).lower()  # anything else orjson refuses is not this check's to judge
    return False
