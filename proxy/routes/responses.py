"""``POST /v1/responses`` on the three mounts (``mounts.py``), run as a recorded chat call (``dialects/responses/``).

``previous_response_id`` names an earlier answer of the same episode, resolved from the store:
a response the store does not hold (or made with ``store: false``) is a 404, one of another
episode a 403; passthrough calls are not stored, so they cannot continue one.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import Response

from proxy.compat import Ledger
from proxy.deps import Services
from proxy.dialects.responses import ResponsesTranslation, history_of, parse
from proxy.errors import InvalidRequest, NotFound, PermissionDenied
from proxy.routes.arrival import arrive
from proxy.routes.mounts import ModelRoute


async def _history(svc: Services, response_id: str, episode_id: str | None) -> list[dict[str, Any]]:
    if episode_id is None:
        raise InvalidRequest(
            "'previous_response_id' needs a recorded episode; passthrough answers are not stored",
            param="previous_response_id",
        )
    call = await svc.repo.calls.by_response_id(response_id, episode_id)
    if call is None or call.api != "responses" or (call.client_request or {}).get("store") is False:
        raise NotFound(
            f"no stored response '{response_id}' (answers made with store: false are not kept)",
            param="previous_response_id",
            code="previous_response_not_found",
        )
    if call.episode_id != episode_id:
        raise PermissionDenied(
            f"response '{response_id}' belongs to another episode",
            param="previous_response_id",
            code="previous_response_of_another_episode",
        )
    return history_of(call)


async def _handle(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    async with arrive(request, path_episode, recorded=recorded, route="responses") as call:
        svc, ledger = call.svc, Ledger(call.svc.settings.compat)
        parsed = parse(call.body, ledger)
        previous = parsed.previous_response_id
        history = await _history(svc, previous, call.episode_id) if previous else []
        translation = ResponsesTranslation(parsed, call.body, history, ledger)
    svc.metrics.on_compat("responses", ledger.counts())
    return await svc.relay.respond(
        "chat", translation.chat, call.episode_id, translation, request.is_disconnected, side=call.side
    )


async def responses(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    return await _handle(request, path_episode, recorded=recorded)


ROUTES = (ModelRoute("POST", "/responses", responses, "openai"),)
"""Served on each mount (``mounts.py``)."""
