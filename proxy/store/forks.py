"""Fork groups: episodes that replay a finished episode's first k answered calls, then sample.

``create`` writes a fork group in one transaction: the source must be rewarded (a running or
abandoned episode has no outcome to compare continuations against: ``Conflict``) and must have at
least ``at`` answered calls. The group takes the source's task and its group's metadata (how the
workflow wants abandons treated, its strata), plus ``fork``: where it came from. ``replayable``
reads the source's answered calls whole, in order, for ``proxy/replay.py``; ``answered`` counts a
fork's own (its replay position, so a restarted proxy resumes where the store says);
``diverge`` marks the call whose request differed, once.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select, update

from contract.vocabulary import ForkRule
from proxy.errors import Conflict, InvalidRequest, NotFound
from proxy.store.calls import episode_calls
from proxy.store.episodes import add_group, new_group
from proxy.store.models import Call, Episode, Group
from proxy.store.records import CallRecord, EpisodeRecord, GroupRecord
from proxy.store.rows import episode_record, group_record
from proxy.store.sessions import Sessions

REWARDED = "rewarded"


class Forks:
    """The fork aggregate: fork groups, their sources' answered calls, divergence marks."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    async def create(
        self, source_id: str, *, at: int, size: int, rule: ForkRule, metadata: dict[str, Any]
    ) -> GroupRecord:
        """A group of ``size`` fork episodes of ``source_id`` at its answered call ``at``."""
        async with self._sessions.write() as session:
            # Locked: retention neither purges nor deletes a source while a fork of it is being made.
            source = await session.get(Episode, source_id, with_for_update=True)
            if source is None:
                raise NotFound(f"episode {source_id} not found", param="episode_id")
            if source.purged_at is not None:
                raise Conflict(
                    f"episode {source_id} was purged by retention: its calls have no bodies to replay",
                    code="episode_purged",
                )
            if source.status != REWARDED:
                raise Conflict(
                    f"episode {source_id} is {source.status}: only a rewarded episode can be forked "
                    "(its siblings' outcomes are compared with it)",
                    code=f"episode_{source.status}",
                )
            answered = await _answered(session, source_id)
            if at > answered:
                raise InvalidRequest(
                    f"'at' is {at} but episode {source_id} has {answered} answered calls to replay (0..{answered})",
                    param="at",
                )
            source_group = await session.get(Group, source.group_id) if source.group_id else None
            fork = {"source_episode_id": source_id, "source_group_id": source.group_id, "at": at, "rule": rule}
            group, episodes = new_group(
                source.task_id or (source_group.task_id if source_group else source_id),
                size,
                {**(source_group.meta if source_group else {}), **metadata, "fork": fork},
                [dict(source.meta or {}) for _ in range(size)],
                fork_of=source_id,
                fork_at=at,
                fork_rule=rule,
            )
            await add_group(session, group, episodes)
        return group_record(group, [episode_record(e) for e in episodes])

    async def children(self, source_id: str) -> list[EpisodeRecord]:
        """The episodes forked from ``source_id`` (no calls), by group then place: the dashboard's fork tree."""
        async with self._sessions.read() as session:
            rows = await session.scalars(
                select(Episode)
                .where(Episode.fork_of == source_id)
                .order_by(Episode.created_at, Episode.group_id, Episode.group_index)
            )
            return [episode_record(row) for row in rows.all()]

    async def by_workflow(self) -> dict[str, dict[str, int]]:
        """Fork episodes per workflow (their group's ``workflow``), and how many diverged before
        their fork point: the dashboard's determinism figures."""
        async with self._sessions.read() as session:
            rows = (
                await session.execute(
                    select(Group.meta, Episode.diverged_at)
                    .join(Group, Episode.group_id == Group.id)
                    .where(Episode.fork_of.is_not(None))
                )
            ).all()
        counts: dict[str, dict[str, int]] = {}
        for meta, diverged_at in rows:
            row = counts.setdefault(str((meta or {}).get("workflow") or "?"), {"episodes": 0, "diverged": 0})
            row["episodes"] += 1
            row["diverged"] += diverged_at is not None
        return counts

    async def fork_of(self, episode_id: str) -> EpisodeRecord | None:
        """The episode without its calls when it is a fork (None otherwise, or when it does not exist)."""
        async with self._sessions.read() as session:
            row = await session.get(Episode, episode_id)
            return episode_record(row) if row is not None and row.fork_of is not None else None

    async def replayable(self, source_id: str) -> list[CallRecord]:
        """The source's answered calls, whole, in ordinal order: what a fork replays."""
        async with self._sessions.read() as session:
            calls = await episode_calls(session, source_id)
        return [c for c in calls if c.status_code == 200]

    async def answered(self, episode_id: str) -> int:
        """A fork's answered calls so far: while it replays, the source call its next call replays."""
        async with self._sessions.read() as session:
            return await _answered(session, episode_id)

    async def diverge(self, episode_id: str, *, at: int, divergence: dict[str, Any]) -> bool:
        """Mark the fork diverged at its answered call ``at``; False when it already was."""
        async with self._sessions.write() as session:
            result = await session.execute(
                update(Episode)
                .where(Episode.id == episode_id, Episode.diverged_at.is_(None))
                .values(diverged_at=at, divergence=divergence)
            )
            return bool(getattr(result, "rowcount", 0))


async def _answered(session: Any, episode_id: str) -> int:
    count = await session.scalar(
        select(func.count()).select_from(Call).where(Call.episode_id == episode_id, Call.status_code == 200)
    )
    return int(count or 0)
