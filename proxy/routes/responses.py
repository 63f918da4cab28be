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
from proxy.deps import Services, episode_of, identify, json_body, services_of
from proxy.dialects.responses import ResponsesTranslation, history_of, parse
from proxy.errors import FlywheelError, InvalidRequest, NotFound, PermissionDenied
from proxy.refusals import refused
from proxy.routes.mounts import ModelRoute


async def _history(svc: Services, response_id: str, episode_id: str | None) -> list[dict[str, Any]]:
    if episode_id is None:
        raise InvalidRequest(
            "'previous_response_id' needs a recorded episode; passthrough answers are not stored",
            param="previous_response_id",
        )
    call = await svc.repo.calls.by_response_id(response_id)
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
    svc = services_of(request)
    body: dict[str, Any] | None = None
    episode_id: str | None = None
    try:
        episode_id = await episode_of(request, svc, identify(request), path_episode, recorded=recorded)
        body = await json_body(request, svc.settings.max_body_bytes)
        ledger = Ledger(svc.settings.compat)
        parsed = parse(body, ledger)
        previous = parsed.previous_response_id
        history = await _history(svc, previous, episode_id) if previous else []
        translation = ResponsesTranslation(parsed, body, history, ledger)
    except FlywheelError as exc:  # a refusal is logged, counted and recorded on its episode
        await refused(svc.metrics, svc.recorder, exc, route="responses", episode_id=episode_id, body=body)
        raise
    svc.metrics.on_compat("responses", ledger.counts())
    return await svc.relay.respond("chat", translation.chat, episode_id, translation, request.is_disconnected)


async def responses(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    return await _handle(request, path_episode, recorded=recorded)


ROUTES = (ModelRoute("POST", "/responses", responses, "openai"),)
"""Served on each mount (``mounts.py``)."""
