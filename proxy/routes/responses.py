"""``POST /v1/responses`` on the three mounts, run as a recorded chat call (``proxy/dialects/responses.py``).

``previous_response_id`` names an earlier answer of the same episode, resolved from the store:
a response the store does not hold (or made with ``store: false``) is a 404, one of another
episode a 403; passthrough calls are not stored, so they cannot continue one.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from proxy.deps import Services, episode_of, read_call
from proxy.dialects.responses import ResponsesTranslation, history_of, parse
from proxy.errors import InvalidRequest, NotFound, PermissionDenied

router = APIRouter(tags=["openai"])


async def _history(svc: Services, response_id: str, episode_id: str | None) -> list[dict[str, Any]]:
    if episode_id is None:
        raise InvalidRequest(
            "'previous_response_id' needs a recorded episode; passthrough answers are not stored",
            param="previous_response_id",
        )
    call = await svc.repo.call_by_response_id(response_id)
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
    who, svc, body = await read_call(request)
    parsed = parse(body)
    episode_id = await episode_of(request, svc, who, path_episode, recorded=recorded)
    history = await _history(svc, parsed.previous_response_id, episode_id) if parsed.previous_response_id else []
    translation = ResponsesTranslation(parsed, body, history)
    return await svc.relay.respond("chat", translation.chat, episode_id, translation)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    return await _handle(request, None, recorded=True)


@router.post("/episodes/{episode_id}/v1/responses")
async def episode_responses(episode_id: str, request: Request) -> Response:
    return await _handle(request, episode_id, recorded=True)


@router.post("/passthrough/v1/responses")
async def passthrough_responses(request: Request) -> Response:
    return await _handle(request, None, recorded=False)
