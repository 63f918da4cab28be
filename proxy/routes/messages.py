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

from proxy.dialects.messages import MessagesTranslation, count_tokens_chat
from proxy.routes.arrival import arrive, count_prompt
from proxy.routes.mounts import ModelRoute


async def _handle(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    async with arrive(request, path_episode, recorded=recorded, route="messages") as call:
        svc = call.svc
        translation = MessagesTranslation.from_request(call.body, svc.settings.compat)
    svc.metrics.on_compat("messages", translation.ledger.counts())
    return await svc.relay.respond(
        "chat", translation.chat, call.episode_id, translation, request.is_disconnected, side=call.side
    )


async def messages(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    return await _handle(request, path_episode, recorded=recorded)


async def count_tokens(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    count = await count_prompt(request, path_episode, recorded=recorded, route="messages", chat_of=count_tokens_chat)
    return Response(orjson.dumps({"input_tokens": count}), media_type="application/json")


ROUTES = (
    ModelRoute("POST", "/messages", messages, "anthropic"),
    ModelRoute("POST", "/messages/count_tokens", count_tokens, "anthropic"),
)
"""Served on each mount (``mounts.py``)."""
