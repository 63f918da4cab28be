"""Recorded episodes as a dataset: JSON Lines or Parquet, one row per episode, streamed.

Who reads it: SFT (the ``messages`` column, a chat-template-ready conversation) and offline RL
(per call the exact prompt ids the engine saw, per choice the sampled ids, their log-probs, the loss
mask the trainer would use, the serving policy version, and the rewards and group advantage).
The schema is ``SCHEMA`` (docs/guide/export.md documents every column); a JSON Lines row has the same
fields. Both formats load with Hugging Face ``datasets`` (``load_dataset("json" | "parquet")``).

Per call, not merged: the trainer's merge of calls into samples (``trainer/merge.py``) needs torch,
which a proxy host may not have, so the export keeps each call whole; its ``prompt_token_ids``
are what the merge works from (a call that extends the previous prompt + completion continues the
same sequence). The loss mask follows the trainer's rule for one call: a choice is trained when the
call succeeded, was served by a policy version, has exact ids and was sampled in a trained mode
(``notes.sampling.mode`` sampled, truncated, or constrained with its grammar recorded and not
marked ``exclude``: the trainer scores constrained tokens under the rebuilt grammar mask, and keeps
a call without one as context); a constrained choice's tokens with log-prob exactly 0 (forced by
the grammar) are masked out. Retried calls (same prompt ids) are all exported; the trainer keeps,
of calls with one prompt in a row, the one a later call continues.

Streaming: pages of ``page`` episodes by keyset (``Browse.export_page``), each written and dropped
before the next is read; Parquet writes one row group per page. A page's calls are read in one query
and made whole by ``rows.call_records``, the reader the repository uses, so the export reads
exactly what the trainer is served, whatever the store's layout.

Retention: a deleted episode is gone from the store, so from every export after it; a purged one
(``retention.bodies_ttl_s``) is exported with its outcome and counts, ``purged_at`` set, and calls
without bodies or ids (``trained`` false, empty ``messages``: ``proxy/store/retention.py``).
"""

from __future__ import annotations

import datetime as dt
import io
import statistics
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from contract.trainability import FIX, untrainable, untrained
from contract.vocabulary import TRAINED_MODES, EpisodeStatus
from proxy.store.records import CallRecord, EpisodeRecord
from proxy.store.repository import Repository
from proxy.store.rows import json_text

Format = Literal["jsonl", "parquet"]

_TOOL_CALL = pa.struct(
    [
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ]
)
_MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("tool_calls", pa.list_(_TOOL_CALL)),
        ("tool_call_id", pa.string()),
        ("name", pa.string()),
    ]
)
_CHOICE = pa.struct(
    [
        ("index", pa.int32()),
        ("token_ids", pa.list_(pa.int64())),
        ("logprobs", pa.list_(pa.float64())),
        ("loss_mask", pa.list_(pa.int8())),
        ("finish_reason", pa.string()),
        ("text", pa.string()),
        ("tool_calls", pa.list_(_TOOL_CALL)),
        ("reward", pa.float64()),
    ]
)
_CALL = pa.struct(
    [
        ("ordinal", pa.int32()),
        ("kind", pa.string()),
        ("api", pa.string()),
        ("status_code", pa.int32()),
        ("policy_version", pa.int32()),
        ("model_served", pa.string()),
        ("replica", pa.string()),
        ("started_at", pa.float64()),
        ("latency_ms", pa.float64()),
        ("exact_ids", pa.bool_()),
        ("sampling_mode", pa.string()),
        ("temperature", pa.float64()),
        ("trained", pa.bool_()),
        ("prompt_token_ids", pa.list_(pa.int64())),
        ("choices", pa.list_(_CHOICE)),
        ("notes", pa.string()),
    ]
)
SCHEMA = pa.schema(
    [
        ("episode_id", pa.string()),
        ("group_id", pa.string()),
        ("group_index", pa.int32()),
        ("task_id", pa.string()),
        ("status", pa.string()),
        ("reward", pa.float64()),
        ("advantage", pa.float64()),
        ("abandon_reason", pa.string()),
        ("abandon_cause", pa.string()),
        ("fork_of", pa.string()),
        ("fork_at", pa.int32()),
        ("diverged_at", pa.int32()),
        ("created_at", pa.float64()),
        ("finished_at", pa.float64()),
        ("policy_versions", pa.list_(pa.int32())),
        ("messages", pa.list_(_MESSAGE)),
        ("tools", pa.string()),
        ("calls", pa.list_(_CALL)),
        ("metadata", pa.string()),
        ("reward_metadata", pa.string()),
        ("fidelity", pa.string()),
        ("purged_at", pa.float64()),
    ]
)
"""One row per episode. JSON-valued fields of free shape (metadata, tools, notes) are JSON text, so
every row has the same columns whatever the agents put there."""


@dataclass(slots=True, frozen=True)
class Filters:
    status: EpisodeStatus | None = None
    task: str | None = None
    """A substring of the task id (as the dashboard's filter)."""
    since: float | None = None
    """Episodes created at or after this epoch second."""


def parse_since(raw: str) -> float:
    """Epoch seconds, or an ISO 8601 date or time (UTC unless it names its zone)."""
    try:
        return float(raw)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(raw)
    except ValueError as exc:
        raise ValueError(f"since: {raw!r} is neither epoch seconds nor an ISO 8601 date or time") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()


def group_advantages(rewards: dict[str, float]) -> dict[str, float]:
    """Each rewarded episode's reward minus its group's mean, over the group's std (GRPO's
    ``scale_rewards: group``), from episode id -> reward; none with fewer than two."""
    if len(rewards) < 2:
        return {}
    mean = statistics.fmean(rewards.values())
    std = statistics.pstdev(rewards.values())
    return {eid: (r - mean) / std if std > 0 else 0.0 for eid, r in rewards.items()}


# -- records to rows ---------------------------------------------------------------------------------


def _json(value: Any) -> str | None:
    return None if value is None else json_text(value)


def _text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    return json_text(content)


def _tool_calls(raw: Any) -> list[dict[str, Any]]:
    out = []
    for item in raw if isinstance(raw, list) else ():
        if not isinstance(item, dict):
            continue
        function = item.get("function")
        if not isinstance(function, dict):
            function = {}
        arguments = function.get("arguments")
        out.append(
            {
                "id": item.get("id"),
                "type": item.get("type") or "function",
                "function": {
                    "name": function.get("name"),
                    "arguments": arguments if isinstance(arguments, str) or arguments is None else json_text(arguments),
                },
            }
        )
    return out


def _message(raw: dict[str, Any]) -> dict[str, Any]:
    name = raw.get("name")
    tool_call_id = raw.get("tool_call_id")
    return {
        "role": str(raw.get("role", "")),
        "content": _text(raw.get("content")),
        "tool_calls": _tool_calls(raw.get("tool_calls")),
        "tool_call_id": tool_call_id if isinstance(tool_call_id, str) else None,
        "name": name if isinstance(name, str) else None,
    }


def _sampling(call: CallRecord) -> tuple[str | None, float | None, bool]:
    """(mode, temperature, trained in that mode) as the proxy recorded the effective sampling."""
    recorded = (call.notes or {}).get("sampling")
    if not isinstance(recorded, dict):
        return None, None, False
    mode = recorded.get("mode")
    temperature = recorded.get("temperature")
    constrained_out = mode == "constrained" and (
        recorded.get("constrained") == "exclude" or not recorded.get("grammar")
    )
    replayed = (call.notes or {}).get("replay") is not None  # a fork's replayed call: its source trained it
    trained = mode in TRAINED_MODES and not constrained_out and not replayed
    return (
        mode if isinstance(mode, str) else None,
        float(temperature) if isinstance(temperature, int | float) else None,
        trained,
    )


def _reward(call_rewards: dict[str, float] | None, ordinal: int, index: int) -> float | None:
    rewards = call_rewards or {}
    value = rewards.get(f"{ordinal}:{index}", rewards.get(str(ordinal)))
    return float(value) if value is not None else None


def call_trained(call: CallRecord) -> bool:
    """Whether the trainer would train this call's sampled tokens (``trainer/turns.py``): answered,
    served by a policy version, exact ids, sampled in a trained mode (``contract/trainability.py``)."""
    return untrained(call) is None


def loss_mask(call: CallRecord, ids: list[int], logprobs: list[float]) -> list[int]:
    """Per sampled token of one choice, 1 where the trainer trains it: none of an untrained call's;
    of a constrained call, those the grammar did not force (log-prob exactly 0: no decision made)."""
    if not call_trained(call):
        return [0] * len(ids)
    if _sampling(call)[0] == "constrained" and len(logprobs) == len(ids):
        return [0 if lp == 0.0 else 1 for lp in logprobs]
    return [1] * len(ids)


def _call(call: CallRecord, call_rewards: dict[str, float] | None) -> dict[str, Any]:
    mode, temperature, _ = _sampling(call)
    choices = []
    for raw in call.choices:
        index = int(raw.get("index", 0))
        ids = [int(t) for t in raw.get("token_ids") or []]
        logprobs = [float(x) for x in raw.get("logprobs") or []]
        mask = loss_mask(call, ids, logprobs)
        choices.append(
            {
                "index": index,
                "token_ids": ids,
                "logprobs": logprobs,
                "loss_mask": mask,
                "finish_reason": raw.get("finish_reason"),
                "text": raw.get("text"),
                "tool_calls": _tool_calls(raw.get("tool_calls")),
                "reward": _reward(call_rewards, call.ordinal, index),
            }
        )
    return {
        "ordinal": call.ordinal,
        "kind": call.kind,
        "api": call.api,
        "status_code": call.status_code,
        "policy_version": call.policy_version,
        "model_served": call.model_served,
        "replica": call.replica,
        "started_at": call.started_at,
        "latency_ms": call.latency_ms,
        "exact_ids": call.exact_ids,
        "sampling_mode": mode,
        "temperature": temperature,
        "trained": call_trained(call),
        "prompt_token_ids": [int(t) for t in call.prompt_token_ids or []],
        "choices": choices,
        "notes": _json(call.notes),
    }


def _conversation(calls: list[CallRecord]) -> tuple[list[dict[str, Any]], str | None]:
    """The last answered chat call's messages plus its first answer, and the tools it offered."""
    for call in reversed(calls):
        messages = call.request.get("messages")
        if call.status_code != 200 or not call.choices or not isinstance(messages, list):
            continue
        answer = call.choices[0]
        final = {
            "role": "assistant",
            "content": answer.get("text"),
            "tool_calls": _tool_calls(answer.get("tool_calls")),
            "tool_call_id": None,
            "name": None,
        }
        tools = call.request.get("tools")
        return [_message(m) for m in messages if isinstance(m, dict)] + [final], _json(tools) if tools else None
    return [], None


def episode_row(episode: EpisodeRecord, advantage: float | None) -> dict[str, Any]:
    """One dataset row (``SCHEMA``) from an episode read with its calls."""
    calls = episode.calls or []
    messages, tools = _conversation(calls)
    return {
        "episode_id": episode.id,
        "group_id": episode.group_id,
        "group_index": episode.group_index,
        "task_id": episode.task_id,
        "status": episode.status,
        "reward": episode.reward,
        "advantage": advantage,
        "abandon_reason": episode.abandon_reason,
        "abandon_cause": episode.abandon_cause,
        "fork_of": episode.fork_of,
        "fork_at": episode.fork_at,
        "diverged_at": episode.diverged_at,
        "created_at": episode.created_at,
        "finished_at": episode.finished_at,
        "policy_versions": sorted({c.policy_version for c in calls if c.policy_version is not None}),
        "messages": messages,
        "tools": tools,
        "calls": [_call(c, episode.call_rewards) for c in calls],
        "metadata": _json(episode.metadata),
        "reward_metadata": _json(episode.reward_metadata),
        "fidelity": _json(fidelity(episode)),
        "purged_at": episode.purged_at,
    }


def fidelity(episode: EpisodeRecord) -> dict[str, Any]:
    """Whether what was trained is what was sampled, for one episode: what the proxy did to its
    calls (spliced, splice skipped and why, the splice's shadow check: calls checked and mismatches
    by cause; refused, answered to a client that had left) and, once its group was trained, the
    trainer's audit from the ack (``trainer/audit.py``; None before); ``untrainable``: why none of its
    calls trains, with the fix (``contract/trainability.py``), or None."""
    calls = episode.calls or []
    spliced = unchanged = checked = 0
    skipped: dict[str, int] = {}
    mismatched: dict[str, int] = {}
    for call in calls:
        note = (call.notes or {}).get("splice")
        if not isinstance(note, dict):
            continue
        shadow = note.get("shadow")
        if isinstance(shadow, dict) and shadow.get("checked"):
            checked += 1
            if shadow.get("mismatch"):
                cause = str(shadow["mismatch"])
                mismatched[cause] = mismatched.get(cause, 0) + 1
        if "skipped" in note:
            reason = str(note["skipped"])
            skipped[reason] = skipped.get(reason, 0) + 1
        elif note.get("changed"):
            spliced += 1
        else:
            unchanged += 1
    return {
        "calls": len(calls),
        "answered": sum(c.status_code == 200 for c in calls),
        "refused": sum(bool((c.notes or {}).get("refused")) for c in calls),
        "not_delivered": sum(c.status_code == 499 for c in calls),
        "replayed": sum((c.notes or {}).get("replay") is not None for c in calls),
        "spliced": spliced,
        "splice_unchanged": unchanged,
        "splice_skipped": skipped,
        "splice_shadow": {"checked": checked, "mismatch": mismatched},
        "trainer": episode.train_audit,
        "untrainable": None if (why := untrainable(calls)) is None else {"reason": why, "fix": FIX[why]},
    }


# -- streaming ----------------------------------------------------------------------------------------


async def pages(repo: Repository, filters: Filters, *, page: int = 100) -> AsyncIterator[list[dict[str, Any]]]:
    """Rows, a page at a time, oldest episode first; only one page is held at once."""
    after = None
    while True:
        episodes, rewards = await repo.browse.export_page(
            status=filters.status, task=filters.task, since=filters.since, after=after, limit=page
        )
        if not episodes:
            return
        advantages = {gid: group_advantages(r) for gid, r in rewards.items()}
        yield [episode_row(e, advantages.get(e.group_id or "", {}).get(e.id)) for e in episodes]
        if len(episodes) < page:
            return
        after = (episodes[-1].created_at, episodes[-1].id)


def jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


class _Sink(io.RawIOBase):
    """A write-only stream that hands over what was written since the last ``take``."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []
        self._written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self._parts.append(chunk)
        self._written += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self._written

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


async def stream(
    repo: Repository,
    filters: Filters,
    fmt: Format,
    *,
    page: int = 100,
    on_page: Callable[[int], None] | None = None,
) -> AsyncIterator[bytes]:
    """The export as bytes, chunk by chunk (a file, or an HTTP body): one chunk per page.
    ``on_page`` is told each page's row count."""
    if fmt == "jsonl":
        async for rows in pages(repo, filters, page=page):
            if on_page is not None:
                on_page(len(rows))
            yield jsonl(rows)
        return
    sink = _Sink()
    writer = pq.ParquetWriter(sink, SCHEMA, compression="zstd")
    try:
        async for rows in pages(repo, filters, page=page):
            if on_page is not None:
                on_page(len(rows))
            writer.write_table(pa.Table.from_pylist(rows, schema=SCHEMA), row_group_size=len(rows))
            yield sink.take()
    finally:
        writer.close()
    yield sink.take()  # the footer (an export with no rows is still a valid, empty Parquet file)
