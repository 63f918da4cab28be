"""Proxy errors in Google's shape: ``{"error": {"code", "message", "status", "details"}}``.

``code`` is the HTTP status, ``status`` the canonical code Google's clients read (a 429
``RESOURCE_EXHAUSTED`` and a 503 ``UNAVAILABLE`` are what Gemini CLI and the google-genai SDKs
retry). ``details`` carry what Flywheel knows beyond that, the way Google carries it: an
``ErrorInfo`` whose ``reason`` is the proxy's error code (``COMPAT_STRICT``, ``INVALID_API_KEY``,
...) and, for a refused field, a ``BadRequest`` naming it. The route's error handler
(``proxy/app.py``) and the stream's error event both answer with ``error_body``.
"""

from __future__ import annotations

import re
from typing import Any

from proxy.errors import FlywheelError

_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    501: "UNIMPLEMENTED",
    502: "UNAVAILABLE",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
    507: "UNAVAILABLE",
}
_METHOD = re.compile(r"/models/[^/]+:[A-Za-z]+$")


def speaks_gemini(path: str) -> bool:
    """Whether a request path is Google's API (``/v1beta/...``, or ``.../models/<m>:<method>``): its
    errors, and the ``key`` query parameter as its key."""
    return "/v1beta/" in path or path.endswith("/v1beta") or _METHOD.search(path) is not None


def status_of(error: FlywheelError) -> str:
    """Google's canonical status for a proxy error (by its HTTP status; else ``INTERNAL``)."""
    return _STATUS.get(error.status_code, "INTERNAL")


def error_body(error: FlywheelError) -> dict[str, Any]:
    """An error as Google's API answers it."""
    info: dict[str, Any] = {
        "@type": "type.googleapis.com/google.rpc.ErrorInfo",
        "reason": (error.code or error.type).upper(),
        "domain": "flywheel",
    }
    details: list[dict[str, Any]] = [info]
    if error.param:
        info["metadata"] = {"param": error.param}
        details.append(
            {
                "@type": "type.googleapis.com/google.rpc.BadRequest",
                "fieldViolations": [{"field": error.param, "description": error.message}],
            }
        )
    return {
        "error": {"code": error.status_code, "message": error.message, "status": status_of(error), "details": details}
    }
