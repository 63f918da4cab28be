"""The OpenAI surface: chat completions, completions and models, recorded per episode.

Each handler is served on the three mounts (``mounts.py``): ``/v1`` (episode from a header or the
episode key), ``/episodes/{id}/v1`` (episode in the base URL) and ``/passthrough/v1`` (unrecorded:
user simulators and judges). A route validates the body and finds the episode; the relay
(``proxy/relay.py``) runs and records the call.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from contract.vocabulary import CallApi, CallKind
from proxy.deps import identify, services_of
from proxy.errors import InvalidRequest
from proxy.gate import canonical_id, identify_episode
from proxy.routes.arrival import arrive
from proxy.routes.mounts import ModelRoute


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
    route: CallApi = "chat" if kind == "chat" else "completions"
    async with arrive(request, path_episode, recorded=recorded, route=route, kind=kind) as call:
        _validate(call.body, kind)
    return await call.svc.relay.respond(
        kind, call.body, call.episode_id, client_gone=request.is_disconnected, side=call.side
    )


async def _models(request: Request) -> Response:
    svc = services_of(request)
    replica = svc.upstreams.pick(None)
    models = await svc.upstreams.list_models(replica)
    current = svc.adapters.current
    # vLLM lists its context length on each model it serves; the aliases carry it too, so a client
    # that reads the window from the model list (rather than assuming one for an unknown name) sees it
    window = next((m["max_model_len"] for m in models if isinstance(m, dict) and m.get("max_model_len")), None)
    for alias in svc.adapters.settings.aliases:
        entry = {
            "id": alias,
            "object": "model",
            "owned_by": "flywheel",
            "created": int(time.time()),
            "parent": svc.adapters.settings.base_model,
            "root": current.name if current else svc.adapters.settings.base_model,
            "policy_version": svc.adapters.version,
        }
        models.append(entry if window is None else {**entry, "max_model_len": window})
    return Response(orjson.dumps({"object": "list", "data": models}), media_type="application/json")


async def chat_completions(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    return await _handle(request, "chat", path_episode, recorded=recorded)


async def completions(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    return await _handle(request, "completion", path_episode, recorded=recorded)


async def models(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    """The served models and the policy aliases; under an episode's base URL, an episode key may
    only list under its own episode."""
    who = identify(request)
    if path_episode is not None:
        identify_episode(request.headers, canonical_id(path_episode), who)
    return await _models(request)


ROUTES = (
    ModelRoute("POST", "/chat/completions", chat_completions, "openai"),
    ModelRoute("POST", "/completions", completions, "openai"),
    ModelRoute("GET", "/models", models, "openai"),
)
"""Served on each mount (``mounts.py``)."""
