"""Read-only queries for the dashboard (``proxy/ui``): keyset pages of groups and episodes, counts.

Pages are keyset pages, newest first: a page is "the ``limit`` rows before this (created_at, id)",
never an OFFSET, so page 1,000 costs what page 1 costs. ``(created_at, id)`` is a total order
(a group's episodes share ``created_at``; the id breaks the tie), so consecutive pages are disjoint
and miss nothing that existed when the first was read; ``ix_*_created_id`` (migration 0003) serves
them, and ``ix_episodes_status_created_id`` (migration 0005) the episodes filtered by status (with the
status index alone SQLite sorted all of that status's rows: 167 ms a page at 100,000 episodes).
Measured with ``bench/ui_pages.py``: docs/results.md. Nothing here writes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession

from contract.vocabulary import EpisodeStatus, GroupStatus, TrainStatus
from proxy.store.models import Call, Episode, Group
from proxy.store.records import CallRecord, EpisodeRecord, GroupRecord
from proxy.store.rows import call_records, episode_record, group_records

COUNTS_TTL_S = 5.0
"""How long the overview's store counts are reused. Counting is a scan of every table (PostgreSQL,
100,000 episodes: ~140 ms), and every open dashboard polls the overview every 5 s."""

Cursor = tuple[float, str]
"""A row's (created_at, id): the page that follows starts after it."""


@dataclass(slots=True)
class EpisodeRow:
    """One line of the episodes table: the episode, its group's train status and its calls' summary."""

    episode: EpisodeRecord
    train_status: TrainStatus | None
    calls: int
    versions: tuple[int, int] | None
    """Lowest and highest policy version among its calls (None: no versioned call)."""


@dataclass(slots=True)
class Counts:
    episodes: dict[str, int]
    groups: dict[str, int]
    """Groups by train status."""
    calls: int


def _before(created_at: Any, row_id: Any, cursor: Cursor | None) -> Any:
    """Rows strictly after ``cursor`` in (created_at desc, id desc) order: a row-value comparison,
    which SQLite (3.15+) and PostgreSQL both answer as one range of the (created_at, id) index."""
    if cursor is None:
        return True
    return tuple_(created_at, row_id) < tuple_(*cursor)


class Browse:
    """The dashboard's reads, on the store's read engine (one short session per method;
    ``sessions`` is ``Sessions.read``, which turns a store failure into ``StoreUnavailable``)."""

    def __init__(
        self, sessions: Callable[[], AbstractAsyncContextManager[AsyncSession]], counts_ttl_s: float = COUNTS_TTL_S
    ) -> None:
        self._sessions = sessions
        self._counts_ttl_s = counts_ttl_s
        self._counted: tuple[float, Counts] | None = None
        self._counting = asyncio.Lock()  # concurrent polls wait for one count instead of each running it

    async def episodes(
        self,
        *,
        status: EpisodeStatus | None = None,
        task: str | None = None,
        group_id: str | None = None,
        after: Cursor | None = None,
        limit: int = 50,
    ) -> list[EpisodeRow]:
        """A page of episodes, newest first; ``task`` matches a substring of the task id."""

        query = (
            select(Episode, Group.train_status)
            .outerjoin(Group, Group.id == Episode.group_id)
            .where(_before(Episode.created_at, Episode.id, after))
            .order_by(Episode.created_at.desc(), Episode.id.desc())
            .limit(limit)
        )
        if status:
            query = query.where(Episode.status == status)
        if task:
            query = query.where(Episode.task_id.contains(task, autoescape=True))
        if group_id:
            query = query.where(Episode.group_id == group_id)
        async with self._sessions() as session:
            rows = (await session.execute(query)).all()
            summary = await self._call_summary(session, [row[0].id for row in rows])
        return [
            EpisodeRow(episode=episode_record(episode), train_status=train, **summary.get(episode.id, _NO_CALLS))
            for episode, train in rows
        ]

    @staticmethod
    async def _call_summary(session: AsyncSession, episode_ids: list[str]) -> dict[str, dict[str, Any]]:
        if not episode_ids:
            return {}
        result = await session.execute(
            select(Call.episode_id, func.count(), func.min(Call.policy_version), func.max(Call.policy_version))
            .where(Call.episode_id.in_(episode_ids))
            .group_by(Call.episode_id)
        )
        return {
            eid: {"calls": n, "versions": (low, high) if low is not None and high is not None else None}
            for eid, n, low, high in result.all()
        }

    async def groups(
        self,
        *,
        status: GroupStatus | None = None,
        train_status: TrainStatus | None = None,
        task: str | None = None,
        after: Cursor | None = None,
        limit: int = 50,
    ) -> list[GroupRecord]:
        """A page of groups, newest first, each with its episodes (for counts and rewards)."""

        query = (
            select(Group)
            .where(_before(Group.created_at, Group.id, after))
            .order_by(Group.created_at.desc(), Group.id.desc())
            .limit(limit)
        )
        if status:
            query = query.where(Group.status == status)
        if train_status:
            query = query.where(Group.train_status == train_status)
        if task:
            query = query.where(Group.task_id.contains(task, autoescape=True))
        async with self._sessions() as session:
            return await group_records(session, (await session.scalars(query)).all())

    async def export_page(
        self,
        *,
        status: EpisodeStatus | None = None,
        task: str | None = None,
        since: float | None = None,
        after: Cursor | None = None,
        limit: int = 100,
    ) -> tuple[list[EpisodeRecord], dict[str, dict[str, float]]]:
        """A page of episodes for the export, OLDEST first (a dataset reads in recording order),
        with their calls, and the rewards of the rewarded episodes of their groups (advantages).

        The same keyset walk as the pages, the other way: rows after ``after`` in ascending
        (created_at, id), one range of ``ix_episodes_created_id``. The page's calls are one query,
        made whole by ``rows.call_records`` as the repository does (the store keeps deltas).
        """
        query = select(Episode).order_by(Episode.created_at, Episode.id).limit(limit)
        if after is not None:
            query = query.where(tuple_(Episode.created_at, Episode.id) > tuple_(*after))
        if since is not None:
            query = query.where(Episode.created_at >= since)
        if status:
            query = query.where(Episode.status == status)
        if task:
            query = query.where(Episode.task_id.contains(task, autoescape=True))
        async with self._sessions() as session:
            rows = (await session.scalars(query)).all()
            calls: dict[str, list[CallRecord]] = {row.id: [] for row in rows}
            if calls:
                of_page = Call.episode_id.in_(list(calls))
                stored = await session.execute(
                    select(Call.__table__).where(of_page).order_by(Call.episode_id, Call.ordinal)
                )
                for record in call_records(stored.all()):
                    calls[record.episode_id].append(record)
            group_ids = sorted({row.group_id for row in rows if row.group_id is not None})
            rewards: dict[str, dict[str, float]] = {gid: {} for gid in group_ids}
            if group_ids:
                result = await session.execute(
                    select(Episode.group_id, Episode.id, Episode.reward).where(
                        Episode.group_id.in_(group_ids), Episode.status == "rewarded", Episode.reward.is_not(None)
                    )
                )
                for gid, eid, reward in result.all():
                    if gid is not None and reward is not None:
                        rewards[gid][eid] = reward
        return [episode_record(row, calls[row.id]) for row in rows], rewards

    async def counts(self) -> Counts:
        """Episodes by status, groups by train status, and all calls; at most ``counts_ttl_s`` old."""
        async with self._counting:
            if self._counted is not None and time.monotonic() - self._counted[0] < self._counts_ttl_s:
                return self._counted[1]
            counts = await self._count()
            self._counted = (time.monotonic(), counts)
            return counts

    async def _count(self) -> Counts:
        async with self._sessions() as session:
            episodes = (await session.execute(select(Episode.status, func.count()).group_by(Episode.status))).all()
            groups = (
                await session.execute(select(Group.train_status, func.count()).group_by(Group.train_status))
            ).all()
            calls = (await session.execute(select(func.count()).select_from(Call))).scalar_one()
        return Counts(episodes={s: n for s, n in episodes}, groups={s: n for s, n in groups}, calls=calls)


_NO_CALLS: dict[str, Any] = {"calls": 0, "versions": None}
