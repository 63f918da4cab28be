"""API keys: who may call what.

Three kinds of key, checked in constant time:

- the admin key (settings): everything, including rewards, publishing and the trainer API;
- agent keys (settings): the model routes of any episode and the passthrough route, nothing else;
- episode keys, minted per episode: ``fw-ep-<episode id>-<signature>``. The signature is an HMAC of
  the episode id under a secret derived from the admin key, so any proxy replica verifies a key
  without a database read, and an agent holding one can reach its own episode's model calls only:
  never another episode, never a reward.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from dataclasses import dataclass
from typing import Literal

EPISODE_KEY_PREFIX = "fw-ep-"
_UUID_LEN = 36

Role = Literal["admin", "agent", "episode"]


@dataclass(frozen=True, slots=True)
class Principal:
    role: Role
    episode_id: str | None = None
    """For an episode key: the only episode it may act for."""


class KeyRing:
    def __init__(self, admin_key: str, agent_keys: list[str]) -> None:
        self._admin = admin_key.encode()
        self._agents = [k.encode() for k in agent_keys]
        self._secret = hashlib.sha256(b"flywheel-episode-keys\0" + self._admin).digest()

    def _signature(self, episode_id: str) -> str:
        digest = hmac.new(self._secret, episode_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest[:24]).decode()

    def episode_key(self, episode_id: str) -> str:
        return f"{EPISODE_KEY_PREFIX}{episode_id}-{self._signature(episode_id)}"

    def identify(self, key: str | None) -> Principal | None:
        """The principal a presented key stands for, or None for a missing or wrong key."""
        if not key:
            return None
        raw = key.encode()
        if hmac.compare_digest(raw, self._admin):
            return Principal("admin")
        if key.startswith(EPISODE_KEY_PREFIX):
            body = key[len(EPISODE_KEY_PREFIX) :]
            episode_id, signature = body[:_UUID_LEN], body[_UUID_LEN + 1 :]
            if hmac.compare_digest(signature.encode(), self._signature(episode_id).encode()):
                return Principal("episode", episode_id)
            return None
        if any(hmac.compare_digest(raw, agent) for agent in self._agents):
            return Principal("agent")
        return None


def bearer(authorization: str | None, api_key_header: str | None = None) -> str | None:
    """The key from ``Authorization: Bearer <key>`` (OpenAI SDKs) or ``api-key``/``x-api-key``."""
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return api_key_header or None
