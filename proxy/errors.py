"""Errors the proxy answers with, each rendered as OpenAI-style JSON.

Every error a client can see is a ``FlywheelError``; the one handler in ``app.py`` renders it as
``{"error": {"message", "type", "param", "code"}}`` with the class's HTTP status. Nothing escapes
as a bare 500 or an empty body.

    FlywheelError (500 server_error)
    ├── InvalidRequest (400 invalid_request_error)
    │   ├── MissingEpisode (400)            model call that names no episode
    │   ├── UnsafeRequest (400)             a request that would harm the upstream engine
    │   └── RequestRejected (4xx, given)    refused with another status: by vLLM (422, 429, ...) or routing (405)
    ├── AuthenticationFailed (401 authentication_error)
    ├── PermissionDenied (403 permission_error)
    ├── NotFound (404 not_found_error)
    ├── Conflict (409 conflict_error)
    │   └── EpisodeClosed (409)             model call on a rewarded or abandoned episode
    ├── PayloadTooLarge (413 invalid_request_error)
    ├── TooManyRequests (429 rate_limit_error)   too many wrong keys from one client (Retry-After)
    │   └── BacklogFull (429)               a new group could only be trained stale (``admission.py``)
    ├── ServiceUnavailable (503 service_unavailable)
    │   ├── RecordingFailed (503, or 507)   the store could not commit the call's record
    │   └── StoreUnavailable (503)          the store is down, unreachable or timed out (``store/faults.py``)
    │       └── StoreFull (507)             the store's disk is full
    └── UpstreamError (502 upstream_error)
        ├── UpstreamUnavailable (502)       connect error, or no healthy replica
        │   └── UpstreamNotSynced (503 service_unavailable)   a restarted replica without its adapters yet
        └── UpstreamTimeout (504 timeout_error)
"""

from __future__ import annotations

from typing import Any

import orjson


class FlywheelError(Exception):
    status_code: int = 500
    type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json(self) -> bytes:
        return orjson.dumps(self.body())

    def headers(self) -> dict[str, str]:
        """Response headers the error carries (Retry-After on a 429)."""
        return {}


class InvalidRequest(FlywheelError):
    status_code = 400
    type = "invalid_request_error"


class MissingEpisode(InvalidRequest):
    pass


class UnsafeRequest(InvalidRequest):
    pass


class RequestRejected(InvalidRequest):
    """The request's fault, under the status that refused it (vLLM's 4xx answer, Starlette's 405)."""

    def __init__(self, message: str, *, status_code: int, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.status_code = status_code


class AuthenticationFailed(FlywheelError):
    status_code = 401
    type = "authentication_error"


class PermissionDenied(FlywheelError):
    status_code = 403
    type = "permission_error"


class NotFound(FlywheelError):
    status_code = 404
    type = "not_found_error"


class Conflict(FlywheelError):
    status_code = 409
    type = "conflict_error"


class EpisodeClosed(Conflict):
    pass


class PayloadTooLarge(FlywheelError):
    status_code = 413
    type = "invalid_request_error"


class TooManyRequests(FlywheelError):
    status_code = 429
    type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message, param=param, code=code)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)}


class BacklogFull(TooManyRequests):
    """``POST /groups`` refused: the groups ahead of the trainer already fill its staleness window."""


class ServiceUnavailable(FlywheelError):
    status_code = 503
    type = "service_unavailable"


class RecordingFailed(ServiceUnavailable):
    """The call's record did not commit; under the store fault's status and type when there is one
    (``StoreFull``: 507 ``insufficient_storage``)."""

    def __init__(
        self, message: str, *, fault: StoreUnavailable | None = None, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, param=param, code=code or (fault.code if fault else None))
        if fault is not None:
            self.status_code, self.type = fault.status_code, fault.type


class StoreUnavailable(ServiceUnavailable):
    """The store failed to answer: down, restarting, unreachable, or no connection within its timeout."""


class StoreFull(StoreUnavailable):
    status_code = 507
    type = "insufficient_storage"


class UpstreamError(FlywheelError):
    status_code = 502
    type = "upstream_error"


class UpstreamUnavailable(UpstreamError):
    pass


class UpstreamNotSynced(UpstreamUnavailable):
    """A restarted replica answers again but has not got the published adapters back yet: retry shortly."""

    status_code = 503
    type = "service_unavailable"


class UpstreamTimeout(UpstreamError):
    status_code = 504
    type = "timeout_error"
