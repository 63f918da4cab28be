"""The only place that opens transactions and commits.

Every public method is one transaction: it either happens whole or not at all, so no route can
leave a half-written group, episode or reward behind. Writes that must not interleave take row
locks in one fixed order on PostgreSQL, so replicas never deadlock: group rows sorted by id, then
episode rows sorted by id (rewards, abandons, the idle sweep, the recorder's inserts; the trainer
routes lock group rows only). SQLite writers (the writer engine, and the recorder's own
connection) are serialised by ``BEGIN IMMEDIATE``.
On a SQLite file the recorder's group commit and the episode check take the fast path
(``sqlite_fast``), which writes the very rows the engine path writes (``rows``).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final

from sqlalchemy import Select, func, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker

from contract.vocabulary import AbandonCause, AckStatus, EpisodeStatus, GroupStatus, TrainStatus
from proxy.errors import Conflict, EpisodeClosed, FlywheelError, InvalidRequest, NotFound, RecordingFailed
from proxy.store.browse import Browse
from proxy.store.db import CONNECT_TIMEOUT_S, is_sqlite, make_engine, sqlite_file
from proxy.store.delta import Tail, Tails
from proxy.store.faults import translated
from proxy.store.models import Call, Episode, Group, PolicyVersion, TrainerStep
from proxy.store.records import (
    CallRecord,
    Claim,
    EpisodeRecord,
    GroupRecord,
    NewCall,
    PolicyVersionRecord,
    TrainerStepRecord,
)
from proxy.store.rows import (
    CHAIN_COLUMNS,
    ROW_FIELDS,
    Layout,
    admit,
    call_records,
    episode_record,
    group_record,
    group_records,
    last_tail,
    pack_batch,
    uncached,
)
from proxy.store.sqlite_fast import SqliteFastPath

log = logging.getLogger("flywheel.store")

OPEN: Final = "open"
REWARDED: Final = "rewarded"
ABANDONED: Final = "abandoned"
FINISHED = (REWARDED, ABANDONED)


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


def _policy(row: PolicyVersion) -> PolicyVersionRecord:
    return PolicyVersionRecord(
        version=row.version,
        name=row.name,
        adapter_path=row.adapter_path,
        created_at=row.created_at,
        metadata=row.meta or {},
    )


class Repository:
    """Async data access for the proxy: episodes, groups, calls, policy versions, trainer steps."""

    def __init__(
        self,
        url: str,
        *,
        synchronous: str = "NORMAL",
        pool_size: int = 10,
        min_rewarded: int = 2,
        sqlite_fast_path: bool = True,
        timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.url = url
        self.sqlite = is_sqlite(url)
        self.min_rewarded = min_rewarded
        self._reader = make_engine(url, synchronous=synchronous, pool_size=pool_size, timeout_s=timeout_s)
        self._writer: AsyncEngine = (
            make_engine(url, synchronous=synchronous, immediate=True) if self.sqlite else self._reader
        )
        self._read_sessions = async_sessionmaker(self._reader, expire_on_commit=False)
        self._write_sessions = async_sessionmaker(self._writer, expire_on_commit=False)
        self.browse = Browse(self._read)
        """The dashboard's read-only pages and counts (``browse.py``)."""
        # SQLite files: the recorder's group commits and the model routes' episode check each get
        # a plain connection on a thread of their own (see sqlite_fast); the rest uses the engines.
        path = sqlite_file(url) if sqlite_fast_path else None
        self._fast = SqliteFastPath(path, synchronous=synchronous) if path else None
        self._tails = Tails()
        """Each open episode's last stored call, the base of its next call's deltas (``delta.py``)."""
        self.layout = Layout()
        """Calls stored as deltas or whole, and base reads from the store (cache misses)."""

    async def close(self) -> None:
        if self._fast is not None:
            await self._fast.close()
        await self._reader.dispose()
        if self._writer is not self._reader:
            await self._writer.dispose()

    # Every way into the store passes ``translated``: a store that is down, unreachable or full
    # leaves here as ``StoreUnavailable`` or ``StoreFull`` (503, 507), never as a driver's error.
    @asynccontextmanager
    async def _write(self) -> AsyncIterator[AsyncSession]:
        async with translated(), self._write_sessions() as session, session.begin():
            yield session

    @asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncSession]:
        async with translated(), self._read_sessions() as session:
            yield session

    async def ping(self) -> None:
        async with self._read() as session:
            await session.execute(select(1))

    # -- episodes and groups ------------------------------------------------------------------

    async def create_group(
        self,
        *,
        task_id: str,
        size: int,
        metadata: dict[str, Any],
        episode_metadata: Sequence[dict[str, Any]] | None = None,
    ) -> GroupRecord:
        now = time.time()
        group = Group(
            id=str(uuid.uuid4()),
            task_id=task_id,
            size=size,
            meta=metadata,
            status=OPEN,
            created_at=now,
            train_status="pending",
        )
        episodes = [
            Episode(
                id=str(uuid.uuid4()),
                group_id=group.id,
                group_index=i,
                task_id=task_id,
                meta=(episode_metadata[i] if episode_metadata else {}),
                status=OPEN,
                created_at=now,
            )
            for i in range(size)
        ]
        async with self._write() as session:
            session.add(group)
            await session.flush()  # the group row first: episodes reference it
            session.add_all(episodes)
        return group_record(group, [episode_record(e) for e in episodes])

    async def count_backlog(self) -> int:
        """Groups the trainer has still to take: open (in flight) or complete, and not yet trained,
        skipped or stale (leased ones included: they are being trained on the current version)."""
        async with self._read() as session:
            count = await session.scalar(
                select(func.count())
                .select_from(Group)
                .where(Group.train_status == "pending", Group.status.in_((OPEN, "complete")))
            )
        return int(count or 0)

    async def count_groups(self) -> dict[str, int]:
        """Groups by training outcome: ``train_status`` for complete groups, ``open`` and ``failed`` apart."""
        async with self._read() as session:
            rows = (
                await session.execute(
                    select(Group.status, Group.train_status, func.count()).group_by(Group.status, Group.train_status)
                )
            ).all()
        counts: dict[str, int] = {}
        for status, train_status, n in rows:
            key = train_status if status == "complete" else status
            counts[key] = counts.get(key, 0) + int(n)
        return counts

    async def create_episode(self, *, task_id: str | None, metadata: dict[str, Any]) -> EpisodeRecord:
        episode = Episode(
            id=str(uuid.uuid4()), group_id=None, task_id=task_id, meta=metadata, status=OPEN, created_at=time.time()
        )
        async with self._write() as session:
            session.add(episode)
        return episode_record(episode)

    async def episode_state(self, episode_id: str) -> tuple[str, str | None] | None:
        """(status, group_id) of an episode, or None: the model routes' existence check."""
        if self._fast is not None:
            async with translated():
                return await self._fast.episode_state(episode_id)
        async with self._read() as session:
            row = (
                await session.execute(select(Episode.status, Episode.group_id).where(Episode.id == episode_id))
            ).first()
        return (row[0], row[1]) if row else None

    async def get_episode(self, episode_id: str, *, with_calls: bool = True) -> EpisodeRecord:
        async with self._read() as session:
            row = await session.get(Episode, episode_id)
            if row is None:
                raise NotFound(f"episode {episode_id} not found", param="episode_id")
            calls = await self._calls(session, [episode_id]) if with_calls else None
        return episode_record(row, calls.get(episode_id, []) if calls is not None else None)

    async def _calls(
        self, session: AsyncSession, episode_ids: list[str], *, delta: bool = False
    ) -> dict[str, list[CallRecord]]:
        out: dict[str, list[CallRecord]] = {eid: [] for eid in episode_ids}
        if not episode_ids:
            return out
        result = await session.execute(
            select(Call.__table__).where(Call.episode_id.in_(episode_ids)).order_by(Call.episode_id, Call.ordinal)
        )
        for record in call_records(result.all(), delta=delta):
            out[record.episode_id].append(record)
        return out

    async def _episode_calls(
        self, session: AsyncSession, episode_id: str, *, through: int | None = None
    ) -> list[CallRecord]:
        """An episode's calls in ordinal order, up to ordinal ``through``: a delta's bases come with it."""
        query = select(Call.__table__).where(Call.episode_id == episode_id)
        if through is not None:
            query = query.where(Call.ordinal <= through)
        return call_records((await session.execute(query.order_by(Call.ordinal))).all())

    async def recent_calls(self, episode_id: str, *, limit: int) -> list[CallRecord]:
        """The episode's newest answered chat calls, newest first: the history a spliced call continues."""
        async with self._read() as session:
            calls = await self._episode_calls(session, episode_id)
        answered = [c for c in reversed(calls) if c.kind == "chat" and c.status_code == 200]
        return answered[:limit]

    async def call_by_response_id(self, response_id: str) -> CallRecord | None:
        """The answered call a client saw as ``response_id`` (a Responses ``previous_response_id``)."""
        async with self._read() as session:
            result = await session.execute(
                select(Call.episode_id, Call.ordinal)
                .where(Call.response_id == response_id, Call.status_code == 200)
                .limit(1)
            )
            row = result.first()
            if row is None:
                return None
            return (await self._episode_calls(session, row.episode_id, through=row.ordinal))[-1]

    async def list_episodes(
        self,
        *,
        status: EpisodeStatus | None = None,
        group_id: str | None = None,
        task_id: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[EpisodeRecord]:
        query = select(Episode).order_by(Episode.created_at.desc(), Episode.id).limit(limit).offset(offset)
        if status:
            query = query.where(Episode.status == status)
        if group_id:
            query = query.where(Episode.group_id == group_id)
        if task_id:
            query = query.where(Episode.task_id == task_id)
        async with self._read() as session:
            return [episode_record(row) for row in (await session.scalars(query)).all()]

    async def get_group(self, group_id: str) -> GroupRecord:
        async with self._read() as session:
            row = await session.get(Group, group_id)
            if row is None:
                raise NotFound(f"group {group_id} not found", param="group_id")
            episodes = (
                await session.scalars(
                    select(Episode).where(Episode.group_id == group_id).order_by(Episode.group_index, Episode.id)
                )
            ).all()
        return group_record(row, [episode_record(e) for e in episodes])

    async def list_groups(
        self,
        *,
        status: GroupStatus | None = None,
        task_id: str | None = None,
        train_status: TrainStatus | None = None,
        leased: bool | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[GroupRecord]:
        """Newest first; ``leased`` keeps the groups under a live trainer lease (True) or the others (False)."""
        query = select(Group).order_by(Group.created_at.desc(), Group.id).limit(limit).offset(offset)
        if status:
            query = query.where(Group.status == status)
        if task_id:
            query = query.where(Group.task_id == task_id)
        if train_status:
            query = query.where(Group.train_status == train_status)
        if leased is not None:
            live = Group.lease_id.is_not(None) & (Group.lease_expires_at >= time.time())
            query = query.where(live if leased else ~live)
        async with self._read() as session:
            return await group_records(session, (await session.scalars(query)).all())

    async def _lock_group(self, session: AsyncSession, group_id: str | None) -> None:
        """Serialise group completion: two rewards of one group must not both miss the other."""
        if group_id is not None:
            await session.execute(select(Group.id).where(Group.id == group_id).with_for_update())

    @staticmethod
    def _locked_groups(*where: Any) -> Select[Group]:
        """Group rows matching ``where``, locked in id order (the one lock order; a no-op on SQLite)."""
        return select(Group).where(*where).order_by(Group.id).with_for_update()

    async def _complete_group(self, session: AsyncSession, group_id: str | None, now: float) -> None:
        if group_id is None:
            return
        counts: dict[EpisodeStatus, int] = dict(
            (
                await session.execute(
                    select(Episode.status, func.count()).where(Episode.group_id == group_id).group_by(Episode.status)
                )
            ).all()
        )
        if counts.get(OPEN, 0) > 0:
            return
        # A group smaller than min_rewarded (a lone episode whose n > 1 choices carry their own rewards)
        # completes when all of it is rewarded: the trainer decides whether its members compare.
        needed = min(self.min_rewarded, sum(counts.values()))
        status: GroupStatus = "complete" if counts.get(REWARDED, 0) >= needed else "failed"
        await session.execute(
            update(Group).where(Group.id == group_id, Group.status == OPEN).values(status=status, completed_at=now)
        )

    async def _episode_for_update(self, session: AsyncSession, episode_id: str) -> Episode:
        group_id = (await session.execute(select(Episode.group_id).where(Episode.id == episode_id))).scalar()
        await self._lock_group(session, group_id)
        row = (await session.scalars(select(Episode).where(Episode.id == episode_id).with_for_update())).first()
        if row is None:
            raise NotFound(f"episode {episode_id} not found", param="episode_id")
        return row

    async def set_reward(
        self, episode_id: str, *, reward: float, call_rewards: dict[str, float] | None, metadata: dict[str, Any] | None
    ) -> tuple[EpisodeRecord, bool]:
        """Reward and finish an episode. Returns (episode, changed); the same payload twice is a
        no-op, a different one is a ``Conflict``."""
        async with self._write() as session:
            row = await self._episode_for_update(session, episode_id)
            if row.status == REWARDED:
                same = (
                    row.reward == reward
                    and (row.call_rewards or None) == (call_rewards or None)
                    and (row.reward_metadata or None) == (metadata or None)
                )
                if same:
                    return episode_record(row), False
                raise Conflict(
                    f"episode {episode_id} already has a different reward ({row.reward})", code="reward_conflict"
                )
            if row.status == ABANDONED:
                raise Conflict(
                    f"episode {episode_id} was abandoned ({row.abandon_reason}); it takes no reward",
                    code="episode_abandoned",
                )
            if call_rewards:
                await self._check_ordinals(session, episode_id, call_rewards)
            now = time.time()
            row.status, row.reward, row.finished_at = REWARDED, reward, now
            self._tails.drop(episode_id)
            row.call_rewards, row.reward_metadata = call_rewards or None, metadata or None
            await session.flush()
            await self._complete_group(session, row.group_id, now)
            return episode_record(row), True

    async def _check_ordinals(self, session: AsyncSession, episode_id: str, call_rewards: dict[str, float]) -> None:
        """Keys are ``"<ordinal>"`` (a call) or ``"<ordinal>:<choice>"`` (one choice of an n > 1 call)."""
        count = (await session.execute(select(func.count()).where(Call.episode_id == episode_id))).scalar_one()
        parsed = {k: k.partition(":") for k in call_rewards}
        bad = [
            k
            for k, (ordinal, sep, choice) in parsed.items()
            if not (ordinal.isdigit() and int(ordinal) < count and (not sep or choice.isdigit()))
        ]
        if bad:
            raise InvalidRequest(
                f"call_rewards names calls {bad} but the episode has {count} calls "
                f"(keys: ordinals 0..{count - 1}, or '<ordinal>:<choice>')",
                param="call_rewards",
            )
        wanted = {int(o) for o, sep, _ in parsed.values() if sep}
        if not wanted:
            return
        rows = await session.execute(
            select(Call.ordinal, Call.choices).where(Call.episode_id == episode_id, Call.ordinal.in_(wanted))
        )
        choices = {ordinal: len(stored or []) for ordinal, stored in rows.all()}
        bad = [k for k, (o, sep, c) in parsed.items() if sep and int(c) >= choices.get(int(o), 0)]
        if bad:
            raise InvalidRequest(
                f"call_rewards names choices {bad} that those calls do not have (choices per call: {choices})",
                param="call_rewards",
            )

    async def abandon(self, episode_id: str, *, reason: str, cause: AbandonCause = "agent") -> EpisodeRecord:
        async with self._write() as session:
            row = await self._episode_for_update(session, episode_id)
            if row.status == REWARDED:
                raise Conflict(f"episode {episode_id} is already rewarded", code="episode_rewarded")
            if row.status == OPEN:
                now = time.time()
                row.status, row.abandon_reason, row.abandon_cause, row.finished_at = ABANDONED, reason, cause, now
                self._tails.drop(episode_id)
                await session.flush()
                await self._complete_group(session, row.group_id, now)
            return episode_record(row)

    async def abandon_expired(self, *, idle_s: float) -> int:
        """Abandon open episodes idle (no call, no reward) for ``idle_s``; returns how many."""
        now = time.time()
        last_call = (
            select(func.max(Call.started_at)).where(Call.episode_id == Episode.id).correlate(Episode).scalar_subquery()
        )
        idle = select(Episode.id, Episode.group_id).where(
            Episode.status == OPEN, func.coalesce(last_call, Episode.created_at) < now - idle_s
        )
        async with self._write() as session:
            expired = (await session.execute(idle)).all()
            if not expired:
                return 0
            groups = sorted({g for _, g in expired if g})
            if groups:  # the lock order: group rows, then episode rows, each sorted by id
                await session.execute(select(Group.id).where(Group.id.in_(groups)).order_by(Group.id).with_for_update())
            # Locked, the episodes are checked again: a call or a reward may have come in since the scan.
            ids = list(
                (
                    await session.scalars(
                        idle.with_only_columns(Episode.id)
                        .where(Episode.id.in_(sorted(e for e, _ in expired)))
                        .order_by(Episode.id)
                        .with_for_update()
                    )
                ).all()
            )
            if not ids:
                return 0
            await session.execute(
                update(Episode)
                .where(Episode.id.in_(ids))
                .values(
                    status=ABANDONED,
                    abandon_reason=f"no reward within {idle_s:.0f}s",
                    abandon_cause="deadline",
                    finished_at=now,
                )
            )
            for group_id in groups:
                await self._complete_group(session, group_id, now)
        return len(ids)

    # -- calls: the recorder's hot path ---------------------------------------------------------

    async def insert_calls(self, calls: Sequence[NewCall]) -> list[FlywheelError | None]:
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
                outcomes += await self.insert_calls([call])
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
        async with translated():
            if self._fast is not None:
                return await self._fast.insert_calls(calls, bases)
            async with self._writer.begin() as conn:
                return await self._insert(conn, calls, bases)

    async def _insert(
        self, conn: AsyncConnection, calls: Sequence[NewCall], bases: dict[str, Tail | None]
    ) -> tuple[dict[str, str | None], dict[str, Tail], Layout]:
        episode_ids = sorted({c.episode_id for c in calls})
        states = _episode_states(episode_ids)
        if not self.sqlite:  # the lock order: group rows, then episode rows, each sorted by id
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

    async def count_calls(self, episode_id: str | None = None) -> int:
        query = select(func.count()).select_from(Call)
        if episode_id:
            query = query.where(Call.episode_id == episode_id)
        async with self._read() as session:
            return (await session.execute(query)).scalar_one()

    # -- policy versions ----------------------------------------------------------------------

    async def current_policy(self) -> PolicyVersionRecord | None:
        async with self._read() as session:
            row = (await session.scalars(select(PolicyVersion).order_by(PolicyVersion.version.desc()).limit(1))).first()
        return _policy(row) if row else None

    async def next_policy_version(self) -> int:
        async with self._read() as session:
            latest = (await session.execute(select(func.max(PolicyVersion.version)))).scalar()
        return (latest or 0) + 1

    async def add_policy_version(
        self, *, version: int, name: str, adapter_path: str, metadata: dict[str, Any]
    ) -> PolicyVersionRecord:
        """Make ``version`` current. Versions only move forward: publishing an old number is a conflict."""
        async with self._write() as session:
            latest = (await session.execute(select(func.max(PolicyVersion.version)))).scalar() or 0
            if version <= latest:
                raise Conflict(
                    f"policy version {version} is not newer than the current version {latest}",
                    param="version",
                    code="version_conflict",
                )
            row = PolicyVersion(
                version=version, name=name, adapter_path=adapter_path, created_at=time.time(), meta=metadata
            )
            session.add(row)
        return _policy(row)

    async def list_policy_versions(self, limit: int = 100) -> list[PolicyVersionRecord]:
        async with self._read() as session:
            rows = (
                await session.scalars(select(PolicyVersion).order_by(PolicyVersion.version.desc()).limit(limit))
            ).all()
        return [_policy(r) for r in rows]

    # -- trainer: claim, ack, metrics ---------------------------------------------------------

    async def claim_groups(
        self,
        *,
        owner: str,
        max_groups: int,
        lease_s: float,
        max_staleness: int | None,
        current_version: int,
        lease_id: str | None = None,
        delta: bool = False,
    ) -> Claim:
        """Lease up to ``max_groups`` completed, untrained groups (oldest first).

        Groups whose oldest call is more than ``max_staleness`` versions behind ``current_version``
        are marked ``stale`` and never offered again. A lease that expires offers the group again.
        A claim retried with the same client-chosen ``lease_id`` (its answer was lost) returns the
        groups that lease already holds, with the lease renewed, instead of leasing more. With
        ``delta`` the calls come as stored (``call_records``): linear in an episode's tokens.
        """
        now = time.time()
        if lease_id is not None:
            async with self._write() as session:
                held = sorted(
                    (
                        await session.scalars(
                            self._locked_groups(Group.lease_id == lease_id, Group.train_status == "pending")
                        )
                    ).all(),
                    key=lambda g: (g.completed_at or 0.0, g.id),
                )
                for group in held:
                    group.lease_owner, group.lease_expires_at = owner, now + lease_s
            if held:
                return await self._claimed(lease_id, now + lease_s, [g.id for g in held], stale=0, delta=delta)
        lease_id = lease_id or str(uuid.uuid4())
        available = (
            select(Group)
            .where(
                Group.status == "complete",
                Group.train_status == "pending",
                (Group.lease_id.is_(None)) | (Group.lease_expires_at < now),
            )
            .order_by(Group.completed_at, Group.id)
        )
        if not self.sqlite:
            available = available.with_for_update(skip_locked=True)
        chosen: list[Group] = []
        stale = 0
        async with self._write() as session:
            while len(chosen) < max_groups:
                # Every row looked at is leased or marked stale below, and autoflush makes the next
                # query skip it: no offset needed (an offset would skip rows never looked at).
                batch = (await session.scalars(available.limit(max_groups * 2))).all()
                if not batch:
                    break
                versions = await self._min_versions(session, [g.id for g in batch])
                for group in batch:
                    oldest = versions.get(group.id)
                    if max_staleness is not None and oldest is not None and current_version - oldest > max_staleness:
                        group.train_status = "stale"
                        group.train_note = f"oldest call at policy v{oldest}, current v{current_version}"
                        stale += 1
                    elif len(chosen) < max_groups:
                        group.lease_id, group.lease_owner, group.lease_expires_at = lease_id, owner, now + lease_s
                        chosen.append(group)
            await session.flush()
        return await self._claimed(lease_id, now + lease_s, [g.id for g in chosen], stale=stale, delta=delta)

    async def _claimed(
        self, lease_id: str, expires_at: float, group_ids: list[str], *, stale: int, delta: bool
    ) -> Claim:
        """The claim answer: the leased groups with their episodes and calls."""
        async with self._read() as session:
            groups = {g.id: g for g in (await session.scalars(select(Group).where(Group.id.in_(group_ids)))).all()}
            episodes = (
                await session.scalars(
                    select(Episode).where(Episode.group_id.in_(group_ids)).order_by(Episode.group_index, Episode.id)
                )
            ).all()
            calls = await self._calls(session, [e.id for e in episodes], delta=delta)
        by_group: dict[str, list[EpisodeRecord]] = {gid: [] for gid in group_ids}
        for episode in episodes:
            by_group[episode.group_id or ""].append(episode_record(episode, calls[episode.id]))
        return Claim(
            lease_id=lease_id,
            lease_expires_at=expires_at,
            groups=[group_record(groups[gid], by_group[gid]) for gid in group_ids],
            stale=stale,
        )

    async def release_groups(self, *, lease_id: str, group_ids: Sequence[str] | None = None) -> int:
        """Hand leased, untrained groups back at once (a trainer stopping before it trained them)."""
        where = [Group.lease_id == lease_id, Group.train_status == "pending"]
        if group_ids:
            where.append(Group.id.in_(list(group_ids)))
        async with self._write() as session:
            released = (await session.scalars(self._locked_groups(*where))).all()
            for group in released:
                group.lease_id, group.lease_owner, group.lease_expires_at = None, None, None
        return len(released)

    async def _min_versions(self, session: AsyncSession, group_ids: list[str]) -> dict[str, int]:
        result = await session.execute(
            select(Episode.group_id, func.min(Call.policy_version))
            .join(Call, Call.episode_id == Episode.id)
            .where(Episode.group_id.in_(group_ids), Call.policy_version.is_not(None))
            .group_by(Episode.group_id)
        )
        return {gid: v for gid, v in result.all() if gid is not None and v is not None}

    async def _held(self, session: AsyncSession, lease_id: str, group_ids: Sequence[str]) -> dict[str, Group]:
        """The groups, locked in id order; ``NotFound`` if one does not exist."""
        rows = {g.id: g for g in (await session.scalars(self._locked_groups(Group.id.in_(sorted(set(group_ids))))))}
        missing = [gid for gid in group_ids if gid not in rows]
        if missing:
            raise NotFound(f"groups not found: {missing}", param="group_ids")
        return rows

    @staticmethod
    def _lease_lost(group: Group, lease_id: str) -> Conflict:
        return Conflict(
            f"group {group.id} is no longer held by lease {lease_id} (it expired and the group was "
            "claimed again, or it was released)",
            code="lease_lost",
        )

    async def renew_lease(self, *, lease_id: str, group_ids: Sequence[str], lease_s: float) -> float:
        """Extend a lease on the groups a trainer is training; returns the new expiry.

        All or nothing: if any of ``group_ids`` is no longer held by ``lease_id`` (it was re-leased
        or released after the lease expired) the answer is ``Conflict`` ``lease_lost`` and nothing
        changes, so the trainer must drop the step. A lease that expired but whose groups nobody
        claimed since is revived: no one else can have trained them. Groups this lease already
        acked are left as they are.
        """
        now = time.time()
        async with self._write() as session:
            rows = await self._held(session, lease_id, group_ids)
            for group in rows.values():
                if group.lease_id != lease_id or group.train_status not in ("pending", "trained", "skipped"):
                    raise self._lease_lost(group, lease_id)
            for group in rows.values():
                if group.train_status == "pending":
                    group.lease_expires_at = now + lease_s
        return now + lease_s

    async def ack_groups(
        self,
        *,
        lease_id: str,
        group_ids: Sequence[str],
        step: int,
        status: AckStatus,
        note: str | None = None,
        audits: Mapping[str, dict[str, Any]] | None = None,
    ) -> list[GroupRecord]:
        """Mark leased groups ``trained`` (or ``skipped``) by ``step``; all or nothing. ``audits``:
        episode id -> the trainer's fidelity audit, kept on episodes of these groups only.

        The rule: an ack needs a live lease. Acking the same groups again with the same lease and
        step is a no-op (a retry, or a restarted trainer finishing its checkpoint). Otherwise a
        group must be pending and held by ``lease_id`` (``Conflict`` ``already_acked`` /
        ``lease_lost``), and the lease must not have expired (``Conflict`` ``lease_expired``): a
        trainer whose lease lapsed cannot know whether another claimed the group meanwhile, so it
        must first renew it (``renew_lease``), which succeeds only if nobody did. That is the path
        of a trainer restarted after a crash between checkpoint and ack: its checkpoint holds the
        update, so renew-then-ack is right when the group is still its own, and ``lease_lost``
        (the group was claimed again and may be trained twice) is reported to it, never hidden.
        """
        now = time.time()
        async with self._write() as session:
            rows = await self._held(session, lease_id, group_ids)
            todo = []
            for group in rows.values():
                if (
                    group.train_status in ("trained", "skipped")
                    and group.trained_step == step
                    and group.lease_id == lease_id
                ):
                    continue
                if group.train_status != "pending":
                    raise Conflict(
                        f"group {group.id} is already {group.train_status}"
                        + (f" by step {group.trained_step}" if group.trained_step is not None else ""),
                        code="already_acked",
                    )
                if group.lease_id != lease_id:
                    raise self._lease_lost(group, lease_id)
                if group.lease_expires_at is None or group.lease_expires_at < now:
                    raise Conflict(
                        f"lease {lease_id} on group {group.id} expired "
                        f"{now - (group.lease_expires_at or now):.1f}s ago; renew it before acking "
                        "(the renewal fails if the group was claimed again)",
                        code="lease_expired",
                    )
                todo.append(group)
            if audits and todo:
                await self._keep_audits(session, [g.id for g in todo], audits)
            for group in todo:
                group.train_status, group.trained_step, group.train_note = status, step, note
                group.lease_expires_at = None
        return [group_record(g) for g in rows.values()]

    async def _keep_audits(
        self, session: AsyncSession, group_ids: Sequence[str], audits: Mapping[str, dict[str, Any]]
    ) -> None:
        """Store each audit on its episode; one naming an episode outside the acked groups refuses the ack."""
        episodes = (
            await session.scalars(select(Episode).where(Episode.id.in_(list(audits)), Episode.group_id.in_(group_ids)))
        ).all()
        unknown = sorted(set(audits) - {e.id for e in episodes})
        if unknown:
            raise InvalidRequest(
                f"audits name episodes that are not in the acked groups: {', '.join(unknown[:5])}", param="audits"
            )
        for episode in episodes:
            episode.train_audit = audits[episode.id]

    async def add_trainer_step(self, *, step: int, metrics: dict[str, Any]) -> TrainerStepRecord:
        """Store a step's metrics; a retried report of the same step replaces the first."""
        async with self._write() as session:
            row = await session.get(TrainerStep, step)
            if row is None:
                row = TrainerStep(step=step, metrics=metrics, created_at=time.time())
                session.add(row)
            else:
                row.metrics = metrics
        return TrainerStepRecord(step=row.step, metrics=row.metrics, created_at=row.created_at)

    async def list_trainer_steps(self, *, since_step: int = -1, limit: int = 1000) -> list[TrainerStepRecord]:
        async with self._read() as session:
            rows = (
                await session.scalars(
                    select(TrainerStep).where(TrainerStep.step > since_step).order_by(TrainerStep.step).limit(limit)
                )
            ).all()
        return [TrainerStepRecord(step=r.step, metrics=r.metrics, created_at=r.created_at) for r in rows]
