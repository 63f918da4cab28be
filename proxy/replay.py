"""Fork episodes: answer a fork's first k calls from its source's record, and see where it diverges.

A fork (``POST /episodes/{id}/fork``) re-runs a finished episode's task with the same, unchanged
agent. Its first ``fork_at`` answered calls are not sent to the engine: each is answered with the
source's answer to the same call (the same text, tool calls, ids and policy version; a stream as a
stream), so a deterministic agent and environment reach the source's state at call k, and from
there the fork samples from the current policy. Only the proxy sees every call, so only it can
branch an agent it does not control.

The replay holds only while the agent asks what it asked before: each replayed call's request (the
chat request the proxy would execute, for every API) must equal the recorded one. The first call
that differs ends the replay (``diverged_at``, the differing fields, counted) and the fork's rule
applies: ``sample`` (from there on, as any episode) or ``abandon`` (409 ``fork_diverged``, the
episode abandoned with cause ``diverged``). A call whose source asked for log-probs itself is not
replayable (the record keeps only the sampled tokens' log-probs): a divergence too.

The replay position is the fork's count of answered calls in the store, read on every call while
the replay lasts, so a restarted proxy, or another worker, resumes where the record says; two calls
of one fork in flight at once both compare with the same source call, and one of them diverges
(a deterministic agent that replays makes its calls in order). Replayed calls are
recorded with ``notes.replay`` (source episode and ordinal) and the source's ids, log-probs and
version: the splice and the trainer's merge see the conversation the agent saw, and the trainer
keeps them as context only (``trainer/turns.py``). A stream is replayed as one chunk per part
(role, reasoning, text, each tool call, finish, usage): the same answer once assembled, not the
same chunking.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from contract.vocabulary import CallApi, CallKind, ForkRule
from proxy.capture import REASONING
from proxy.errors import Conflict
from proxy.metrics import Metrics
from proxy.store.records import CallRecord
from proxy.store.repository import Repository

log = logging.getLogger("flywheel.replay")


@dataclass(frozen=True, slots=True)
class Replayed:
    """A fork call answered from its source's record."""

    source: CallRecord
    index: int
    """Its place among the source's answered calls (0-based)."""
    source_episode_id: str

    def note(self) -> dict[str, Any]:
        """The call's ``notes.replay``."""
        return {"source_episode_id": self.source_episode_id, "source_ordinal": self.source.ordinal, "index": self.index}


@dataclass(slots=True)
class _Fork:
    source: str
    at: int
    rule: ForkRule
    over: bool = False
    """The replay ended: ``at`` calls replayed, or the fork diverged."""


class Replayer:
    """Which fork calls are replayed, from what; built once per app. ``size``: the episodes (fork or
    not) and ``sources``: the sources' calls held in memory (least recently used dropped first)."""

    def __init__(self, repo: Repository, metrics: Metrics, *, size: int = 4096, sources: int = 16) -> None:
        self._repo = repo
        self._metrics = metrics
        self._size = size
        self._forks: OrderedDict[str, _Fork | None] = OrderedDict()
        self._source_size = sources
        self._sources: OrderedDict[str, list[CallRecord]] = OrderedDict()

    async def take(self, episode_id: str, kind: CallKind, api: CallApi, body: dict[str, Any]) -> Replayed | None:
        """The record to answer this call with, or None: the call goes to the engine. Raises
        ``Conflict`` (``fork_diverged``) for a diverged fork whose rule is ``abandon``."""
        fork = await self._fork(episode_id)
        if fork is None:
            return None
        if not fork.over:
            # Read from the store on every call while the replay lasts, never kept here: another
            # worker process may have answered or diverged this episode since.
            record = await self._repo.forks.fork_of(episode_id)
            position = await self._repo.forks.answered(episode_id)
            fork.over = record is None or record.diverged_at is not None or position >= fork.at
        if fork.over:  # an ended replay stays ended: kept
            self._metrics.forks.labels("sampled").inc()
            return None
        calls = await self._source(fork.source)
        source = calls[position]
        differ = differences(source, kind, api, body)
        if differ:
            await self._diverged(episode_id, fork, position, differ)
            return None
        self._metrics.forks.labels("replayed").inc()
        return Replayed(source=source, index=position, source_episode_id=fork.source)

    async def _diverged(self, episode_id: str, fork: _Fork, position: int, differ: list[str]) -> None:
        fork.over = True
        self._metrics.forks.labels("diverged").inc()
        divergence = {"fields": differ, "rule": fork.rule}
        await self._repo.forks.diverge(episode_id, at=position, divergence=divergence)
        log.warning(
            "fork diverged from its source",
            extra={"episode": episode_id, "source": fork.source, "at": position, "fields": differ, "rule": fork.rule},
        )
        if fork.rule == "abandon":
            reason = f"fork diverged from {fork.source} at its answered call {position}: {', '.join(differ)} differ"
            await self._repo.episodes.abandon(episode_id, reason=reason, cause="diverged")
            raise Conflict(reason + " (on_divergence: abandon)", code="fork_diverged")

    async def _fork(self, episode_id: str) -> _Fork | None:
        if episode_id in self._forks:
            self._forks.move_to_end(episode_id)
            return self._forks[episode_id]
        state = await self._repo.episodes.episode_state(episode_id)  # the gate's own read: no fork, no more
        record = await self._repo.forks.fork_of(episode_id) if state is not None and state[2] is not None else None
        fork = None
        if record is not None and record.fork_of is not None:
            fork = _Fork(source=record.fork_of, at=record.fork_at or 0, rule=record.fork_rule or "sample")
        self._forks[episode_id] = fork
        if len(self._forks) > self._size:
            self._forks.popitem(last=False)
        return fork

    async def _source(self, source_id: str) -> list[CallRecord]:
        if source_id in self._sources:
            self._sources.move_to_end(source_id)
            return self._sources[source_id]
        calls = await self._repo.forks.replayable(source_id)
        self._sources[source_id] = calls
        if len(self._sources) > self._source_size:
            self._sources.popitem(last=False)
        return calls


def differences(source: CallRecord, kind: CallKind, api: CallApi, body: dict[str, Any]) -> list[str]:
    """Why ``body`` is not the recorded call's request: the differing fields (``messages[3]``: the
    first differing message), or why the record cannot answer it; [] when it is the same call."""
    if source.kind != kind or source.api != api:
        return [f"api ({source.api} recorded, {api} sent)"]
    recorded = source.request
    if _asked_logprobs(recorded, kind):
        return ["logprobs (the record keeps only the sampled tokens' log-probs, not what the client was sent)"]
    differ = []
    for key in sorted(set(recorded) | set(body)):
        mine, theirs = recorded.get(key), body.get(key)
        if mine == theirs:
            continue
        if isinstance(mine, list) and isinstance(theirs, list) and key in ("messages", "prompt"):
            first = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False)) if a != b), None)
            differ.append(f"{key}[{first if first is not None else min(len(mine), len(theirs))}]")
        else:
            differ.append(key)
    return differ


def _asked_logprobs(request: dict[str, Any], kind: CallKind) -> bool:
    value = request.get("logprobs")
    if kind == "chat":
        return value is True or bool(request.get("top_logprobs"))
    return value is not None and value is not False


# -- the recorded answer, as the engine sent it ---------------------------------------------------


def _logprobs(values: list[float], kind: CallKind) -> dict[str, Any]:
    """The sampled tokens' log-probs in the engine's shape (what ``capture.py`` reads back)."""
    if kind == "chat":
        return {"content": [{"token": "", "logprob": v, "bytes": None, "top_logprobs": []} for v in values]}
    return {"tokens": [""] * len(values), "token_logprobs": list(values), "top_logprobs": None, "text_offset": []}


def answer(source: CallRecord) -> dict[str, Any]:
    """The source's non-streamed answer as the engine gave it: the recorded body with its token ids
    and log-probs put back where the engine had them."""
    data = copy.deepcopy(source.response or {})
    if "prompt_token_ids" in data or source.kind == "chat":  # a completion carries them per choice
        data["prompt_token_ids"] = source.prompt_token_ids
    recorded = {int(c.get("index", 0)): c for c in source.choices}
    for choice in data.get("choices") or ():
        rec = recorded.get(int(choice.get("index", 0)), {})
        choice["logprobs"] = _logprobs(rec.get("logprobs") or [], source.kind)
        choice["token_ids"] = rec.get("token_ids")
        if source.kind == "completion" and "prompt_token_ids" in choice:
            choice["prompt_token_ids"] = source.prompt_token_ids
    return data


async def stream(source: CallRecord) -> AsyncGenerator[dict[str, Any], None]:
    """The source's streamed answer, one chunk per part: the role (with the prompt ids), per choice
    its reasoning, text and each tool call (the sampled ids and log-probs on its first part), its
    finish, then usage. The reasoning is the recorded message's, in the field vLLM sent it in."""
    response = source.response or {}
    chat = source.kind == "chat"
    messages = {int(c.get("index", 0)): c.get("message") or {} for c in response.get("choices") or ()}
    header = {
        "id": response.get("id"),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": response.get("created"),
        "model": response.get("model"),
    }
    if response.get("system_fingerprint"):
        header["system_fingerprint"] = response["system_fingerprint"]
    if chat:
        opening = [{"index": c.get("index", 0), "delta": {"role": "assistant", "content": ""}} for c in source.choices]
        yield {**header, "choices": opening, "prompt_token_ids": source.prompt_token_ids}
    for rec in source.choices:
        index = rec.get("index", 0)
        parts: list[dict[str, Any]] = []
        if chat:
            message = messages.get(int(index), {})
            key = next((k for k in REASONING if message.get(k)), None)
            if key is not None:
                parts.append({"delta": {key: message[key]}})
            if rec.get("text"):
                parts.append({"delta": {"content": rec["text"]}})
            for j, call in enumerate(rec.get("tool_calls") or ()):
                parts.append({"delta": {"tool_calls": [{"index": j, **call}]}})
        elif rec.get("text"):
            parts.append({"text": rec["text"]})
        finish = {"finish_reason": rec.get("finish_reason"), "stop_reason": rec.get("stop_reason")}
        parts.append({"delta": {}, **finish} if chat else {"text": "", **finish})
        ids = {"token_ids": rec.get("token_ids") or [], "logprobs": _logprobs(rec.get("logprobs") or [], source.kind)}
        parts[0].update(ids)
        if not chat:
            parts[0]["prompt_token_ids"] = source.prompt_token_ids
        for part in parts:
            yield {**header, "choices": [{"index": index, **part}]}
    yield {**header, "choices": [], "usage": response.get("usage")}
