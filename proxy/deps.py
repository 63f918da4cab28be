"""Request-scoped dependencies: the app's services, the caller's identity and episode, and JSON bodies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from fastapi import Depends, Request

from proxy.adapters import AdapterTable
from proxy.admission import Admission
from proxy.auth import KeyRing, Principal, bearer
from proxy.depth import MAX_DEPTH, too_deep
from proxy.dialects.gemini.errors import speaks_gemini
from proxy.errors import AuthenticationFailed, InvalidRequest, PayloadTooLarge, PermissionDenied
from proxy.gate import EpisodeGate, canonical_id, identify_episode, side_episode
from proxy.metrics import Metrics
from proxy.recorder import Recorder
from proxy.relay import Relay
from proxy.settings import Settings
from proxy.store.repository import Repository
from proxy.throttle import FailedAuth
from proxy.upstream import Upstreams


@dataclass
class Services:
    """Everything a route needs, built once per app in the lifespan."""

    settings: Settings
    repo: Repository
    upstreams: Upstreams
    adapters: AdapterTable
    """The published policy versions: which adapter a requested model means; publishing (``adapters.py``)."""
    recorder: Recorder
    keys: KeyRing
    gate: EpisodeGate
    metrics: Metrics
    relay: Relay
    """Runs and records model calls (``proxy/relay.py``)."""
    admission: Admission
    """Backpressure on ``POST /groups`` from the trainers' demand (``proxy/admission.py``)."""


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services  # Starlette's State holds Any
    return services


async def services(request: Request) -> Services:
    """Dependency form of ``services_of`` (async: a sync dependency costs a thread hop per request)."""
    return services_of(request)


def client_of(request: Request) -> str:
    """The caller's address as this process sees it (what failed key checks are counted by)."""
    return request.client.host if request.client is not None else "?"


def check_key(request: Request, key: str | None) -> Principal | None:
    """The key's principal, or None; a wrong key counts against the client, and a client over the
    limit is refused (429) before its key is looked at (``proxy/throttle.py``)."""
    failures: FailedAuth = request.app.state.failed_auth
    client = client_of(request)
    failures.check(client)
    svc = services_of(request)
    found = svc.keys.identify(key)
    if found is None and key:
        failures.failed(client)
    elif found is not None and found.retiring:
        svc.metrics.retiring_used.labels(found.role).inc()
    return found


def google_query_key(path: str, key: str | None) -> str | None:
    """Google's API takes its key as the ``key`` query parameter too; only its routes read it."""
    return key if key and speaks_gemini(path) else None


def identify(request: Request) -> Principal:
    """Any valid key (model routes); 401 for a missing or wrong key, 429 after too many wrong ones."""
    headers = request.headers
    key = bearer(headers.get("authorization"), headers.get("api-key") or headers.get("x-api-key"))
    key = key or headers.get("x-goog-api-key") or google_query_key(request.url.path, request.query_params.get("key"))
    found = check_key(request, key)
    if found is None:
        message = "missing API key (Authorization: Bearer <key>)" if not key else "invalid API key"
        raise AuthenticationFailed(message, code="invalid_api_key")
    return found


async def admin(request: Request) -> Principal:
    """The admin key only: rewards, groups, publishing, the trainer API."""
    found = identify(request)
    if found.role != "admin":
        raise PermissionDenied(
            "this route needs the admin key; agent and episode keys reach the model only", code="admin_only"
        )
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
    if too_deep(raw, body):
        raise InvalidRequest(f"request body nests arrays and objects deeper than {MAX_DEPTH} levels")
    return body


async def episode_of(
    request: Request, svc: Services, who: Principal, path_episode: str | None, *, recorded: bool
) -> str | None:
    """The open episode a recorded call belongs to (None: passthrough), or the one a passthrough
    call names as its side call (``gate.SIDE_HEADER``)."""
    if not recorded:
        side = side_episode(request.headers, who)
        if side is not None:
            await svc.gate.check_open(side)
        return side
    episode_id = identify_episode(request.headers, canonical_id(path_episode) if path_episode else None, who)
    await svc.gate.check_open(episode_id)
    return episode_id
