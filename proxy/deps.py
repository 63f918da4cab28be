"""Request-scoped dependencies: the app's services, the caller's identity, and JSON bodies."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
from fastapi import Depends, Request

from proxy.auth import KeyRing, Principal, bearer
from proxy.errors import AuthenticationFailed, InvalidRequest, PayloadTooLarge, PermissionDenied
from proxy.gate import EpisodeGate
from proxy.metrics import Metrics
from proxy.policy import PolicyRouter
from proxy.recorder import Recorder
from proxy.sampling import SamplingDefaults
from proxy.settings import Settings
from proxy.splice import Splicer
from proxy.store.repository import Repository
from proxy.upstream import Upstreams


@dataclass
class Services:
    """Everything a route needs, built once per app in the lifespan."""

    settings: Settings
    repo: Repository
    upstreams: Upstreams
    router: PolicyRouter
    recorder: Recorder
    keys: KeyRing
    gate: EpisodeGate
    metrics: Metrics
    sampling: SamplingDefaults
    """The model's defaults for omitted sampling fields (``proxy/sampling.py``)."""
    splicer: Splicer | None = None
    """Token-in-token-out follow-up calls (``proxy/splice.py``); None when ``splice.enabled`` is off."""
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    """Tasks that outlive their request (e.g. recording a disconnected stream); drained on shutdown."""


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services  # Starlette's State holds Any
    return services


async def services(request: Request) -> Services:
    """Dependency form of ``services_of`` (async: a sync dependency costs a thread hop per request)."""
    return services_of(request)


def identify(request: Request) -> Principal:
    """Any valid key (model routes); 401 for a missing or wrong key."""
    headers = request.headers
    key = bearer(headers.get("authorization"), headers.get("api-key") or headers.get("x-api-key"))
    found = services_of(request).keys.identify(key)
    if found is None:
        message = "missing API key (Authorization: Bearer <key>)" if not key else "invalid API key"
        raise AuthenticationFailed(message, code="invalid_api_key")
    return found


async def admin(request: Request) -> Principal:
    """The admin key only: rewards, groups, publishing, the trainer API."""
    found = identify(request)
    if found.role != "admin":
        raise PermissionDenied("this route needs the admin key; agent and episode keys reach the model only",
                               code="admin_only")
    return found


ServicesDep = Annotated[Services, Depends(services)]
AdminDep = Annotated[Principal, Depends(admin)]


async def json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """Read and parse a JSON object body; orjson refuses NaN/Infinity, which JSON does not have."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {max_bytes}")
    raw = await request.body()
    if len(raw) > max_bytes:
        raise PayloadTooLarge(f"request body exceeds {max_bytes} bytes")
    if not raw:
        raise InvalidRequest("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object")
    return body
