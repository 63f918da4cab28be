"""A refused model call is never invisible: a log line, a counter, and a failed call on its episode.

A call refused before it reaches the engine (a field the proxy does not serve, a bad body, a
sampling rule, a wrong key, a closed episode) would otherwise leave nothing behind, and an episode
whose every call was refused would end abandoned with no reason anywhere. ``refused`` logs it
(route, status, reason, the field named; never the body or a key), counts it in
``flywheel_refused_calls_total{route, reason}`` (reason: the error's code, else its type) and,
when the call's episode is known, records it there as a failed call: the status and error the
client got, its request as sent, no tokens, ``notes.refused``. The dashboard's episode page shows
it; the trainer and the export read answered calls only (status 200).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from contract.vocabulary import CallApi, CallKind
from proxy.errors import EpisodeClosed, FlywheelError, RecordingFailed
from proxy.metrics import Metrics
from proxy.recorder import Recorder
from proxy.store.records import NewCall

log = logging.getLogger("flywheel.refusals")


def _failed_call(
    error: FlywheelError, *, route: CallApi, kind: CallKind, episode_id: str, body: dict[str, Any]
) -> NewCall:
    """The refusal as a call record: nothing was sent, so no request to the engine and no tokens."""
    own = route in ("chat", "completions")  # a chat or completions body is itself the request
    model = body.get("model")
    return NewCall(
        episode_id=episode_id,
        kind=kind,
        stream=body.get("stream") is True,
        request=body if own else {},
        response=None,
        status_code=error.status_code,
        error=error.body()["error"],
        prompt_token_ids=None,
        choices=[],
        exact_ids=False,
        model_requested=model[:256] if isinstance(model, str) else "",
        model_served=None,
        policy_version=None,
        replica=None,
        started_at=time.time(),
        latency_ms=0.0,
        ttft_ms=None,
        prompt_tokens=None,
        completion_tokens=None,
        notes={"refused": error.code or error.type},
        api=route,
        client_request=None if own else body,
    )


def report(metrics: Metrics, error: FlywheelError, *, route: CallApi, episode_id: str | None) -> bool:
    """Log and count a refusal (a 4xx; a 5xx is a failure, reported where it happens); False if it is none."""
    if not 400 <= error.status_code < 500:
        return False
    reason = error.code or error.type
    metrics.refused.labels(route, reason).inc()
    log.warning(
        "model call refused",
        extra={
            "route": route,
            "status": error.status_code,
            "reason": reason,
            "param": error.param,
            "episode": episode_id,
            "detail": error.message[:300],
        },
    )
    return True


async def refused(
    metrics: Metrics,
    recorder: Recorder,
    error: FlywheelError,
    *,
    route: CallApi,
    kind: CallKind = "chat",
    episode_id: str | None = None,
    body: dict[str, Any] | None = None,
) -> None:
    """Make a call refused before it was sent visible; the caller raises ``error`` afterwards. The
    record needs the episode (``body`` None: it was unreadable); without it the log line and the
    counter remain."""
    if not report(metrics, error, route=route, episode_id=episode_id) or episode_id is None:
        return
    call = _failed_call(error, route=route, kind=kind, episode_id=episode_id, body=body or {})
    try:
        await recorder.record(call)
    except (RecordingFailed, EpisodeClosed) as exc:  # the client still gets its 4xx
        log.error("could not record a refused call", extra={"episode": episode_id, "error": exc.message})
