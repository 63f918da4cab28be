"""Calls: the recorder's group commit (``insert``) and the reads of stored calls.

``insert`` is the hot path: a batch of calls in one transaction, each admitted only while its
episode is open inside that very transaction. On PostgreSQL it locks group rows, then episode rows,
each in id order (the order rewards take them); on SQLite ``BEGIN IMMEDIATE`` serialises it with
every other writer. On a SQLite file the batch takes the fast path (``sqlite_fast.py``), which
writes the very rows the engine path writes (``rows.py``). Each episode's last stored call is kept
in ``Tails`` (the base of its next call's deltas) once its batch committed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from sqlalchemy import Select, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from proxy.errors import EpisodeClosed, FlywheelError, NotFound, RecordingFailed
from proxy.store.delta import Tail, Tails
from proxy.store.faults import translated
from proxy.store.models import Call, Episode, Group
from proxy.store.records import CallRecord, NewCall
from proxy.store.rows import CHAIN_COLUMNS, ROW_FIELDS, Layout, admit, call_records, last_tail, pack_batch, uncached
from proxy.store.sessions import Sessions

log = logging.getLogger("flywheel.store")


def _episode_states(episode_ids: list[str]) -> Select[str, str, int | None]:
    """Each episode's status and highest stored ordinal (None for one without calls), as a query:
    one max() per episode (an index seek) instead of GROUP BY over every call of the episodes."""
    last = select(func.max(Call.ordinal)).where(Call.episode_id == Episode.id).correlate(Episode).scalar_subquery()
    return select(Episode.id, Episode.status, last).where(Episode.id.in_(episode_ids))


def _refusal(episode_id: str, status: str | None) -> FlywheelError:
    if status is None:
        return NotFound(f"episode {episode_id} not found", param="episode_id", code="episode_not_found")
    return EpisodeClosed(
        f"episode {episode_id} was {status} before this call's record was written; the call was not recorded",
        code="episode_closed",
    )


async def episode_calls(session: AsyncSession, episode_id: str, *, through: int | None = None) -> list[CallRecord]:
    """An episode's calls in ordinal order, up to ordinal ``through``: a delta's bases come with it."""
    query = select(Call.__table__).where(Call.episode_id == episode_id)
    if through is not None:
        query = query.where(Call.ordinal <= through)
    return call_records((await session.execute(query.order_by(Call.ordinal))).all())


class Calls:
    """The calls aggregate. ``layout`` counts how calls were stored (``/metrics``)."""

    def __init__(self, sessions: Sessions, tails: Tails, layout: Layout) -> None:
        self._sessions = sessions
        self._tails = tails
        self.layout = layout

    async def insert(self, calls: Sequence[NewCall]) -> list[FlywheelError | None]:
        """Write a batch of calls in one transaction (group commit); per call, None (stored) or why not.

        A call is stored only if its episode is still open inside this very transaction, so a call
        that arrives after its episode was rewarded or abandoned (in flight meanwhile, or let in by
        another proxy's gate cache) is refused (``EpisodeClosed``), never stored after its group may
        have been claimed. Ordinals continue from the stored maximum. On PostgreSQL the group rows,
        then the episode rows, are locked in id order (the order rewards take them), so a reward
        either commits first (the call is refused) or waits for this insert; on SQLite ``BEGIN
        IMMEDIATE`` serialises the two.
        """
        if not calls:
            return []
        bases = {c.episode_id: self._tails.get(c.episode_id) for c in calls}
        try:
            refused, tails, layout = await self._insert_batch(calls, bases)
        except IntegrityError as exc:
            if len(calls) == 1:
                log.error("a call record was refused by the store", extra={"error": repr(exc)})
                return [RecordingFailed("the store refused the call's record (IntegrityError)")]
            outcomes: list[FlywheelError | None] = []
            for call in calls:  # one bad record must not sink the batch
                outcomes += await self.insert([call])
            return outcomes
        for episode_id, tail in tails.items():  # committed: later calls may extend them
            self._tails.put(episode_id, tail)
        self.layout.add(layout)
        if not refused:
            return [None] * len(calls)
        return [_refusal(c.episode_id, refused[c.episode_id]) if c.episode_id in refused else None for c in calls]

    async def _insert_batch(
        self, calls: Sequence[NewCall], bases: dict[str, Tail | None]
    ) -> tuple[dict[str, str | None], dict[str, Tail], Layout]:
        fast = self._sessions.fast
        if fast is not None:
            async with translated():
                return await fast.insert_calls(calls, bases)
        async with self._sessions.connect() as conn:
            return await self._insert(conn, calls, bases)

    async def _insert(
        self, conn: AsyncConnection, calls: Sequence[NewCall], bases: dict[str, Tail | None]
    ) -> tuple[dict[str, str | None], dict[str, Tail], Layout]:
        episode_ids = sorted({c.episode_id for c in calls})
        states = _episode_states(episode_ids)
        if not self._sessions.sqlite:  # the lock order: group rows, then episode rows, each sorted by id
            groups = select(Episode.group_id).where(Episode.id.in_(episode_ids), Episode.group_id.is_not(None))
            await conn.execute(select(Group.id).where(Group.id.in_(groups)).order_by(Group.id).with_for_update())
            states = states.order_by(Episode.id).with_for_update(of=Episode)
        found = {eid: (status, last) for eid, status, last in (await conn.execute(states)).all()}
        admitted, refused = admit(calls, found)
        layout = Layout()
        if not admitted:
            return refused, {}, layout
        bases = dict(bases)
        chain = [Call.__table__.c[name] for name in CHAIN_COLUMNS]
        for episode_id in uncached(admitted, found, bases):  # not cached here: read its last call
            layout.base_reads += 1
            rows = await conn.execute(select(*chain).where(Call.episode_id == episode_id).order_by(Call.ordinal))
            bases[episode_id] = last_tail(rows.all())
        values, tails = pack_batch(admitted, bases, layout)
        await conn.execute(
            insert(Call), [dict(zip(ROW_FIELDS, row, strict=True)) | {"ordinal": ordinal} for ordinal, row in values]
        )
        return refused, tails, layout

    async def count(self, episode_id: str | None = None) -> int:
        """Stored calls, of one episode or of all."""
        query = select(func.count()).select_from(Call)
        if episode_id:
            query = query.where(Call.episode_id == episode_id)
        async with self._sessions.read() as session:
            return (await session.execute(query)).scalar_one()

    async def recent(self, episode_id: str, *, limit: int) -> list[CallRecord]:
        """The episode's newest answered chat calls, newest first: the history a spliced call continues."""
        async with self._sessions.read() as session:
            calls = await episode_calls(session, episode_id)
        answered = [c for c in reversed(calls) if c.kind == "chat" and c.status_code == 200]
        return answered[:limit]

    async def by_response_id(self, response_id: str, episode_id: str | None = None) -> CallRecord | None:
        """The answered call a client saw as ``response_id`` (a Responses ``previous_response_id``),
        ``episode_id``'s own first: a fork's replayed answers carry its source's ids (``proxy/replay.py``)."""
        async with self._sessions.read() as session:
            result = await session.execute(
                select(Call.episode_id, Call.ordinal)
                .where(Call.response_id == response_id, Call.status_code == 200)
                .order_by((Call.episode_id == episode_id).desc())
                .limit(1)
            )
            row = result.first()
            if row is None:
                return None
            return (await episode_calls(session, row.episode_id, through=row.ordinal))[-1]
