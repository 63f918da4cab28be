"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` on the three mounts (``mounts.py``): Anthropic.

A message call runs as a recorded chat call (``proxy/dialects/messages/``); errors answer in
Anthropic's shape (``app.py``), and ``x-api-key`` is accepted as everywhere. The Anthropic SDKs
append ``/v1/messages`` to their base URL, so an agent's base URL is the proxy's root or
``/episodes/<id>``. ``count_tokens`` renders the request with the model's chat template on vLLM
(``/tokenize``): the count is exactly the prompt the engine would see.
"""

from __future__ import annotations

import orjson
from fastapi import Request
from fastapi.responses import Response

from proxy.answers import json_object, malformed
from proxy.deps import episode_of, identify, json_body, services_of
from proxy.dialects.messages import MessagesTranslation, count_tokens_chat
from proxy.errors import FlywheelError
from proxy.refusals import refused
from proxy.routes.arrival import arrive
from proxy.routes.mounts import ModelRoute
from proxy.upstream import answer_error


async def _handle(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    async with arrive(request, path_episode, recorded=recorded, route="messages") as call:
        svc = call.svc
        translation = MessagesTranslation.from_request(call.body, svc.settings.compat)
    svc.metrics.on_compat("messages", translation.ledger.counts())
    return await svc.relay.respond(
        "chat", translation.chat, call.episode_id, translation, request.is_disconnected, side=call.side
    )


async def _count_tokens(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    svc = services_of(request)
    try:  # not a model call: a refusal is logged and counted, not recorded
        await episode_of(request, svc, identify(request), path_episode, recorded=recorded)
        body = await json_body(request, svc.settings.max_body_bytes)
        chat = count_tokens_chat(body, svc.settings.compat)
    except FlywheelError as exc:
        await refused(svc.metrics, svc.recorder, exc, route="messages")
        raise
    chat["model"], _ = svc.adapters.resolve(chat["model"])
    replica = svc.upstreams.pick(None)
    response = await svc.upstreams.send(replica, "POST", "/tokenize", content=orjson.dumps(chat))
    if response.status_code >= 400:
        raise answer_error(response.status_code, response.content, replica)
    count = json_object(response.content, replica.name).get("count")
    if type(count) is not int or count < 0:
        raise malformed(replica.name, f"/tokenize answered the count {count!r}")
    return Response(orjson.dumps({"input_tokens": count}), media_type="application/json")


async def messages(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    return await _handle(request, path_episode, recorded=recorded)


async def count_tokens(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    return await _count_tokens(request, path_episode, recorded=recorded)


ROUTES = (
    ModelRoute("POST", "/messages", messages, "anthropic"),
    ModelRoute("POST", "/messages/count_tokens", count_tokens, "anthropic"),
)
"""Served on each mount (``mounts.py``)."""
