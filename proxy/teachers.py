"""Teachers: another model answers an episode's calls, recorded in the student's token space.

Why. A warm start (supervised steps before GRPO) needs demonstrations, and the way agents make
them should be the way they make rollouts: the same agent, tools and routes, recorded the same way.
So a stronger model (or the scripted demonstrator, ``workflows/tac/demonstrator.py``) is served
behind the proxy as a teacher, and only the episode says who answers.

How. ``teachers`` in the settings names OpenAI-compatible servers. A group or episode created with
``metadata.source: "teacher:<name>"`` is a teacher episode (the name is checked at creation,
``Teachers.check``). Every chat call of it goes to that teacher, asked for its ``model`` and
non-streamed, and the teacher's answer reaches the agent unchanged (a stream is sent as one after
the record). The call is recorded like any other, with its ids in the student's token space:

- prompt ids: the student's vLLM render of the request (``/v1/chat/completions/render``, the route
  the splice uses), the prompt the student would have been given;
- completion ids, per choice: the render of the conversation with the teacher's assistant message
  appended (text and tool calls, in the student template's own format) after the prompt's render.
  The first must extend the second; where it does not, the call is recorded inexact with why;
- no sampling log-probs, no effective sampling and no policy version (the student sampled
  nothing: the trainer counts such a call foreign), and ``notes.teacher``
  (``contract.schemas.TeacherNote``) saying who answered and how the ids were made.

GRPO never trains a teacher's calls: its claim marks a teacher group ``skipped`` instead of handing
it out (``proxy/store/leases.py``). Chat completions only: a teacher episode's completions,
Responses and Messages calls are refused (400 ``teacher_unsupported``).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import orjson

from contract.schemas import TeacherNote
from contract.vocabulary import TEACHER_PREFIX
from proxy.answers import check_answer, json_object
from proxy.capture import Captured, Wants, capture_response
from proxy.errors import (
    FlywheelError,
    InvalidRequest,
    RequestRejected,
    UpstreamError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from proxy.metrics import Metrics
from proxy.settings import TeacherSettings, UpstreamTimeouts
from proxy.splice import RENDER, RENDER_SHAPING
from proxy.store.repository import Repository
from proxy.upstream import Replica, Upstreams

log = logging.getLogger("flywheel.teachers")

MAX_CACHED = 100_000
"""Episodes whose teacher (or its absence) is remembered: an episode's source never changes."""
_NOT_SENT = ("stream", "stream_options")
"""Left out of the request a teacher gets: the proxy asks for the whole answer."""


def teacher_name(source: Any) -> str | None:
    """The teacher a ``metadata.source`` names (``teacher:<name>``), or None."""
    if isinstance(source, str) and source.startswith(TEACHER_PREFIX):
        return source[len(TEACHER_PREFIX) :]
    return None


def teacher_error(name: str, status: int, content: bytes) -> FlywheelError:
    """A teacher's error answer as the client's: 4xx keep their status, the rest are a 502."""
    try:
        err = orjson.loads(content).get("error") or {}
        message = err.get("message") if isinstance(err, dict) else str(err)
    except (orjson.JSONDecodeError, AttributeError):
        message = content[:500].decode(errors="replace")
    message = f"teacher {name} answered {status}: {message or 'no message'}"
    if status == 401:  # the key the proxy sends is the proxy's configuration, not the client's
        return UpstreamError(message, code="teacher_auth_failed")
    if 400 <= status < 500:
        return RequestRejected(message, status_code=status, code="teacher_rejected")
    return UpstreamError(message, code="teacher_error")


def _teacher_unreachable(name: str, exc: httpx.TransportError) -> UpstreamError:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return UpstreamUnavailable(f"cannot reach teacher {name}: {type(exc).__name__}", code="teacher_unavailable")
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamTimeout(f"teacher {name} timed out ({type(exc).__name__})", code="teacher_timeout")
    return UpstreamError(f"teacher {name} failed: {type(exc).__name__}: {exc}", code="teacher_error")


def assistant_turn(message: Mapping[str, Any]) -> dict[str, Any]:
    """The teacher's answer as the assistant message an agent sends back: its text and tool calls
    (reasoning left out, as templates leave out earlier turns' reasoning)."""
    turn: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        turn["tool_calls"] = message["tool_calls"]
    return turn


def sse(data: Mapping[str, Any], wants: Wants) -> bytes:
    """A whole chat answer as the server-sent events of a stream: per choice its role and text, each
    tool call, its finish; then usage where the client asked for it; then ``[DONE]``."""
    header = {k: data.get(k) for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    events: list[dict[str, Any]] = []
    for choice in data.get("choices") or ():
        index, message = choice.get("index", 0), choice.get("message") or {}
        events.append({"index": index, "delta": {"role": "assistant", "content": message.get("content") or ""}})
        for i, call in enumerate(message.get("tool_calls") or ()):
            events.append({"index": index, "delta": {"tool_calls": [{"index": i, **call}]}})
        events.append({"index": index, "delta": {}, "finish_reason": choice.get("finish_reason")})
    chunks = [{**header, "choices": [event]} for event in events]
    if wants.usage and data.get("usage") is not None:
        chunks.append({**header, "choices": [], "usage": data["usage"]})
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


class Teachers:
    """The configured teachers: which episode each serves, its answers, and their ids in the student's space."""

    def __init__(
        self,
        teachers: Sequence[TeacherSettings],
        repo: Repository,
        upstreams: Upstreams,
        metrics: Metrics,
        timeouts: UpstreamTimeouts,
        *,
        render_model: str,
    ) -> None:
        self.by_name = {t.name: t for t in teachers}
        self._repo = repo
        self._upstreams = upstreams
        self._metrics = metrics
        self._timeout = httpx.Timeout(
            connect=timeouts.connect_s, read=timeouts.read_s, write=timeouts.write_s, pool=timeouts.pool_s
        )
        self.render_model = render_model
        """The student's name on its engine for renders: the base model (every adapter shares its template)."""
        self._of: OrderedDict[str, TeacherSettings | None] = OrderedDict()

    # -- which episodes a teacher serves ---------------------------------------------------------

    def _known(self, name: str, param: str) -> None:
        if name not in self.by_name:
            served = ", ".join(sorted(self.by_name)) or "none configured"
            raise InvalidRequest(
                f"{param} names teacher {name!r}, which this proxy does not serve (teachers: {served})",
                param=param,
                code="unknown_teacher",
            )

    def check(self, metadata: Mapping[str, Any], episode_metadata: Sequence[Mapping[str, Any]] | None = None) -> None:
        """Refuse (400 ``unknown_teacher``) a new group's or episode's metadata naming a teacher this
        proxy does not serve, before anything is written. In a group, a teacher source is the
        group's: an episode's ``source`` may repeat it, never differ from it, so a group is all
        demonstrations or none (GRPO's claim reads the group's)."""
        group = teacher_name(metadata.get("source"))
        if group is not None:
            self._known(group, "metadata.source")
        for i, meta in enumerate(episode_metadata or ()):
            if "source" not in meta:
                continue
            name = teacher_name(meta["source"])
            if name is not None:
                self._known(name, f"episode_metadata[{i}].source")
            if (name is not None or group is not None) and meta["source"] != metadata.get("source"):
                raise InvalidRequest(
                    f"episode_metadata[{i}].source is {meta['source']!r} but the group's is "
                    f"{metadata.get('source')!r}: a teacher source is the whole group's (set metadata.source)",
                    param=f"episode_metadata[{i}].source",
                    code="mixed_source",
                )

    async def of(self, episode_id: str) -> TeacherSettings | None:
        """The teacher serving ``episode_id`` (its metadata's ``source``, else its group's), or None.
        Read once per episode (two primary-key reads), only while teachers are configured."""
        if not self.by_name:
            return None
        if episode_id in self._of:
            return self._of[episode_id]
        episode = await self._repo.episodes.get_episode(episode_id, with_calls=False)
        source = episode.metadata.get("source")
        if source is None and episode.group_id is not None:
            source = (await self._repo.episodes.get_group(episode.group_id)).metadata.get("source")
        name = teacher_name(source)
        if name is not None:
            self._known(name, "the episode's metadata.source")  # a teacher removed from the settings since
        teacher = self.by_name[name] if name is not None else None
        if len(self._of) >= MAX_CACHED:
            self._of.popitem(last=False)
        self._of[episode_id] = teacher
        return teacher

    # -- the answer ------------------------------------------------------------------------------

    async def ask(self, teacher: TeacherSettings, body: Mapping[str, Any]) -> tuple[dict[str, Any], bytes]:
        """The teacher's whole answer to the client's chat request (its ``model`` for the one asked
        for), parsed and checked like an engine's, and its bytes."""
        request = {k: v for k, v in body.items() if k not in _NOT_SENT}
        request["model"] = teacher.model
        headers = {"content-type": "application/json"}
        if teacher.api_key is not None:
            headers["authorization"] = f"Bearer {teacher.api_key.get_secret_value()}"
        try:
            response = await self._upstreams.client.post(
                teacher.url.rstrip("/") + "/v1/chat/completions",
                content=orjson.dumps(request),
                headers=headers,
                timeout=self._timeout,
            )
        except httpx.TransportError as exc:
            raise _teacher_unreachable(teacher.name, exc) from exc
        if response.status_code >= 400:
            raise teacher_error(teacher.name, response.status_code, response.content)
        source = f"teacher {teacher.name}"
        return check_answer(json_object(response.content, source), "chat", source), response.content

    # -- its ids in the student's space ----------------------------------------------------------

    async def _render(self, replica: Replica, body: dict[str, Any]) -> list[int]:
        response = await self._upstreams.send(replica, "POST", RENDER, content=orjson.dumps(body))
        if response.status_code >= 400:
            raise teacher_error(f"render on {replica.name}", response.status_code, response.content)
        ids = json_object(response.content, replica.name).get("token_ids")
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise UpstreamError(f"{replica.name} {RENDER} answered no token ids", code="malformed_answer")
        return ids

    async def capture(
        self, teacher: TeacherSettings, replica: Replica, body: Mapping[str, Any], data: dict[str, Any]
    ) -> Captured:
        """What the record keeps of the teacher's answer ``data`` to ``body``: ids rendered by the
        student's engine on ``replica`` (exact), or, where that fails, no ids and why (inexact)."""
        captured = capture_response(data, "chat")
        shaping = {k: body[k] for k in RENDER_SHAPING if body.get(k) is not None}
        messages = list(body["messages"])
        asked = {"model": self.render_model, **shaping, "messages": messages}
        whole = {**asked, "add_generation_prompt": False, "continue_final_message": False}
        why: str | None = None
        outcome = "rendered"
        prompt: list[int] | None = None
        completions: list[list[int]] = []
        try:
            prompt = await self._render(replica, asked)
            for choice in data["choices"]:
                turn = assistant_turn(choice.get("message") or {})
                ids = await self._render(replica, {**whole, "messages": [*messages, turn]})
                if len(ids) <= len(prompt) or ids[: len(prompt)] != prompt:
                    why = (
                        f"choice {choice.get('index', 0)}: the student template's rendering with the teacher's "
                        "answer does not extend the prompt's rendering"
                    )
                    outcome = "mismatch"
                    break
                completions.append(ids[len(prompt) :])
        except FlywheelError as exc:
            why, outcome = f"the student's engine could not render the call: {exc.message}", "unrendered"
            log.warning("teacher call not rendered", extra={"teacher": teacher.name, "why": exc.message})
        self._metrics.teacher_calls.labels(teacher.name, outcome).inc()
        exact = why is None
        for record, ids in zip(captured.choices, completions if exact else [], strict=False):
            record["token_ids"] = ids
        for record in captured.choices:
            record["logprobs"] = []
        captured.prompt_token_ids = prompt if exact else None
        captured.exact_ids = exact
        captured.prompt_tokens = len(prompt) if exact and prompt is not None else None
        captured.completion_tokens = sum(len(ids) for ids in completions) if exact else None
        captured.inexact = None if exact else {"why": [why], "teacher": teacher.name}
        return captured

    def note(self, teacher: TeacherSettings, data: Mapping[str, Any]) -> dict[str, Any]:
        """``notes.teacher``: who answered, with which model, how the ids were made, its own usage."""
        usage = data.get("usage")
        note = TeacherNote(name=teacher.name, model=teacher.model, usage=usage if isinstance(usage, dict) else None)
        return note.model_dump()
