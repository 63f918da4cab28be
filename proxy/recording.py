"""The record of one model call: what it is built from, how each ending is written, and its metrics.

``relay.py`` fills a ``Recording`` as the call runs (the replica it went to, the seed it dropped,
its effective sampling, its splice) and ends it one of three ways: ``answered`` (a 200 with what
``capture.py`` read), ``failed`` (the error as the client gets it, no tokens) or ``left`` (a 499:
the client went away before its answer). A passthrough call (no episode) is counted, never
recorded. Writing goes through the recorder's group commit (``recorder.py``); a call is
acknowledged only once its record is committed, which the callers keep by awaiting these first.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from contract.vocabulary import RECEIPT_PREFIX, CallApi, CallKind
from proxy.capture import Captured
from proxy.dialects.base import Translation
from proxy.errors import EpisodeClosed, FlywheelError, RecordingFailed
from proxy.metrics import Metrics
from proxy.recorder import Recorder
from proxy.refusals import report
from proxy.store.records import NewCall
from proxy.upstream import Replica

log = logging.getLogger("flywheel.relay")


@dataclass(slots=True, kw_only=True)
class Recording:
    """What one call's record is built from, filled in as the call runs."""

    recorder: Recorder
    metrics: Metrics
    kind: CallKind
    body: dict[str, Any]
    """The request as the client sent it (stored as the call's request)."""
    episode_id: str | None
    """None: passthrough, counted but not recorded."""
    translation: Translation | None
    """A call in another API (``dialects/``): its API, own request and response id are stored."""
    model_served: str
    version: int | None
    """The policy version of ``model_served`` (None: not a policy adapter)."""
    replica: Replica | None = None
    """The replica the call went to (the last one tried)."""
    dropped: dict[str, Any] | None = None
    """What the relay removed to keep the engine alive, and why (``relay._protect``)."""
    sampling: dict[str, Any] | None = None
    """The effective sampling (``notes.sampling``), recorded calls only."""
    splice: dict[str, Any] | None = None
    """Whether and how the prompt was spliced (``notes.splice``)."""
    side: bool = False
    """A passthrough call recorded beside its episode (``notes.side``; no policy version)."""
    replay: dict[str, Any] | None = None
    """The source call a fork's call was answered from (``notes.replay``, ``proxy/replay.py``)."""
    teacher: dict[str, Any] | None = None
    """The teacher that answered the call instead of the policy (``notes.teacher``, ``proxy/teachers.py``)."""
    receipt: str = field(default_factory=lambda: f"{RECEIPT_PREFIX}{uuid.uuid4().hex}")
    """The call's id, known before it is answered: a streamed answer's headers carry it."""
    started: float = field(default_factory=time.time)
    t0: float = field(default_factory=time.perf_counter)
    """The call's clock (latency and time to first token)."""

    @property
    def route(self) -> CallApi:
        """The API the client spoke."""
        return self.translation.api if self.translation else ("chat" if self.kind == "chat" else "completions")

    @property
    def source(self) -> str:
        """The replica that answered, for error messages."""
        return self.replica.name if self.replica else "?"

    def new_call(
        self, *, status: int, captured: Captured | None, error: dict[str, Any] | None, ttft_ms: float | None
    ) -> NewCall:
        """The call as the store takes it."""
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
            notes=_noted(self.notes(), captured),
            api=self.route,
            client_request=self.translation.client_request if self.translation else None,
            response_id=self.translation.response_id if self.translation else None,
            receipt=self.receipt,
        )

    def notes(self) -> dict[str, Any] | None:
        """What the proxy changed or decided on the way: a dropped seed, the effective sampling, the
        splice, the replay, the teacher that answered."""
        notes = dict(self.dropped or {})
        if self.sampling is not None:
            notes["sampling"] = self.sampling
        if self.splice is not None:
            notes["splice"] = self.splice
        if self.replay is not None:
            notes["replay"] = self.replay
        if self.teacher is not None:
            notes["teacher"] = self.teacher
        if self.side:
            notes["side"] = True
        if self.translation is not None and self.translation.compat:
            notes["compat"] = self.translation.compat
        return notes or None

    async def answered(self, captured: Captured | None, ttft_ms: float | None) -> None:
        """Record the call as answered (200); raises ``RecordingFailed`` or ``EpisodeClosed`` when the
        store refuses it, and then the client gets that error instead of its answer."""
        await self.recorder.record(self.new_call(status=200, captured=captured, error=None, ttft_ms=ttft_ms))

    async def failed(self, error: FlywheelError) -> None:
        """Count and record a call that failed: the error as the client gets it, no tokens."""
        report(self.metrics, error, route=self.route, episode_id=self.episode_id)  # a 4xx is a refusal
        if self.episode_id is not None:
            call = self.new_call(status=error.status_code, captured=None, error=error.body()["error"], ttft_ms=None)
            try:
                await self.recorder.record(call)
            except (RecordingFailed, EpisodeClosed):
                log.error("could not record a failed call", extra={"episode": self.episode_id})
        self.observe(error.status_code, None)

    async def left(self, captured: Captured | None, ttft_ms: float | None, message: str) -> None:
        """Record a call whose answer never reached its client: status 499 (nginx's "client closed
        request"), never trained, never continued by a splice."""
        call = self.new_call(
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
        self.observe(499, None)
        await self.recorder.record(call)

    def observe(self, status: int, captured: Captured | None) -> None:
        """Count the call, its latency and its tokens."""
        m = self.metrics
        m.requests.labels(self.kind, str(status)).inc()
        m.latency.labels(self.kind).observe(time.perf_counter() - self.t0)
        if captured:
            m.tokens.labels("prompt").inc(captured.prompt_tokens or 0)
            m.tokens.labels("completion").inc(captured.completion_tokens or 0)


def _noted(notes: dict[str, Any] | None, captured: Captured | None) -> dict[str, Any] | None:
    """The call's notes plus, for ids that are not exact, why (``inexact``: reasons and counts)."""
    if captured is None or captured.inexact is None:
        return notes
    return {**(notes or {}), "inexact": captured.inexact}
