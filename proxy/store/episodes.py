"""Episodes and their groups: created, read, rewarded, abandoned (by the agent or the idle sweep),
or left awaiting a late reward.

Each public method is one transaction (``sessions.py``). A reward or an abandon locks the episode's
group row, then the episode row (``_episode_for_update``), so two rewards of one group serialise and
the last one completes the group; the idle sweep takes the same locks, group rows first, each sorted
by id. A finished episode's cached last call is dropped from ``Tails``: no call extends it any more.

An ``awaiting`` episode (its agent done, its reward late) is unfinished like an open one (its group
stays open until it is rewarded or abandoned) but takes no call, is never abandoned for idling
(only past ``max_wait_s``), and is no traffic: a group whose unfinished episodes all await leaves
the admission backlog. Time is ``Episodes.clock`` (epoch s), so tests can move it days ahead.

While a canary runs (``canaries.py``), a new episode (``create_episode``, ``create_group``; not a
fork's) gets its arm in the transaction that creates it, and a reward of one of its episodes
decides the canary in the reward's own transaction, after the group and episode locks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase
from typing import Any, Final

from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from contract.vocabulary import RECEIPT_PREFIX, AbandonCause, EpisodeStatus, GroupStatus, SkipCount, TrainStatus
from proxy.errors import Conflict, InvalidRequest, NotFound
from proxy.store import canaries
from proxy.store.delta import Tails
from proxy.store.faults import translated
from proxy.store.models import Call, Episode, Group
from proxy.store.records import EpisodeRecord, GroupRecord
from proxy.store.rows import episode_record, group_record, group_records
from proxy.store.sessions import Sessions, calls_of, lock_group

OPEN: Final = "open"
AWAITING: Final = "awaiting"
REWARDED: Final = "rewarded"
ABANDONED: Final = "abandoned"
UNFINISHED: Final[tuple[EpisodeStatus, ...]] = (OPEN, AWAITING)
"""Statuses that still take a reward or an abandon: the group is open while one of its episodes has one."""
NOT_TRAINED: Final[tuple[TrainStatus, ...]] = ("skipped", "stale")
"""The train statuses a group ends in untrained, each with its ``train_reason``."""


def new_group(
    task_id: str,
    size: int,
    metadata: dict[str, Any],
    episode_metadata: Sequence[dict[str, Any]] | None = None,
    **episode_fields: Any,
) -> tuple[Group, list[Episode]]:
    """A new open group's row and its ``size`` episode rows (``episode_fields``: set on each)."""
    now = time.time()
    group = Group(
        id=str(uuid.uuid4()), task_id=task_id, size=size, meta=metadata, status=OPEN, created_at=now,
        train_status="pending",
    )  # fmt: skip
    episodes = [
        Episode(
            id=str(uuid.uuid4()),
            group_id=group.id,
            group_index=i,
            task_id=task_id,
            meta=(episode_metadata[i] if episode_metadata else {}),
            status=OPEN,
            created_at=now,
            **episode_fields,
        )
        for i in range(size)
    ]
    return group, episodes


async def add_group(session: AsyncSession, group: Group, episodes: list[Episode]) -> None:
    session.add(group)
    await session.flush()  # the group row first: episodes reference it
    session.add_all(episodes)


class Episodes:
    """The episodes-and-groups aggregate; ``min_rewarded`` decides whether a finished group is
    ``complete`` or ``failed``."""

    def __init__(
        self, sessions: Sessions, tails: Tails, *, min_rewarded: int = 2, clock: Callable[[], float] = time.time
    ) -> None:
        self._sessions = sessions
        self._tails = tails
        self.min_rewarded = min_rewarded
        self.clock = clock
        """Epoch seconds of rewards, abandons, waits and the idle sweep (tests move it ahead)."""

    async def create_group(
        self,
        *,
        task_id: str,
        size: int,
        metadata: dict[str, Any],
        episode_metadata: Sequence[dict[str, Any]] | None = None,
    ) -> GroupRecord:
        group, episodes = new_group(task_id, size, metadata, episode_metadata)
        async with self._sessions.write() as session:
            await canaries.assign(session, episodes)
            await add_group(session, group, episodes)
        return group_record(group, [episode_record(e) for e in episodes])

    async def count_backlog(self) -> int:
        """Groups the trainer has still to take: open with an episode in flight, or complete, and not
        yet trained, skipped or stale (leased ones included: they are being trained on the current
        version). An open group whose unfinished episodes all await a late reward is not in flight:
        it would hold admission back for hours (its staleness is the trainer's ``late`` rule)."""
        in_flight = select(Episode.id).where(Episode.group_id == Group.id, Episode.status == OPEN).exists()
        async with self._sessions.read() as session:
            count = await session.scalar(
                select(func.count())
                .select_from(Group)
                .where(
                    Group.train_status == "pending", (Group.status == "complete") | ((Group.status == OPEN) & in_flight)
                )
            )
        return int(count or 0)

    async def count_groups(self) -> dict[str, int]:
        """Groups by training outcome: ``train_status`` for complete groups, ``open`` and ``failed`` apart."""
        async with self._sessions.read() as session:
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

    async def skip_counts(self) -> dict[SkipCount, int]:
        """Groups never trained (``skipped`` or ``stale``) by ``train_reason``, one query; ``other``:
        those without one (a trainer that sent none, a note migration 0011 could not read)."""
        async with self._sessions.read() as session:
            rows = (
                await session.execute(
                    select(Group.train_reason, func.count())
                    .where(Group.train_status.in_(NOT_TRAINED))
                    .group_by(Group.train_reason)
                )
            ).all()
        return {reason or "other": int(n) for reason, n in rows}

    async def create_episode(self, *, task_id: str | None, metadata: dict[str, Any]) -> EpisodeRecord:
        episode = Episode(
            id=str(uuid.uuid4()), group_id=None, task_id=task_id, meta=metadata, status=OPEN, created_at=time.time()
        )
        async with self._sessions.write() as session:
            await canaries.assign(session, [episode])
            session.add(episode)
        return episode_record(episode)

    async def episode_state(self, episode_id: str) -> tuple[str, str | None, str | None] | None:
        """(status, group_id, fork_of) of an episode, or None: the model routes' existence check, and
        the relay's whether it is a fork (one primary-key read, on SQLite the fast path's)."""
        fast = self._sessions.fast
        if fast is not None:
            async with translated():
                return await fast.episode_state(episode_id)
        async with self._sessions.read() as session:
            query = select(Episode.status, Episode.group_id, Episode.fork_of).where(Episode.id == episode_id)
            row = (await session.execute(query)).first()
        return (row[0], row[1], row[2]) if row else None

    async def get_episode(self, episode_id: str, *, with_calls: bool = True) -> EpisodeRecord:
        async with self._sessions.read() as session:
            row = await session.get(Episode, episode_id)
            if row is None:
                raise NotFound(f"episode {episode_id} not found", param="episode_id")
            calls = await calls_of(session, [episode_id]) if with_calls else None
        return episode_record(row, calls.get(episode_id, []) if calls is not None else None)

    async def list_episodes(
        self,
        *,
        status: EpisodeStatus | None = None,
        group_id: str | None = None,
        task_ids: Sequence[str] | None = None,
        min_reward: float | None = None,
        source: str | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[EpisodeRecord]:
        """Newest first, without their calls. ``task_ids``: any of these tasks (exact ids);
        ``min_reward``: rewarded at least this; ``source``: ``metadata["source"]`` is exactly this
        string (the source tag, e.g. ``teacher:<name>``; read with the JSON accessors both stores
        have: ``json_extract`` on SQLite, ``->>`` on PostgreSQL)."""
        query = select(Episode).order_by(Episode.created_at.desc(), Episode.id).limit(limit).offset(offset)
        if status:
            query = query.where(Episode.status == status)
        if group_id:
            query = query.where(Episode.group_id == group_id)
        if task_ids:
            query = query.where(Episode.task_id.in_(list(task_ids)))
        if min_reward is not None:
            query = query.where(Episode.reward >= min_reward)
        if source is not None:
            query = query.where(Episode.meta["source"].as_string() == source)
        async with self._sessions.read() as session:
            return [episode_record(row) for row in (await session.scalars(query)).all()]

    async def get_group(self, group_id: str) -> GroupRecord:
        async with self._sessions.read() as session:
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
        train_reason: SkipCount | None = None,
        leased: bool | None = None,
        limit: int = 100,
        offset: int = 0,
    ) -> list[GroupRecord]:
        """Newest first; ``leased`` keeps the groups under a live trainer lease (True) or the others (False);
        ``train_reason`` those never trained for it (``other``: skipped or stale without a reason)."""
        query = select(Group).order_by(Group.created_at.desc(), Group.id).limit(limit).offset(offset)
        if status:
            query = query.where(Group.status == status)
        if task_id:
            query = query.where(Group.task_id == task_id)
        if train_status:
            query = query.where(Group.train_status == train_status)
        if train_reason == "other":
            query = query.where(Group.train_status.in_(NOT_TRAINED), Group.train_reason.is_(None))
        elif train_reason:
            query = query.where(Group.train_reason == train_reason)
        if leased is not None:
            live = Group.lease_id.is_not(None) & (Group.lease_expires_at >= time.time())
            query = query.where(live if leased else ~live)
        async with self._sessions.read() as session:
            return await group_records(session, (await session.scalars(query)).all())

    # -- finishing: rewards, abandons, the idle sweep, group completion --------------------------

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
        if any(counts.get(s, 0) > 0 for s in UNFINISHED):
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
        await lock_group(session, group_id)
        row = (await session.scalars(select(Episode).where(Episode.id == episode_id).with_for_update())).first()
        if row is None:
            raise NotFound(f"episode {episode_id} not found", param="episode_id")
        return row

    async def set_reward(
        self, episode_id: str, *, reward: float, call_rewards: dict[str, float] | None, metadata: dict[str, Any] | None
    ) -> tuple[EpisodeRecord, bool]:
        """Reward and finish an episode (open, or awaiting a late reward). Returns (episode, changed);
        the same payload twice is a no-op, a different one is a ``Conflict``."""
        async with self._sessions.write() as session:
            row = await self._episode_for_update(session, episode_id)
            if call_rewards:  # receipts named as ordinals first: the stored form, compared below
                call_rewards = await _by_ordinal(session, episode_id, call_rewards)
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
                await _check_ordinals(session, episode_id, call_rewards)
            canary = await canaries.for_reward(session, row, reward)  # locked; refuses an out-of-range reward
            now = self.clock()
            row.status, row.reward, row.finished_at = REWARDED, reward, now
            self._tails.drop(episode_id)
            row.call_rewards, row.reward_metadata = call_rewards or None, metadata or None
            await session.flush()
            await self._complete_group(session, row.group_id, now)
            record = episode_record(row)
            if canary is not None:  # the decision commits with the reward that reached it, or not at all
                record.canary_decided = await canaries.judge(session, canary)
            return record, True

    async def await_reward(self, episode_id: str) -> tuple[EpisodeRecord, bool]:
        """Its agent is done and its reward will come late: the episode takes no more calls and waits
        (no idle abandon) until rewarded, abandoned, or past ``max_wait_s``. Returns (episode, changed):
        an awaiting episode again is a no-op; a finished one is a ``Conflict``."""
        async with self._sessions.write() as session:
            row = await self._episode_for_update(session, episode_id)
            if row.status == REWARDED:
                raise Conflict(f"episode {episode_id} is already rewarded", code="episode_rewarded")
            if row.status == ABANDONED:
                raise Conflict(
                    f"episode {episode_id} was abandoned ({row.abandon_reason}); it awaits no reward",
                    code="episode_abandoned",
                )
            if row.status == AWAITING:
                return episode_record(row), False
            row.status, row.awaiting_since = AWAITING, self.clock()
            self._tails.drop(episode_id)
            return episode_record(row), True

    async def abandon(self, episode_id: str, *, reason: str, cause: AbandonCause = "agent") -> EpisodeRecord:
        async with self._sessions.write() as session:
            row = await self._episode_for_update(session, episode_id)
            if row.status == REWARDED:
                raise Conflict(f"episode {episode_id} is already rewarded", code="episode_rewarded")
            if row.status in UNFINISHED:
                now = self.clock()
                row.status, row.abandon_reason, row.abandon_cause, row.finished_at = ABANDONED, reason, cause, now
                self._tails.drop(episode_id)
                await session.flush()
                await self._complete_group(session, row.group_id, now)
            return episode_record(row)

    async def abandon_expired(
        self, *, idle_s: float, late_tasks: Sequence[str] = (), max_wait_s: float | None = None
    ) -> int:
        """The reaper: abandon open episodes idle (no call, no reward) for ``idle_s``, except those of
        a task matching a ``late_tasks`` pattern (``fnmatch``), which start awaiting their reward;
        abandon episodes awaiting one for longer than ``max_wait_s`` (None: no limit). Returns how
        many it abandoned."""
        now = self.clock()
        last_call = (
            select(func.max(Call.started_at)).where(Call.episode_id == Episode.id).correlate(Episode).scalar_subquery()
        )
        idle = (Episode.status == OPEN) & (func.coalesce(last_call, Episode.created_at) < now - idle_s)
        due = idle
        if max_wait_s is not None:
            due = due | ((Episode.status == AWAITING) & (Episode.awaiting_since < now - max_wait_s))
        scan = select(Episode.id, Episode.group_id).where(due)
        async with self._sessions.write() as session:
            found = (await session.execute(scan)).all()
            if not found:
                return 0
            groups = sorted({g for _, g in found if g})
            if groups:  # the lock order: group rows, then episode rows, each sorted by id
                await session.execute(select(Group.id).where(Group.id.in_(groups)).order_by(Group.id).with_for_update())
            # Locked, the episodes are checked again: a call or a reward may have come in since the scan.
            rows = (
                await session.execute(
                    select(Episode.id, Episode.status, Episode.task_id)
                    .where(due, Episode.id.in_(sorted(e for e, _ in found)))
                    .order_by(Episode.id)
                    .with_for_update()
                )
            ).all()
            waits = [i for i, status, task in rows if status == OPEN and _late(task, late_tasks)]
            idled = [i for i, status, task in rows if status == OPEN and not _late(task, late_tasks)]
            expired = [i for i, status, _ in rows if status == AWAITING]
            if waits:
                await session.execute(
                    update(Episode).where(Episode.id.in_(waits)).values(status=AWAITING, awaiting_since=now)
                )
            for ids, reason in (
                (idled, f"no reward within {idle_s:.0f}s"),
                (expired, f"no late reward within {max_wait_s or 0:.0f}s of awaiting it"),
            ):
                if ids:
                    await session.execute(
                        update(Episode)
                        .where(Episode.id.in_(ids))
                        .values(status=ABANDONED, abandon_reason=reason, abandon_cause="deadline", finished_at=now)
                    )
            for episode_id, _, _ in rows:
                self._tails.drop(episode_id)
            if idled or expired:
                for group_id in groups:
                    await self._complete_group(session, group_id, now)
        return len(idled) + len(expired)


def _late(task_id: str | None, patterns: Sequence[str]) -> bool:
    """Whether an idle episode of this task awaits a late reward (``late_rewards.tasks``) instead of being abandoned."""
    return any(fnmatchcase(task_id or "", pattern) for pattern in patterns)


async def _by_ordinal(session: AsyncSession, episode_id: str, call_rewards: dict[str, float]) -> dict[str, float]:
    """``call_rewards`` with each key that names a call by its receipt (``call_<hex>``, from the
    answer's ``x-flywheel-call-id``; ``:<choice>`` may follow) put as its ordinal; the stored and
    trained form is the ordinal's. A receipt of no call of this episode is a 400 naming it."""
    receipts = {k.partition(":")[0] for k in call_rewards if k.startswith(RECEIPT_PREFIX)}
    if not receipts:
        return call_rewards
    rows = await session.execute(
        select(Call.receipt, Call.ordinal).where(Call.episode_id == episode_id, Call.receipt.in_(receipts))
    )
    ordinals = {receipt: ordinal for receipt, ordinal in rows.all()}
    unknown = sorted(receipts - ordinals.keys())
    if unknown:
        raise InvalidRequest(
            f"call_rewards names receipts {unknown} of no call of episode {episode_id}", param="call_rewards"
        )
    out: dict[str, float] = {}
    for key, value in call_rewards.items():
        head, sep, choice = key.partition(":")
        named = f"{ordinals[head]}{sep}{choice}" if head in ordinals else key
        if named in out and out[named] != value:
            raise InvalidRequest(f"call_rewards names call {named} twice, with different rewards", param="call_rewards")
        out[named] = value
    return out


async def _check_ordinals(session: AsyncSession, episode_id: str, call_rewards: dict[str, float]) -> None:
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
