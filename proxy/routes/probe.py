"""Connectivity probes: ``HEAD`` and ``GET`` on every base URL a client may be given answer 200.

Agent harnesses check that their base URL answers before the first model call: Claude Code
2.1.332 sends ``HEAD <ANTHROPIC_BASE_URL>/api/hello``, others probe the base URL itself, and a 404
or 405 there reads as "server down". No key is needed and nothing is looked up: the answer says
the proxy is up, not whether an episode exists. ``GET /episodes/{id}`` stays the admin API (one
episode with its calls); ``HEAD`` on it is the probe.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from proxy.routes.mounts import MOUNTS

router = APIRouter(tags=["ops"])

BASES = tuple(dict.fromkeys(base for mount in MOUNTS for base in (mount.prefix.removesuffix("/v1"), mount.prefix)))
"""Every base URL the proxy hands out or documents: each mount of the model routes (OpenAI SDKs)
and the URL above it (Anthropic SDKs, which append ``/v1/messages``): root, ``/v1``, their
episode-scoped and passthrough forms."""
_OK = b'{"status":"ok"}'


async def probe(request: Request) -> Response:
    return Response(b"" if request.method == "HEAD" else _OK, media_type="application/json")


for _base in BASES:
    for _path in (_base or "/", f"{_base}/api/hello"):
        _methods = ["HEAD"] if _path == "/episodes/{episode_id}" else ["GET", "HEAD"]
        router.add_api_route(_path, probe, methods=_methods, include_in_schema=False)
