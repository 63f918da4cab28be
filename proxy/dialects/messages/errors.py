"""Proxy errors in the Messages API's shape: ``{"type": "error", "error": {"type", "message"}}``.

Each ``FlywheelError`` class maps to the Anthropic error ``type`` the client's SDK acts on (a
retryable 503 is ``overloaded_error``, which the SDK retries as it does a 529); the route's error
handler (``proxy/app.py``) and the stream's error event both answer with ``error_body``.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import (
    AuthenticationFailed,
    Conflict,
    FlywheelError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
    ServiceUnavailable,
    TooManyRequests,
    UpstreamNotSynced,
    UpstreamTimeout,
)

_ERROR_TYPES: dict[type[FlywheelError], str] = {
    InvalidRequest: "invalid_request_error",
    AuthenticationFailed: "authentication_error",
    PermissionDenied: "permission_error",
    NotFound: "not_found_error",
    PayloadTooLarge: "request_too_large",  # Anthropic's documented 413 type
    Conflict: "invalid_request_error",  # Anthropic uses invalid_request_error for unlisted 4xx
    ServiceUnavailable: "overloaded_error",  # retryable: the SDK retries it as it does a 529
    UpstreamNotSynced: "overloaded_error",  # a 503 too: retry once the replica has its adapters back
    TooManyRequests: "rate_limit_error",
    UpstreamTimeout: "timeout_error",  # the SDK's GatewayTimeoutErrorObject (504)
}


def error_type(error: FlywheelError) -> str:
    """The Anthropic error ``type`` for a proxy error (the nearest mapped class; else ``api_error``)."""
    for cls in type(error).__mro__:
        found = _ERROR_TYPES.get(cls)
        if found is not None:
            return found
    return "api_error"


def error_body(error: FlywheelError) -> dict[str, Any]:
    """An error as the Messages API answers it: ``{"type": "error", "error": {"type", "message"}}``."""
    return {"type": "error", "error": {"type": error_type(error), "message": error.message}}
