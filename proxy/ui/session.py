"""Dashboard sessions: a signed, expiring token in an HttpOnly cookie, never the admin key itself.

A token is ``v1.<expires>.<nonce>.<signature>``: the signature is an HMAC-SHA256 of the rest under
a secret derived from the admin key with its own label (as ``auth.py`` derives episode keys), so
every proxy replica verifies a session without a store, an episode key's signature is never a
session's, and changing the admin key ends every session. A stolen cookie is a session until it
expires (``ttl_s``), not the key: logging out deletes the cookie, it cannot revoke a copy of it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

COOKIE = "fw_ui_session"
_VERSION = "v1"


class SessionTokens:
    def __init__(self, admin_key: str, *, ttl_s: float = 12 * 3600, clock: Callable[[], float] = time.time) -> None:
        self._secret = hashlib.sha256(b"flywheel-ui-session\0" + admin_key.encode()).digest()
        self.ttl_s = ttl_s
        self._clock = clock

    def _signature(self, body: str) -> str:
        digest = hmac.new(self._secret, body.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def issue(self) -> str:
        """A new session token valid for ``ttl_s`` seconds."""
        body = f"{_VERSION}.{int(self._clock() + self.ttl_s)}.{secrets.token_urlsafe(12)}"
        return f"{body}.{self._signature(body)}"

    def valid(self, token: str | None) -> bool:
        """True for a token this key signed that has not expired (constant-time comparison)."""
        if not token or token.count(".") != 3:
            return False
        body, _, signature = token.rpartition(".")
        version, expires, _nonce = body.split(".")
        if version != _VERSION or not expires.isdigit():
            return False
        if not hmac.compare_digest(signature.encode(), self._signature(body).encode()):
            return False
        return int(expires) > self._clock()
