"""What every model route does first: the key, the episode, the body, and a refusal made visible.

Chat, completions, Responses and Messages read a call the same way before their own translation:
the key (``identify``), the open episode it belongs to (``episode_of``), the JSON body. Anything
refused on the way, there or in the route's own validation inside the same block, is logged,
counted and recorded as a failed call on its episode (``refusals.py``) before the client gets its
4xx, so no refused call is invisible.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from fastapi import Request

from contract.vocabulary import CallApi, CallKind
from proxy.answers import json_object, malformed
from proxy.deps import Services, episode_of, identify, json_body, services_of
from proxy.errors import FlywheelError
from proxy.refusals import refused
from proxy.settings import CompatSettings
from proxy.upstream import answer_error


@dataclass
class Arrival:
    """A model call as far as it was read: its services, its episode (None: passthrough or not yet
    known) and its body (empty until read: a refusal before it records an empty request)."""

    svc: Services
    episode_id: str | None = None
    body: dict[str, Any] = field(default_factory=dict)
    side: bool = False
    """A passthrough call recorded beside its episode (``gate.SIDE_HEADER``): never trained."""


@asynccontextmanager
async def arrive(
    request: Request, path_episode: str | None, *, recorded: bool, route: CallApi, kind: CallKind = "chat"
) -> AsyncIterator[Arrival]:
    """Read the key, the episode and the body; a ``FlywheelError`` raised here or inside the block
    is made visible (``refused``) and re-raised."""
    arrival = Arrival(services_of(request))
    svc = arrival.svc
    try:
        arrival.episode_id = await episode_of(request, svc, identify(request), path_episode, recorded=recorded)
        arrival.side = not recorded and arrival.episode_id is not None
        arrival.body = await json_body(request, svc.settings.max_body_bytes)
        yield arrival
    except FlywheelError as exc:
        episode_id, body = arrival.episode_id, arrival.body
        await refused(svc.metrics, svc.recorder, exc, route=route, kind=kind, episode_id=episode_id, body=body)
        raise


async def count_prompt(
    request: Request,
    path_episode: str | None,
    *,
    recorded: bool,
    route: CallApi,
    chat_of: Callable[[dict[str, Any], CompatSettings], dict[str, Any]],
) -> int:
    """The prompt tokens a would-be call of the route's API holds, as the engine renders it (vLLM's
    ``/tokenize`` with the chat template): Anthropic's ``count_tokens`` and Google's ``countTokens``.
    Not a model call: read like one (key, episode, body), but a refusal is logged and counted, not
    recorded, and nothing is recorded when it is answered. ``chat_of`` makes the chat body."""
    svc = services_of(request)
    try:
        await episode_of(request, svc, identify(request), path_episode, recorded=recorded)
        chat = chat_of(await json_body(request, svc.settings.max_body_bytes), svc.settings.compat)
    except FlywheelError as exc:
        await refused(svc.metrics, svc.recorder, exc, route=route)
        raise
    chat["model"], _ = svc.adapters.resolve(chat["model"])
    replica = svc.upstreams.pick(None)
    response = await svc.upstreams.send(replica, "POST", "/tokenize", content=orjson.dumps(chat))
    if response.status_code >= 400:
        raise answer_error(response.status_code, response.content, replica)
    count = json_object(response.content, replica.name).get("count")
    if type(count) is not int or count < 0:
        raise malformed(replica.name, f"/tokenize answered the count {count!r}")
    return count
