"""Read-only queries for the dashboard (``proxy/ui``): keyset pages of groups and episodes, counts.

Pages are keyset pages, newest first: a page is "the ``limit`` rows before this (created_at, id)",
never an OFFSET, so page 1,000 costs what page 1 costs. ``(created_at, id)`` is a total order
(a group's episodes share ``created_at``; the id breaks the tie), so consecutive pages are disjoint
and miss nothing that existed when the first was read; ``ix_*_created_id`` (migration 0003) serves
them. A filter on status is answered through its own index and sorted (not yet measured at 100,000
episodes). Nothing here writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, tuple_
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from proxy.store.models import Call, Episode, Group
from proxy.store.records import EpisodeRecord, GroupRecord
from proxy.store.rows import episode_record, group_records
from proxy.vocabulary import EpisodeStatus, GroupStatus, TrainStatus

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
    """The dashboard's reads, on the repository's read engine (one short session per method)."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

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

    async def counts(self) -> Counts:
        """Episodes by status, groups by train status, and all calls."""
        async with self._sessions() as session:
            episodes = (await session.execute(select(Episode.status, func.count()).group_by(Episode.status))).all()
            groups = (
                await session.execute(select(Group.train_status, func.count()).group_by(Group.train_status))
            ).all()
            calls = (await session.execute(select(func.count()).select_from(Call))).scalar_one()
        return Counts(episodes={s: n for s, n in episodes}, groups={s: n for s, n in groups}, calls=calls)


_NO_CALLS: dict[str, Any] = {"calls": 0, "versions": None}
