"""``POST /v1/messages`` and ``/v1/messages/count_tokens`` on the three mounts (Anthropic Messages API).

A message call runs as a recorded chat call (``proxy/dialects/messages.py``); errors answer in
Anthropic's shape (``app.py``), and ``x-api-key`` is accepted as everywhere. The Anthropic SDKs
append ``/v1/messages`` to their base URL, so an agent's base URL is the proxy's root or
``/episodes/<id>``. ``count_tokens`` renders the request with the model's chat template on vLLM
(``/tokenize``): the count is exactly the prompt the engine would see.
"""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from proxy.answers import json_object, malformed
from proxy.deps import episode_of, read_call
from proxy.dialects.messages import MessagesTranslation, count_tokens_chat
from proxy.upstream import answer_error

router = APIRouter(tags=["anthropic"])


async def _handle(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    who, svc, body = await read_call(request)
    translation = MessagesTranslation.from_request(body)
    episode_id = await episode_of(request, svc, who, path_episode, recorded=recorded)
    return await svc.relay.respond("chat", translation.chat, episode_id, translation)


async def _count_tokens(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    who, svc, body = await read_call(request)
    chat = count_tokens_chat(body)
    await episode_of(request, svc, who, path_episode, recorded=recorded)
    chat["model"], _ = svc.policies.resolve(chat["model"])
    replica = svc.upstreams.pick(None)
    response = await svc.upstreams.send(replica, "POST", "/tokenize", content=orjson.dumps(chat))
    if response.status_code >= 400:
        raise answer_error(response.status_code, response.content, replica)
    count = json_object(response.content, replica.name).get("count")
    if type(count) is not int or count < 0:
        raise malformed(replica.name, f"/tokenize answered the count {count!r}")
    return Response(orjson.dumps({"input_tokens": count}), media_type="application/json")


@router.post("/v1/messages")
async def messages(request: Request) -> Response:
    return await _handle(request, None, recorded=True)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    return await _count_tokens(request, None, recorded=True)


@router.post("/episodes/{episode_id}/v1/messages")
async def episode_messages(episode_id: str, request: Request) -> Response:
    return await _handle(request, episode_id, recorded=True)


@router.post("/episodes/{episode_id}/v1/messages/count_tokens")
async def episode_count_tokens(episode_id: str, request: Request) -> Response:
    return await _count_tokens(request, episode_id, recorded=True)


@router.post("/passthrough/v1/messages")
async def passthrough_messages(request: Request) -> Response:
    return await _handle(request, None, recorded=False)


@router.post("/passthrough/v1/messages/count_tokens")
async def passthrough_count_tokens(request: Request) -> Response:
    return await _count_tokens(request, None, recorded=False)
