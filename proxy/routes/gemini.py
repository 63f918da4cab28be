"""``POST .../models/{model}:generateContent``, ``:streamGenerateContent`` and ``:countTokens``: Google's Gemini API.

A Gemini call runs as a recorded chat call (``proxy/dialects/gemini/``); errors answer in Google's
shape (``app.py``). Google's clients append ``/v1beta/models/...`` to their base URL
(``GOOGLE_GEMINI_BASE_URL`` for Gemini CLI), so an agent's base URL is the proxy's root or
``/episodes/<id>``: these routes are served under ``/v1beta`` beside each mount of ``mounts.py``
(``MOUNTS``), and under the mounts' own ``/v1`` (Google's ``v1`` API). The key is Google's:
``x-goog-api-key``, or the ``key`` query parameter (``deps.identify``), an episode key as anywhere.
``streamGenerateContent`` streams server-sent events with ``alt=sse`` (what Gemini CLI and the SDKs
send), else one JSON array sent piece by piece. ``countTokens`` renders the request with the
model's chat template on vLLM (``/tokenize``): the count is exactly the prompt the engine would see.
"""

from __future__ import annotations

import orjson
from fastapi import Request
from fastapi.responses import Response

from proxy.dialects.gemini import GeminiTranslation, count_tokens_chat
from proxy.routes.arrival import arrive, count_prompt
from proxy.routes.mounts import MOUNTS, ModelRoute, Mount

GEMINI_MOUNTS = tuple(
    Mount(m.prefix.removesuffix("/v1") + "/v1beta", recorded=m.recorded, episode_in_path=m.episode_in_path)
    for m in MOUNTS
)
"""``/v1beta``, ``/episodes/{episode_id}/v1beta``, ``/passthrough/v1beta``: Google's version beside each mount."""


async def _handle(request: Request, path_episode: str | None, *, recorded: bool, stream: bool) -> Response:
    model = request.path_params["model"]
    sse = request.query_params.get("alt") == "sse"
    async with arrive(request, path_episode, recorded=recorded, route="gemini") as call:
        svc = call.svc
        translation = GeminiTranslation.from_request(
            call.body, model, stream=stream, sse=sse, settings=svc.settings.compat
        )
    svc.metrics.on_compat("gemini", translation.ledger.counts())
    response = await svc.relay.respond(
        "chat", translation.chat, call.episode_id, translation, request.is_disconnected, side=call.side
    )
    if stream and not sse and response.headers.get("content-type", "").startswith("text/event-stream"):
        response.headers["content-type"] = "application/json"  # Google's array stream, not events
    return response


async def generate_content(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    return await _handle(request, path_episode, recorded=recorded, stream=False)


async def stream_generate_content(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    return await _handle(request, path_episode, recorded=recorded, stream=True)


async def count_tokens(request: Request, path_episode: str | None, *, recorded: bool) -> Response:
    model = request.path_params["model"]
    count = await count_prompt(
        request,
        path_episode,
        recorded=recorded,
        route="gemini",
        chat_of=lambda body, compat: count_tokens_chat(body, model, compat),
    )
    return Response(orjson.dumps({"totalTokens": count}), media_type="application/json")


ROUTES = (
    ModelRoute("POST", "/models/{model}:generateContent", generate_content, "google"),
    ModelRoute("POST", "/models/{model}:streamGenerateContent", stream_generate_content, "google"),
    ModelRoute("POST", "/models/{model}:countTokens", count_tokens, "google"),
)
"""Served on each mount (``mounts.py``) and on each of ``GEMINI_MOUNTS``."""
