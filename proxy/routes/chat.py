"""The OpenAI surface: chat completions, completions and models, recorded per episode.

Three mounts of the same handlers: ``/v1`` (episode from a header or the episode key),
``/episodes/{id}/v1`` (episode in the base URL) and ``/passthrough/v1`` (unrecorded: user
simulators and judges). A route validates the body and finds the episode; the relay
(``proxy/relay.py``) runs and records the call.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from contract.vocabulary import CallApi, CallKind
from proxy.deps import episode_of, identify, json_body, services_of
from proxy.errors import FlywheelError, InvalidRequest
from proxy.gate import canonical_id, identify_episode
from proxy.refusals import refused

router = APIRouter(tags=["openai"])


def _validate(body: dict[str, Any], kind: CallKind) -> None:
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' is required and must be a non-empty array", param="messages")
    elif "prompt" not in body or body["prompt"] in (None, "", []):
        raise InvalidRequest("'prompt' is required", param="prompt")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")


async def _handle(request: Request, kind: CallKind, path_episode: str | None, *, recorded: bool) -> Response:
    svc = services_of(request)
    body: dict[str, Any] | None = None
    episode_id: str | None = None
    try:
        episode_id = await episode_of(request, svc, identify(request), path_episode, recorded=recorded)
        body = await json_body(request, svc.settings.max_body_bytes)
        _validate(body, kind)
    except FlywheelError as exc:  # a refusal is logged, counted and recorded on its episode
        route: CallApi = "chat" if kind == "chat" else "completions"
        await refused(svc.metrics, svc.recorder, exc, route=route, kind=kind, episode_id=episode_id, body=body)
        raise
    return await svc.relay.respond(kind, body, episode_id, client_gone=request.is_disconnected)


async def _models(request: Request) -> Response:
    svc = services_of(request)
    replica = svc.upstreams.pick(None)
    models = await svc.upstreams.list_models(replica)
    current = svc.policies.current
    for alias in svc.policies.settings.aliases:
        models.append(
            {
                "id": alias,
                "object": "model",
                "owned_by": "flywheel",
                "created": int(time.time()),
                "parent": svc.policies.settings.base_model,
                "root": current.name if current else svc.policies.settings.base_model,
                "policy_version": current.version if current else 0,
            }
        )
    return Response(orjson.dumps({"object": "list", "data": models}), media_type="application/json")


# Model routes check the key inside the handler (``identify``), not through FastAPI's dependency
# machinery: one plain call on the hottest path.


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _handle(request, "chat", None, recorded=True)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _handle(request, "completion", None, recorded=True)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    identify(request)
    return await _models(request)


@router.post("/episodes/{episode_id}/v1/chat/completions")
async def episode_chat_completions(episode_id: str, request: Request) -> Response:
    return await _handle(request, "chat", episode_id, recorded=True)


@router.post("/episodes/{episode_id}/v1/completions")
async def episode_completions(episode_id: str, request: Request) -> Response:
    return await _handle(request, "completion", episode_id, recorded=True)


@router.get("/episodes/{episode_id}/v1/models")
async def episode_models(episode_id: str, request: Request) -> Response:
    who = identify(request)
    identify_episode(request.headers, canonical_id(episode_id), who)
    return await _models(request)


@router.post("/passthrough/v1/chat/completions")
async def passthrough_chat(request: Request) -> Response:
    return await _handle(request, "chat", None, recorded=False)


@router.post("/passthrough/v1/completions")
async def passthrough_completions(request: Request) -> Response:
    return await _handle(request, "completion", None, recorded=False)


@router.get("/passthrough/v1/models")
async def passthrough_models(request: Request) -> Response:
    identify(request)
    return await _models(request)
