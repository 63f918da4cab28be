"""Build the proxy app: ``create_app(settings, repo=None, transport=None)``.

The lifespan owns every long-lived piece: the store, the one upstream client, the recorder (group
commit), and three loops (replica health with adapter sync, policy refresh, reaping idle episodes).
On shutdown, requests in flight finish first (uvicorn), then background tasks and the recorder are
drained, so SIGTERM loses nothing that was handed to the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.adapters import AdapterTable
from proxy.admission import Admission
from proxy.auth import KeyRing
from proxy.deps import Services
from proxy.dialects.gemini import error_body as gemini_error_body
from proxy.dialects.gemini import speaks_gemini
from proxy.dialects.messages import error_body as messages_error_body
from proxy.errors import FlywheelError, InvalidRequest, NotFound, PayloadTooLarge, RequestRejected
from proxy.gate import EpisodeGate
from proxy.grammar import Grammars
from proxy.keyfile import KeyFile, Reload, initial_keys
from proxy.metrics import Metrics
from proxy.recorder import Recorder
from proxy.relay import Relay
from proxy.replay import Replayer
from proxy.retention import Sweeper
from proxy.routes import chat, episodes, gemini, messages, ops, policy, probe, responses, retention, trainer
from proxy.routes.mounts import MOUNTS, model_router
from proxy.sampling import SamplingDefaults
from proxy.settings import Settings
from proxy.splice import Splicer
from proxy.store.repository import Repository
from proxy.teachers import Teachers
from proxy.throttle import FailedAuth
from proxy.ui import routes as ui
from proxy.upstream import Upstreams

log = logging.getLogger("flywheel.app")


class BodyLimit:
    """Refuse bodies over ``max_bytes`` with a 413, never holding more than ``max_bytes`` of one.

    A declared ``content-length`` over the limit is refused before any body byte is read (uvicorn
    holds a request to its declared length). A chunked body has no length: it is counted as it
    arrives, and past the limit the 413 goes out at once, the app is told the client left
    (``http.disconnect``, so whatever was reading stops) and what it answers after that is dropped;
    uvicorn discards the rest of the body as it comes. Pure ASGI; only chunked requests are wrapped.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                error = PayloadTooLarge(f"request body is {int(value)} bytes; the limit is {self.max_bytes}")
                await _error_response(error, scope["path"])(scope, receive, send)
                return
            chunked = chunked or name == b"transfer-encoding"
        if not chunked:
            await self.app(scope, receive, send)
            return
        received = 0
        refused = started = False

        async def counted() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    if not started:
                        error = PayloadTooLarge(f"request body exceeds {self.max_bytes} bytes")
                        await _error_response(error, scope["path"])(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def unless_refused(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 was the answer
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, unless_refused)
        except ClientDisconnect:
            if not refused:
                raise


async def _every(interval_s: float, name: str, job: Any) -> None:
    while True:
        try:
            await job()
        except Exception as exc:  # a loop must survive a failing store or replica
            log.warning("background job failed", extra={"job": name, "error": repr(exc)})
        await asyncio.sleep(interval_s)


def _key_file(settings: Settings, keys: KeyRing, admin_keys: list[str], metrics: Metrics) -> KeyFile | None:
    """The watcher of ``auth.admin_key_file`` (rotation without a restart), if one is set."""
    if settings.auth.admin_key_file is None:
        return None

    def count(outcome: Reload) -> None:
        if outcome != "unchanged":
            metrics.key_reloads.labels(outcome).inc()

    path = Path(settings.auth.admin_key_file)
    return KeyFile(path, keys, admin_keys, grace_s=settings.auth.rotation_grace_s, on_reload=count)


def _speaks_messages(path: str) -> bool:
    """Anthropic Messages routes answer errors in Anthropic's shape, every other route in OpenAI's."""
    return path.endswith(("/v1/messages", "/v1/messages/count_tokens"))


def _error_response(error: FlywheelError, path: str) -> JSONResponse:
    if speaks_gemini(path):  # Google's Gemini routes answer in Google's shape
        body = gemini_error_body(error)
    else:
        body = messages_error_body(error) if _speaks_messages(path) else error.body()
    return JSONResponse(body, status_code=error.status_code, headers=error.headers() or None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
    if first.get("type") == "json_invalid":
        return "malformed JSON body", None
    where = ".".join(loc)
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where + ': ' if where else ''}{first.get('msg', 'invalid')}{more}", where or None


def _services(
    settings: Settings,
    store: Repository,
    keys: KeyRing,
    sampling: SamplingDefaults,
    transport: httpx.AsyncBaseTransport | None,
) -> Services:
    """What the routes share, wired once per app: the flow route -> relay -> upstream -> recorder -> store."""
    metrics = Metrics()
    upstreams = Upstreams(settings, transport)
    adapters = AdapterTable(settings.policy, store.versions, upstreams)
    recorder = Recorder(store.calls, batch_max=settings.store.batch_max, on_batch=metrics.on_batch)
    splice = settings.splice
    relay = Relay(
        upstreams=upstreams,
        adapters=adapters,
        recorder=recorder,
        metrics=metrics,
        sampling=sampling,
        sampling_rules=settings.sampling,
        splicer=Splicer(
            upstreams,
            store,
            depth=splice.depth,
            keep_reasoning=splice.reasoning == "keep",
            shadow_share=splice.shadow_share,
        )
        if splice.enabled
        else None,
        grammars=Grammars(upstreams),
        replayer=Replayer(store, metrics),
        teachers=Teachers(
            settings.teachers, store, upstreams, metrics, settings.timeouts, render_model=settings.policy.base_model
        ),
    )
    return Services(
        settings=settings,
        repo=store,
        upstreams=upstreams,
        adapters=adapters,
        recorder=recorder,
        keys=keys,
        gate=EpisodeGate(store),
        metrics=metrics,
        relay=relay,
        admission=Admission(settings.admission, store),
    )


def _loops(settings: Settings, svc: Services, key_file: KeyFile | None) -> list[asyncio.Task[None]]:
    """The background jobs of a running proxy: replica health, the current version, the idle-episode
    reaper, the retention sweeper (with ``retention.bodies_ttl_s`` set), and the admin key file's watcher."""
    upstreams, adapters, episodes = svc.upstreams, svc.adapters, svc.repo.episodes
    loops = [
        asyncio.create_task(upstreams.health_loop(settings.health_interval_s, adapters.sync_replica)),
        asyncio.create_task(adapters.refresh_loop()),
        asyncio.create_task(
            _every(
                settings.episodes.reaper_interval_s,
                "reaper",
                lambda: episodes.abandon_expired(
                    idle_s=settings.episodes.deadline_s,
                    late_tasks=settings.late_rewards.tasks,
                    max_wait_s=settings.late_rewards.max_wait_s,
                ),
            )
        ),
    ]
    if settings.retention.bodies_ttl_s is not None:  # purge bodies and token ids past their TTL
        sweeper = Sweeper(settings.retention, svc.repo)
        loops.append(asyncio.create_task(_every(settings.retention.interval_s, "retention", sweeper.sweep)))
    if key_file is not None and settings.auth.key_reload_s > 0:
        loops.append(asyncio.create_task(key_file.watch(settings.auth.key_reload_s)))
    return loops


def _lifespan(
    settings: Settings, repo: Repository | None, transport: httpx.AsyncBaseTransport | None
) -> tuple[Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]], KeyRing]:
    """The app's lifespan (services up, background jobs, then everything drained and closed) and its key ring."""
    sampling = SamplingDefaults.load(settings.sampling.generation_config, settings.sampling.defaults)
    admin_keys = initial_keys(settings.auth)
    keys = KeyRing(admin_keys, [k.get_secret_value() for k in settings.auth.agent_keys])

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = repo or Repository(
            settings.store.url,
            synchronous=settings.store.sqlite_synchronous,
            pool_size=settings.store.pool_size,
            min_rewarded=settings.episodes.min_rewarded,
        )
        svc = _services(settings, store, keys, sampling, transport)
        log.info("sampling defaults for omitted fields", extra={"defaults": sampling.values, "source": sampling.source})
        app.state.services = svc
        app.state.failed_auth = FailedAuth(settings.auth.failed_limit, settings.auth.failed_window_s)
        svc.metrics.retiring_keys.set_function(lambda: keys.retiring)
        key_file = _key_file(settings, keys, admin_keys, svc.metrics)
        stop_sighup = key_file.on_sighup() if key_file is not None else (lambda: None)
        svc.recorder.start()
        with contextlib.suppress(Exception):
            await svc.adapters.refresh()
        await svc.upstreams.check_all(svc.adapters.sync_replica)
        loops = _loops(settings, svc, key_file)
        replicas = [r.name for r in svc.upstreams.replicas]
        log.info("proxy ready", extra={"replicas": replicas, "store": store.url.split("://")[0]})
        try:
            yield
        finally:
            stop_sighup()
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            if svc.relay.background:  # streams whose client left: their records first
                await asyncio.gather(*svc.relay.background, return_exceptions=True)
            await svc.recorder.close()
            await svc.upstreams.close()
            if repo is None:
                await store.close()
            log.info("proxy stopped")

    return lifespan, keys


_ID_AFTER = frozenset({"episodes", "groups", "calls", "runs", "adapters"})


def path_shape(path: str) -> str:
    """A request path with its ids as ``{id}`` and model names as ``{model}`` (a Gemini method kept):
    what an unserved request is logged and counted by, so a label names the route, not the episode."""
    parts = path.split("/")
    shaped = []
    for i, part in enumerate(parts):
        before = parts[i - 1] if i else ""
        if before in _ID_AFTER or (len(part) >= 16 and any(c.isdigit() for c in part)):
            shaped.append("{id}")
        elif before == "models" and part:
            shaped.append("{model}" + (":" + part.split(":", 1)[1][:40] if ":" in part else ""))
        else:
            shaped.append(part[:40])
    return "/".join(shaped)[:200]


def _unserved(request: Request, status: int) -> None:
    """A request no route serves is logged and counted (``flywheel_unserved_routes``): a harness
    speaking an API or version the proxy lacks would otherwise leave no trace. The query string is
    never logged (Google's clients may put their key there)."""
    shape = path_shape(request.url.path)
    log.warning("unserved route", extra={"method": request.method, "path": shape, "status": status})
    svc = getattr(request.app.state, "services", None)
    if svc is not None:
        svc.metrics.on_unserved(request.method, shape)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as the API's error JSON (OpenAI's shape; Anthropic's on the Messages routes)."""

    @app.exception_handler(FlywheelError)
    async def _flywheel_error(request: Request, exc: FlywheelError) -> JSONResponse:
        return _error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error_response(InvalidRequest(message, param=param), request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if (exc.status_code, exc.detail) in ((404, "Not Found"), (405, "Method Not Allowed")):
            _unserved(request, exc.status_code)
        if exc.status_code == 404:
            missing = NotFound(f"no route {exc.detail}" if exc.detail != "Not Found" else "no such route")
            return _error_response(missing, request.url.path)
        return _error_response(RequestRejected(str(exc.detail), status_code=exc.status_code), request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        error = FlywheelError(f"internal error ({type(exc).__name__}); see the proxy log")
        return _error_response(error, request.url.path)


def create_app(
    settings: Settings, *, repo: Repository | None = None, transport: httpx.AsyncBaseTransport | None = None
) -> FastAPI:
    """The proxy app. ``transport`` swaps the network to vLLM (tests isolating the proxy only)."""
    lifespan, keys = _lifespan(settings, repo, transport)
    app = FastAPI(
        title="Flywheel proxy",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible proxy that records agent episodes for RL training.",
    )
    model_routes = (*chat.ROUTES, *responses.ROUTES, *messages.ROUTES, *gemini.ROUTES)
    for mount in MOUNTS:  # each model route once, served under every base URL
        app.include_router(model_router(mount, model_routes), prefix=mount.prefix)
    for mount in gemini.GEMINI_MOUNTS:  # Google's clients add /v1beta to the base URL themselves
        app.include_router(model_router(mount, gemini.ROUTES), prefix=mount.prefix)
    for module in (episodes, policy, trainer, ops, probe, retention):
        app.include_router(module.router)
    ui.install(app, keys.admin_keys)
    _install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    return app


def app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory`` (each worker process builds its own app)."""
    import os

    from proxy.logs import configure
    from proxy.settings import load_settings

    settings = load_settings(os.environ.get("FLYWHEEL_CONFIG"))
    configure(settings.log_level, settings.log_format)
    return create_app(settings)
