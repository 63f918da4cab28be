"""The vLLM replicas behind the proxy: one shared ``httpx.AsyncClient``, health, and sticky choice.

Episodes stick to a replica (rendezvous hashing on the episode id), so an agent's growing prompt
keeps hitting the same prefix cache; unhealthy replicas are skipped and an episode moves only when
its replica is down. Transport errors are translated here, once, into ``UpstreamError`` classes.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from proxy.answers import json_object, malformed
from proxy.errors import (
    FlywheelError,
    NotFound,
    RequestRejected,
    UpstreamError,
    UpstreamNotSynced,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.settings import Settings, UpstreamSettings
from proxy.transport import Http1Transport

log = logging.getLogger("flywheel.upstream")
_BASE_HEADERS = {"accept": "*/*", "user-agent": "flywheel-proxy"}


@dataclass(eq=False)
class Replica:
    settings: UpstreamSettings
    healthy: bool = False
    in_flight: int = 0
    adapters: set[str] = field(default_factory=set)
    """Adapter names this replica is known to have loaded."""

    @property
    def name(self) -> str:
        return self.settings.name

    @property
    def url(self) -> str:
        return self.settings.url.rstrip("/")

    def headers(self) -> dict[str, str]:
        key = self.settings.api_key
        return {"authorization": f"Bearer {key.get_secret_value()}"} if key else {}


def map_transport_error(exc: httpx.TransportError, replica: Replica) -> UpstreamError:
    """Translate an httpx transport error into the proxy's error for the client."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return UpstreamUnavailable(
            f"cannot reach upstream {replica.name}: {type(exc).__name__}", code="upstream_unavailable"
        )
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"upstream {replica.name} timed out ({type(exc).__name__})", code="upstream_timeout")
    return UpstreamError(f"upstream {replica.name} failed: {type(exc).__name__}: {exc}", code="upstream_error")


def answer_error(status: int, text: bytes, replica: Replica | None) -> FlywheelError:
    """Turn a vLLM error answer into ours: 4xx keep their status (the request's fault), 5xx become 502.

    A 404 from a replica the proxy holds unhealthy is a 503: a restarted engine without its adapters.

    A 401 is the proxy's fault, not the client's: the replica refused the key the proxy sent it
    (``upstreams[].api_key``), so the client gets a 502, not a 401 that would blame its own key.
    """
    try:
        err = orjson.loads(text).get("error") or {}
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (orjson.JSONDecodeError, AttributeError):
        message = text[:500].decode(errors="replace")
    message = message or f"upstream answered {status}"
    if status == 404 and replica is not None and not replica.healthy:
        # Chosen while every replica was down (``pick``): it answers again, but the health loop has
        # not reloaded its adapters yet, so the missing model is the proxy's state, not the client's.
        return UpstreamNotSynced(
            f"upstream {replica.name} is restarting and has not reloaded the published adapters yet; "
            f"retry shortly ({message})",
            code="upstream_not_synced",
        )
    if status == 404:
        return NotFound(message, param="model", code="model_not_found")
    name = replica.name if replica else "?"
    if status == 401:
        return UpstreamError(
            f"upstream {name} refused the proxy's API key ({status}): {message}", code="upstream_auth_failed"
        )
    if 400 <= status < 500:
        return RequestRejected(message, status_code=status, code="upstream_rejected")
    return UpstreamError(f"upstream {name} failed ({status}): {message}", code="upstream_error")


def _transport(kind: str, *, max_keepalive: int) -> httpx.AsyncBaseTransport:
    """The transport ``upstream_transport`` names (``proxy/transport.py`` says why lean is the default)."""
    if kind == "httpx":
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=max_keepalive)
        return httpx.AsyncHTTPTransport(limits=limits)
    return Http1Transport(max_keepalive=max_keepalive)


class Upstreams:
    def __init__(self, settings: Settings, transport: httpx.AsyncBaseTransport | None = None) -> None:
        t = settings.timeouts
        # No cap on connections: every open stream holds one; the pool must never be the queue.
        self._transport = transport or _transport(settings.upstream_transport, max_keepalive=512)
        self.client = httpx.AsyncClient(
            transport=self._transport,
            timeout=httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.write_s, pool=t.pool_s),
        )
        self._timeout = {"connect": t.connect_s, "read": t.read_s, "write": t.write_s, "pool": t.pool_s}
        # Parsed once: httpx validates a URL string character by character, every request.
        self._urls: dict[tuple[str, str], httpx.URL] = {}
        self._headers: dict[tuple[str, bool], httpx.Headers] = {}
        self.replicas = [Replica(u) for u in settings.upstreams]
        self._rr = 0

    async def close(self) -> None:
        await self.client.aclose()

    def pick(self, key: str | None, exclude: tuple[Replica, ...] = ()) -> Replica:
        """Choose a replica: sticky by ``key`` (rendezvous hash), else least busy; healthy first."""
        candidates = [r for r in self.replicas if r not in exclude] or list(self.replicas)
        healthy = [r for r in candidates if r.healthy] or candidates  # all down: try anyway
        if key is not None:
            return max(healthy, key=lambda r: hashlib.blake2b(f"{key}|{r.name}".encode(), digest_size=8).digest())
        self._rr += 1
        least = min(r.in_flight for r in healthy)
        idle = [r for r in healthy if r.in_flight == least]
        return idle[self._rr % len(idle)]

    async def send(
        self, replica: Replica, method: str, path: str, *, content: bytes | None = None, stream: bool = False
    ) -> httpx.Response:
        # Straight to the transport: the model calls need none of the client's cookies, auth flows,
        # redirects or header merging, which cost more CPU per call than the transport itself.
        url = self._urls.get((replica.url, path))
        if url is None:
            url = self._urls[(replica.url, path)] = httpx.URL(replica.url + path)
        headers = self._headers.get((replica.name, content is not None))
        if headers is None:
            headers = self._headers[(replica.name, content is not None)] = httpx.Headers(
                {**_BASE_HEADERS, "content-type": "application/json", **replica.headers()}
                if content is not None
                else {**_BASE_HEADERS, **replica.headers()}
            )
        request = httpx.Request(method, url, content=content, headers=headers, extensions={"timeout": self._timeout})
        try:
            response = await self._transport.handle_async_request(request)
            response.request = request
            if not stream:
                try:
                    await response.aread()
                finally:
                    await response.aclose()
            return response
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
                replica.healthy = False
            raise map_transport_error(exc, replica) from exc

    async def post_json(self, replica: Replica, path: str, body: dict[str, Any]) -> httpx.Response:
        """A small admin call (adapter load/unload): its own short timeout, not the generation one."""
        try:
            return await self.client.post(
                replica.url + path,
                content=orjson.dumps(body),
                timeout=60.0,
                headers={"content-type": "application/json", **replica.headers()},
            )
        except httpx.TransportError as exc:
            raise map_transport_error(exc, replica) from exc

    async def list_models(self, replica: Replica) -> list[dict[str, Any]]:
        try:
            response = await self.client.get(replica.url + "/v1/models", headers=replica.headers(), timeout=10.0)
        except httpx.TransportError as exc:
            raise map_transport_error(exc, replica) from exc
        if response.status_code != 200:
            raise UpstreamError(f"upstream {replica.name} answered {response.status_code} to /v1/models")
        models = json_object(response.content, replica.name).get("data") or []
        if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
            raise malformed(replica.name, "/v1/models answered no list of models")
        return models

    async def probe(self, replica: Replica) -> bool:
        try:
            response = await self.client.get(replica.url + "/health", headers=replica.headers(), timeout=5.0)
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def health_loop(
        self, interval_s: float, on_recovered: Callable[[Replica], Awaitable[None]] | None = None
    ) -> None:
        """Probe every replica forever; a replica that comes back runs ``on_recovered`` (adapter sync)
        before it takes traffic again."""
        while True:
            await self.check_all(on_recovered)
            await asyncio.sleep(interval_s)

    async def check_all(self, on_recovered: Callable[[Replica], Awaitable[None]] | None = None) -> None:
        await asyncio.gather(*(self._check(r, on_recovered) for r in self.replicas))

    async def _check(self, replica: Replica, on_recovered: Callable[[Replica], Awaitable[None]] | None) -> None:
        ok = await self.probe(replica)
        if ok and not replica.healthy:
            if on_recovered is not None:
                try:
                    await on_recovered(replica)
                except Exception as exc:  # stay out of rotation until the sync succeeds
                    log.warning("replica sync failed", extra={"replica": replica.name, "error": repr(exc)})
                    return
            log.info("replica healthy", extra={"replica": replica.name})
        elif not ok and replica.healthy:
            log.warning("replica unhealthy", extra={"replica": replica.name})
            replica.adapters.clear()  # a restarted engine has lost its adapters
        replica.healthy = ok
