"""Dashboard sessions: a signed, expiring token in an HttpOnly cookie, never the admin key itself.

A token is ``v1.<expires>.<nonce>.<signature>``: the signature is an HMAC-SHA256 of the rest under
a secret derived from the admin key with its own label (as ``auth.py`` derives episode keys), so
every proxy replica verifies a session without a store, an episode key's signature is never a
session's, and changing the admin key ends every session once the old key is no longer accepted
(``proxy/keyfile.py``: while a rotated key is listed or in its grace window, its sessions stay
valid; new ones are signed with the current key). A stolen cookie is a session until it expires
(``ttl_s``), not the key: logging out deletes the cookie, it cannot revoke a copy of it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Sequence

COOKIE = "fw_ui_session"
_VERSION = "v1"


def _secret(admin_key: str) -> bytes:
    return hashlib.sha256(b"flywheel-ui-session\0" + admin_key.encode()).digest()


class SessionTokens:
    def __init__(
        self,
        admin_keys: str | Callable[[], Sequence[str]],
        *,
        ttl_s: float = 12 * 3600,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``admin_keys``: the key, or a function giving the accepted keys, the current one first
        (``KeyRing.admin_keys``)."""
        self._keys = (lambda: (admin_keys,)) if isinstance(admin_keys, str) else admin_keys
        self._secrets: dict[str, bytes] = {}
        self.ttl_s = ttl_s
        self._clock = clock

    def _secrets_now(self) -> list[bytes]:
        keys = self._keys()
        if len(self._secrets) > 4 * len(keys):  # keys retired long ago leave the cache
            self._secrets = {k: v for k, v in self._secrets.items() if k in keys}
        return [self._secrets.setdefault(k, _secret(k)) for k in keys]

    @staticmethod
    def _signature(secret: bytes, body: str) -> str:
        digest = hmac.new(secret, body.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")

    def issue(self) -> str:
        """A new session token valid for ``ttl_s`` seconds, signed with the current key."""
        body = f"{_VERSION}.{int(self._clock() + self.ttl_s)}.{secrets.token_urlsafe(12)}"
        return f"{body}.{self._signature(self._secrets_now()[0], body)}"

    def valid(self, token: str | None) -> bool:
        """True for a token this key signed that has not expired (constant-time comparison)."""
        if not token or token.count(".") != 3:
            return False
        body, _, signature = token.rpartition(".")
        version, expires, _nonce = body.split(".")
        if version != _VERSION or not expires.isdigit():
            return False
        if not any(
            hmac.compare_digest(signature.encode(), self._signature(secret, body).encode())
            for secret in self._secrets_now()
        ):
            return False
        return int(expires) > self._clock()
