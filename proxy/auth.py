"""API keys: who may call what.

Three kinds of key, checked in constant time:

- the admin key (settings, or the key file): everything, including rewards, publishing and the
  trainer API;
- agent keys (settings): the model routes of any episode and the passthrough route, nothing else;
- episode keys, minted per episode: ``fw-ep-<episode id>-<signature>``. The signature is an HMAC of
  the episode id under a secret derived from the admin key, so any proxy replica verifies a key
  without a database read, and an agent holding one can reach its own episode's model calls only:
  never another episode, never a reward.

Rotation (``proxy/keyfile.py`` reads the file): the ring holds the listed admin keys, the first
one current (new episode keys and dashboard sessions are signed with it) and the rest still
accepted, plus retired keys, no longer listed, accepted until their grace window ends. An episode
key is verified under every accepted admin key, so episodes running when the key changed keep
working while the key they were signed with is listed or in its window.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Callable, Iterator, Sequence
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
    retiring: bool = False
    """Accepted under an admin key that has left the key file and works only until its grace window ends."""


class _AdminKey:
    """One admin key and the episode-key secret derived from it."""

    __slots__ = ("raw", "_episode_secret")

    def __init__(self, key: str) -> None:
        self.raw = key.encode()
        self._episode_secret = hashlib.sha256(b"flywheel-episode-keys\0" + self.raw).digest()

    def signature(self, episode_id: str) -> str:
        digest = hmac.new(self._episode_secret, episode_id.encode(), hashlib.sha256).digest()
        return base64.urlsafe_b64encode(digest[:24]).decode()


class KeyRing:
    def __init__(
        self,
        admin_key: str | Sequence[str],
        agent_keys: list[str],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``admin_key``: one key, or the key file's keys, the current one first."""
        listed = [admin_key] if isinstance(admin_key, str) else list(admin_key)
        if not listed:
            raise ValueError("at least one admin key is needed")
        self._listed = [_AdminKey(k) for k in listed]
        self._retired: list[tuple[_AdminKey, float]] = []
        """Keys no longer listed, each with the monotonic time its grace window ends."""
        self._agents = [k.encode() for k in agent_keys]
        self._clock = clock

    def replace(self, admin_keys: Sequence[str], *, grace_s: float) -> int:
        """The key file changed: ``admin_keys[0]`` is the admin key from now on, the others stay
        accepted, and each key that was accepted but is no longer listed keeps working for
        ``grace_s`` seconds (a key retired earlier keeps its own deadline). Returns how many keys
        were retired by this change."""
        if not admin_keys:
            raise ValueError("at least one admin key is needed")
        now = self._clock()
        new = [_AdminKey(k) for k in admin_keys]
        listed = {k.raw for k in new}
        retired = [(k, until) for k, until in self._retired if k.raw not in listed and until > now]
        leaving = [k for k in self._listed if k.raw not in listed]
        if grace_s > 0:
            retired += [(k, now + grace_s) for k in leaving]
        self._listed, self._retired = new, retired
        return len(leaving)

    def _accepted(self) -> Iterator[tuple[_AdminKey, bool]]:
        """Every admin key a presented key may be checked against, and whether it is retiring."""
        yield from ((k, False) for k in self._listed)
        if self._retired:
            now = self._clock()
            self._retired = [(k, until) for k, until in self._retired if until > now]
            yield from ((k, True) for k, _ in self._retired)

    def admin_keys(self) -> list[str]:
        """The admin keys accepted now, the current one first (the dashboard derives its session
        secrets from them)."""
        return [k.raw.decode() for k, _ in self._accepted()]

    @property
    def retiring(self) -> int:
        """Retired keys still in their grace window."""
        return sum(1 for _, retiring in self._accepted() if retiring)

    def episode_key(self, episode_id: str) -> str:
        """The key of an episode, signed with the current admin key."""
        return f"{EPISODE_KEY_PREFIX}{episode_id}-{self._listed[0].signature(episode_id)}"

    def identify(self, key: str | None) -> Principal | None:
        """The principal a presented key stands for, or None for a missing or wrong key."""
        if not key:
            return None
        raw = key.encode()
        accepted = list(self._accepted())
        for admin, retiring in accepted:
            if hmac.compare_digest(raw, admin.raw):
                return Principal("admin", retiring=retiring)
        if key.startswith(EPISODE_KEY_PREFIX):
            body = key[len(EPISODE_KEY_PREFIX) :]
            episode_id, signature = body[:_UUID_LEN], body[_UUID_LEN + 1 :]
            for admin, retiring in accepted:
                if hmac.compare_digest(signature.encode(), admin.signature(episode_id).encode()):
                    return Principal("episode", episode_id, retiring)
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
