"""Rows and records: how a ``NewCall`` becomes a ``calls`` row, for both writers: the SQLAlchemy engines (SQLite or
PostgreSQL) and the SQLite fast path (``sqlite_fast``).

One place decides which calls are admitted (their episode is still open inside the inserting
transaction), the ordinals, each column's Python type, the JSON text (the engines are built
with ``json_text`` as their serializer) and the compact layout (``delta``: binary ids, prompts and
messages as deltas on the episode's last call), so a call reads back the same, type for type,
whichever writer stored it and on either database. And the one mapping back, rows to whole
records, for every reader (the repository, the dashboard's ``browse``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import orjson
from sqlalchemy import JSON, Boolean, Float, select
from sqlalchemy.ext.asyncio import AsyncSession

from proxy.store.delta import COMPACT, PACKED_COLUMNS, Heavy, Packed, Tail, pack, stored, tail_of, unpack
from proxy.store.models import Call, Episode, Group
from proxy.store.records import CallDelta, CallRecord, EpisodeRecord, GroupRecord, NewCall

CALL_FIELDS = [f.name for f in fields(NewCall)]
"""The columns a ``NewCall`` fills, in ``NewCall`` order (the store adds ``id`` and ``ordinal``)."""
ROW_FIELDS = [*CALL_FIELDS, "encoding", *PACKED_COLUMNS]
"""The columns a writer fills (``CALL_FIELDS``, then the compact layout's), in ``row_values`` order."""
CHAIN_COLUMNS = [
    "episode_id",
    "ordinal",
    "request",
    "prompt_token_ids",
    "choices",
    "client_request",
    "encoding",
    *PACKED_COLUMNS,
]
"""What rebuilding a call's large fields reads (``heavies``)."""

_COLUMN_TYPES = {c.name: c.type for c in Call.__table__.columns}
JSON_COLUMNS = frozenset(name for name in ROW_FIELDS if isinstance(_COLUMN_TYPES[name], JSON))
_HEAVY = ("request", "prompt_token_ids", "choices", "client_request")
"""The fields the compact layout may store as deltas (``delta.Heavy``)."""
_HEAVY_AT = {name: CALL_FIELDS.index(name) for name in _HEAVY}
_FLOAT_AT = [i for i, name in enumerate(CALL_FIELDS) if isinstance(_COLUMN_TYPES[name], Float)]
_BOOL_AT = [i for i, name in enumerate(CALL_FIELDS) if isinstance(_COLUMN_TYPES[name], Boolean)]


def json_text(value: Any) -> str:
    """The JSON text every writer stores: compact UTF-8 from orjson (None is the JSON ``null``).

    Integers past 64 bits, which orjson refuses, fall back to the standard library in the same
    compact form. NaN and infinity never get here: the HTTP edge refuses them.
    """
    try:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def admit(
    calls: Sequence[NewCall], states: dict[str, tuple[str, int | None]]
) -> tuple[list[tuple[int, NewCall]], dict[str, str | None]]:
    """Split a batch by its episodes' state as read inside the inserting transaction.

    ``states`` maps episode id -> (status, highest stored ordinal or None). Calls of open episodes
    come back with their ordinals; the others are refused, as episode id -> its status (None: no
    such episode). A call that reaches the store after its episode was rewarded or abandoned is
    never stored: its group may already be complete and claimed for training.
    """
    refused: dict[str, str | None] = {}
    for episode_id in {c.episode_id for c in calls}:
        state = states.get(episode_id)
        if state is None or state[0] != "open":
            refused[episode_id] = state[0] if state is not None else None
    admitted = [c for c in calls if c.episode_id not in refused] if refused else calls
    stored_max = {eid: last for eid, (_, last) in states.items() if last is not None}
    return with_ordinals(admitted, stored_max), refused


def with_ordinals(calls: Sequence[NewCall], stored_max: dict[str, int]) -> list[tuple[int, NewCall]]:
    """Ordinals continue per episode from the stored maximum, in start order (ties keep batch order)."""
    next_ordinal = {c.episode_id: stored_max.get(c.episode_id, -1) for c in calls}
    out = []
    for call in sorted(calls, key=lambda c: c.started_at):
        next_ordinal[call.episode_id] += 1
        out.append((next_ordinal[call.episode_id], call))
    return out


def call_values(call: NewCall) -> list[Any]:
    """The column values of ``call`` in ``CALL_FIELDS`` order, as the column types read back
    (an int latency is a float on PostgreSQL, so it is written as one everywhere)."""
    values = [getattr(call, name) for name in CALL_FIELDS]
    for i in _FLOAT_AT:
        if values[i] is not None:
            values[i] = float(values[i])
    for i in _BOOL_AT:
        if values[i] is not None:
            values[i] = bool(values[i])
    return values


@dataclass(slots=True)
class Layout:
    """How calls were stored: the counts a store's growth is read from (``/metrics``)."""

    calls_delta: int = 0
    """Calls stored as a delta on an earlier call (prompt ids, messages or both)."""
    calls_whole: int = 0
    """Calls stored whole: an episode's first call, a break, or a call whose ids or messages could
    not be compared exactly."""
    base_reads: int = 0
    """Episodes whose last call was read back from the store (not in the writer's cache)."""

    def add(self, other: Layout) -> None:
        self.calls_delta += other.calls_delta
        self.calls_whole += other.calls_whole
        self.base_reads += other.base_reads


def row_values(ordinal: int, call: NewCall, base: Tail | None) -> tuple[list[Any], Packed]:
    """The values of ``call``'s row in ``ROW_FIELDS`` order (``ordinal`` apart), deltas against
    ``base`` where exact, and the packed form (its ``tail`` is what the next call may extend)."""
    packed = pack(ordinal, Heavy(call.request, call.prompt_token_ids, call.choices, call.client_request), base)
    values = call_values(call)
    for name in _HEAVY:
        values[_HEAVY_AT[name]] = getattr(packed, name)
    values += [COMPACT, *(getattr(packed, name) for name in PACKED_COLUMNS)]
    return values, packed


def uncached(
    admitted: Sequence[tuple[int, NewCall]],
    states: Mapping[str, tuple[str, int | None]],
    bases: Mapping[str, Tail | None],
) -> list[str]:
    """Episodes of the batch with stored calls but no cached last call: their base is read from the store."""
    return sorted(
        {c.episode_id for _, c in admitted if bases.get(c.episode_id) is None and states[c.episode_id][1] is not None}
    )


def last_tail(rows: Iterable[Any]) -> Tail | None:
    """The last call of one episode's rows (``CHAIN_COLUMNS``, ordinal order) a later call may extend."""
    tail = None
    for ordinal, heavy in heavies(rows):
        tail = tail_of(ordinal, heavy) or tail
    return tail


def pack_batch(
    admitted: Sequence[tuple[int, NewCall]], bases: Mapping[str, Tail | None], layout: Layout
) -> tuple[list[tuple[int, list[Any]]], dict[str, Tail]]:
    """Every admitted call's row values, each a delta on its episode's previous usable call where
    exact (``bases``: the last one stored, then the batch's own); the episodes' new last calls."""
    tails = {eid: tail for eid, tail in bases.items() if tail is not None}
    out = []
    changed: dict[str, Tail] = {}
    for ordinal, call in admitted:  # in start order: an episode's ordinals rise along the batch
        values, packed = row_values(ordinal, call, tails.get(call.episode_id))
        if packed.delta:
            layout.calls_delta += 1
        else:
            layout.calls_whole += 1
        if packed.tail is not None:
            tails[call.episode_id] = changed[call.episode_id] = packed.tail
        out.append((ordinal, values))
    return out, changed


def episode_record(row: Episode, calls: list[CallRecord] | None = None) -> EpisodeRecord:
    return EpisodeRecord(
        id=row.id,
        group_id=row.group_id,
        group_index=row.group_index,
        task_id=row.task_id,
        metadata=row.meta or {},
        status=row.status,
        reward=row.reward,
        call_rewards=row.call_rewards,
        reward_metadata=row.reward_metadata,
        abandon_reason=row.abandon_reason,
        created_at=row.created_at,
        finished_at=row.finished_at,
        calls=calls,
        train_audit=row.train_audit,
        abandon_cause=row.abandon_cause,
        fork_of=row.fork_of,
        fork_at=row.fork_at,
        fork_rule=row.fork_rule,
        diverged_at=row.diverged_at,
        divergence=row.divergence,
        purged_at=row.purged_at,
        awaiting_since=row.awaiting_since,
        policy_arm=row.policy_arm,
        canary_version=row.canary_version,
    )


def group_record(row: Group, episodes: list[EpisodeRecord] | None = None) -> GroupRecord:
    counts: dict[str, int] = {}
    for episode in episodes or []:
        counts[episode.status] = counts.get(episode.status, 0) + 1
    return GroupRecord(
        id=row.id,
        task_id=row.task_id,
        size=row.size,
        metadata=row.meta or {},
        status=row.status,
        created_at=row.created_at,
        completed_at=row.completed_at,
        train_status=row.train_status,
        trained_step=row.trained_step,
        train_note=row.train_note,
        train_reason=row.train_reason,
        episodes=episodes,
        counts=counts,
    )


_LIGHT_COLUMNS = [f.name for f in fields(CallRecord) if f.name not in (*_HEAVY, "delta")]


def heavies(rows: Iterable[Any]) -> Iterable[tuple[int, Heavy]]:
    """(ordinal, large fields whole) of each row; rows of an episode come in ordinal order, so a
    delta's base (an earlier call of its episode) is always rebuilt before it."""
    episodes: dict[str, dict[int, Heavy]] = {}
    for row in rows:
        bases = episodes.setdefault(row.episode_id, {})
        heavy = bases[row.ordinal] = unpack(row, bases)
        yield row.ordinal, heavy


def call_records(rows: Sequence[Any], *, delta: bool = False) -> list[CallRecord]:
    """Rows of whole episodes (or of each episode's first calls), by episode and ordinal, as whole
    records; with ``delta``, a row stored as a delta stays one (``CallRecord.delta`` says how it
    joins its base), so a reader that rejoins them gets the same records for a fraction of the bytes."""
    if delta:
        return [_record(row, stored(row), _delta(row)) for row in rows]
    return [_record(row, heavy, None) for row, (_, heavy) in zip(rows, heavies(rows), strict=True)]


def _record(row: Any, heavy: Heavy, delta: CallDelta | None) -> CallRecord:
    return CallRecord(
        **{name: getattr(row, name) for name in _LIGHT_COLUMNS},
        request=heavy.request,
        prompt_token_ids=heavy.prompt_token_ids,
        choices=heavy.choices,
        client_request=heavy.client_request,
        delta=delta,
    )


def _delta(row: Any) -> CallDelta | None:
    if not row.encoding or row.base_ordinal is None:
        return None
    return CallDelta(row.base_ordinal, row.prompt_choice, row.messages_from, row.client_from)


async def group_records(session: AsyncSession, groups: Sequence[Group]) -> list[GroupRecord]:
    """``groups`` as records with their episodes (one query for all of them, in group order)."""
    ids = [g.id for g in groups]
    episodes = (
        (await session.scalars(select(Episode).where(Episode.group_id.in_(ids)).order_by(Episode.group_index))).all()
        if ids
        else []
    )
    by_group: dict[str, list[EpisodeRecord]] = {gid: [] for gid in ids}
    for episode in episodes:
        by_group[episode.group_id or ""].append(episode_record(episode))
    return [group_record(g, by_group[g.id]) for g in groups]
