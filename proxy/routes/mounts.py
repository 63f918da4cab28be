"""The three mounts of the model routes: each handler written once, served under every base URL.

``/v1`` takes the episode from a header or the episode key, ``/episodes/{episode_id}/v1`` from
the base URL, and ``/passthrough/v1`` records nothing (user simulators, judges). ``model_router``
builds one router per mount from the handlers of ``chat.py``, ``responses.py`` and
``messages.py``; ``app.py`` includes it under the mount's prefix. A handler is told where it was
called (the path's episode, recorded or not) as plain arguments: model routes check the key
inside the handler (``identify``), not through FastAPI's dependency machinery, so the hottest path
costs one plain call more than the handler itself, as it did when each mount had its own function.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Literal, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import Response


@dataclass(frozen=True)
class Mount:
    """One base URL the model routes are served under."""

    prefix: str
    recorded: bool
    """Whether its calls are recorded on an episode (passthrough: no)."""
    episode_in_path: bool
    """Whether the base URL names the episode (``{episode_id}``)."""


MOUNTS = (
    Mount("/v1", recorded=True, episode_in_path=False),
    Mount("/episodes/{episode_id}/v1", recorded=True, episode_in_path=True),
    Mount("/passthrough/v1", recorded=False, episode_in_path=False),
)


class Handler(Protocol):
    """A model route's handler: the request, the episode its path names (None: none) and whether
    the mount records its calls."""

    __name__: str

    async def __call__(self, request: Request, path_episode: str | None, *, recorded: bool) -> Response: ...


@dataclass(frozen=True)
class ModelRoute:
    """A model route as every mount serves it: ``path`` is under the mount (``/chat/completions``)."""

    method: Literal["GET", "POST"]
    path: str
    handler: Handler
    tag: Literal["openai", "anthropic", "google"]


def model_router(mount: Mount, routes: Iterable[ModelRoute]) -> APIRouter:
    """The routes under ``mount`` (to include with ``prefix=mount.prefix``)."""
    router = APIRouter()
    for route in routes:
        endpoint = _endpoint(route.handler, mount)
        router.add_api_route(
            route.path, endpoint, methods=[route.method], name=route.handler.__name__, tags=[route.tag]
        )
    return router


def _endpoint(handler: Handler, mount: Mount) -> Callable[..., Awaitable[Response]]:
    """The handler as FastAPI calls it: ``episode_id`` is a declared path parameter (and so in the
    OpenAPI schema) where the mount's base URL names the episode."""
    recorded = mount.recorded
    if mount.episode_in_path:

        async def in_episode(episode_id: str, request: Request) -> Response:
            return await handler(request, episode_id, recorded=recorded)

        return in_episode

    async def plain(request: Request) -> Response:
        return await handler(request, None, recorded=recorded)

    return plain
