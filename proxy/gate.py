"""Which episode a model call belongs to, and whether it may still make calls.

An agent names its episode in one of four ways, so any agent works unchanged: the episode-scoped
base URL (``/episodes/<id>/v1``), ``X-Episode-Id``, OpenHands' ``x-litellm-session-id``
(conversation id = episode id), or its per-episode API key. The open/closed check is cached
briefly: it sits on the hot path, and it is only a first filter. The store checks again inside the
transaction that writes the call, so a call that finishes after its episode was rewarded (in flight
meanwhile, or let in by this cache or another proxy's) is refused there, never stored.
"""

from __future__ import annotations

import time
import uuid

from starlette.datastructures import Headers

from proxy.auth import Principal
from proxy.errors import EpisodeClosed, InvalidRequest, MissingEpisode, NotFound, PermissionDenied
from proxy.store.repository import Repository

EPISODE_HEADERS = ("x-episode-id", "x-litellm-session-id")
SIDE_HEADER = "x-flywheel-side-of"
"""On ``/passthrough/v1``: the episode an unrecorded-by-default call (a user simulator's) belongs
beside. It is then recorded on that episode as a side call, never trained (``proxy/relay.py``), so
the episode page shows it and a fork replays it (``proxy/replay.py``)."""


def canonical_id(raw: str, *, param: str = "episode_id") -> str:
    try:
        return str(uuid.UUID(raw))
    except (ValueError, AttributeError, TypeError):
        raise InvalidRequest(f"{raw!r} is not an episode id (a UUID)", param=param) from None


def side_episode(headers: Headers, principal: Principal) -> str | None:
    """The episode a passthrough call names with ``X-Flywheel-Side-Of`` (None: none); an episode key
    may only name its own."""
    named = headers.get(SIDE_HEADER)
    if not named:
        return None
    episode_id = canonical_id(named, param=SIDE_HEADER)
    if principal.episode_id is not None and principal.episode_id != episode_id:
        raise PermissionDenied("this API key belongs to another episode", code="wrong_episode")
    return episode_id


def identify_episode(headers: Headers, path_episode: str | None, principal: Principal) -> str:
    """The episode a call belongs to; an episode key may only ever name its own episode."""
    named = path_episode
    if named is None:
        for header in EPISODE_HEADERS:
            if headers.get(header):
                named = headers[header]
                break
    if named is None:
        if principal.episode_id is None:
            raise MissingEpisode(
                "this call names no episode: use the base URL /episodes/<id>/v1, the X-Episode-Id header, "
                "or the episode's API key (unrecorded calls go to /passthrough/v1)",
                code="missing_episode",
            )
        return principal.episode_id
    episode_id = canonical_id(named)
    if principal.episode_id is not None and principal.episode_id != episode_id:
        raise PermissionDenied("this API key belongs to another episode", code="wrong_episode")
    return episode_id


class EpisodeGate:
    def __init__(self, repo: Repository, *, ttl_s: float = 2.0, max_entries: int = 100_000) -> None:
        self._repo = repo
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._open: dict[str, float] = {}  # episode id -> when it was last seen open

    async def check_open(self, episode_id: str) -> None:
        seen = self._open.get(episode_id)
        now = time.monotonic()
        if seen is not None and now - seen < self._ttl_s:
            return
        state = await self._repo.episodes.episode_state(episode_id)
        if state is None:
            self._open.pop(episode_id, None)
            raise NotFound(f"episode {episode_id} not found", param="episode_id", code="episode_not_found")
        if state[0] != "open":
            self._open.pop(episode_id, None)
            raise EpisodeClosed(
                f"episode {episode_id} is {state[0]}; it takes no more model calls", code="episode_closed"
            )
        if len(self._open) >= self._max_entries:
            self._open.clear()
        self._open[episode_id] = now

    def closed(self, episode_id: str) -> None:
        self._open.pop(episode_id, None)
