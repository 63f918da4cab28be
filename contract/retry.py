"""When the client sends a call again, and the errors it raises when it stops (one rule for both clients).

Every call is of one of two kinds (``Repeat``):

- ``safe``: a repeat has no further effect, so it is retried after any transport error (the
  request may or may not have reached the proxy) and after any 5xx answer. Reads; a reward and an
  abandon (the same reward again is a no-op, another one 409; an abandoned episode stays as it
  is); a claim (it carries a lease id chosen by the client and sent with every attempt: a retry
  whose first answer was lost gets the groups that lease already holds, not a second set); renew,
  release, ack (the same step again is a no-op), step reports (a repeat replaces) and publish (a
  repeat of a version already applied is refused 409; ``trainer.publish`` then finds it among the
  versions).
- ``unsent``: creating a group or an episode; a repeat would create a second one, so it is
  retried only when the request cannot have left: the connection was refused or timed out
  (``httpx.ConnectError``, ``httpx.ConnectTimeout``).

A 4xx answer is never retried. Up to ``attempts`` (7) attempts; the waits between them start at
``first_wait_s`` (0.5 s) and double up to ``max_wait_s`` (8 s): 0.5, 1, 2, 4, 8, 8 s, 23.5 s in
all, long enough for a proxy restart.

Errors:

    ProxyError (status, message, error_type, code)   the proxy answered 4xx or 5xx (its OpenAI-style error)
    └── ProxyUnreachable (status 0)                  no answer: connect, timeout or read error (``__cause__``)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import httpx

Repeat = Literal["safe", "unsent"]
"""When a call may be sent again: after any failure but a 4xx, or only when it never left (module docstring)."""
UNSENT = (httpx.ConnectError, httpx.ConnectTimeout)
"""Transport errors raised before the request left: no proxy can have acted on it."""


class ProxyError(Exception):
    """The proxy answered with an error: ``status``, its message, OpenAI error ``type`` and ``code``."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str | None = None,
        code: str | None = None,
        *,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(f"proxy answered {status}: {message}")
        self.status = status
        self.message = message
        self.error_type = error_type
        self.code = code
        self.retry_after_s = retry_after_s
        """The answer's ``Retry-After`` in seconds (a 429: e.g. ``backlog_full`` from ``POST /groups``)."""


class ProxyUnreachable(ProxyError):
    """No answer from the proxy (status 0); the transport error is the ``__cause__``."""

    def __init__(self, url: str, call: str, cause: Exception) -> None:
        super().__init__(
            0,
            f"cannot reach the proxy at {url} ({call}: {type(cause).__name__}: {cause}); "
            "is `python -m proxy serve` running and the proxy URL right?",
        )


class Refused(Exception):
    """An error answer (4xx, 5xx) before the retry rule has judged it; never leaves the client."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


@dataclass(frozen=True)
class RetryRule:
    """How often and how patiently a call is repeated (the rule itself: module docstring)."""

    attempts: int = 7
    """Attempts per call, the first included."""
    first_wait_s: float = 0.5
    """Wait after the first failed attempt (s); it doubles after each further one."""
    max_wait_s: float = 8.0
    """The longest wait between two attempts (s)."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"attempts must be >= 1 (got {self.attempts})")

    def wait_s(self, failed: int) -> float:
        """The wait after ``failed`` attempts have failed (1, 2, ...)."""
        return float(min(self.first_wait_s * 2 ** (failed - 1), self.max_wait_s))

    def retries(self, repeat: Repeat, failure: httpx.Response | httpx.TransportError) -> bool:
        """Whether a call of kind ``repeat`` is sent again after ``failure`` (an error answer or a transport error)."""
        if isinstance(failure, httpx.Response):
            return repeat == "safe" and failure.status_code >= 500
        return repeat == "safe" or isinstance(failure, UNSENT)


RETRY = RetryRule()
"""The default: 7 attempts, waits of 0.5 s doubling up to 8 s."""


def refusal(answer: httpx.Response) -> ProxyError:
    """The proxy's error answer as a ``ProxyError``; an answer that is not its JSON error keeps its text."""
    try:
        error = answer.json().get("error") or {}
    except (ValueError, AttributeError):  # not JSON, or JSON but not an object
        error = {}
    if not isinstance(error, dict):
        error = {"message": str(error)}
    return ProxyError(
        answer.status_code,
        str(error.get("message") or answer.text[:500]),
        error.get("type"),
        error.get("code"),
        retry_after_s=_retry_after(answer.headers.get("retry-after")),
    )


def _retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds; the proxy sends whole seconds (an HTTP date is not expected, so None)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None
