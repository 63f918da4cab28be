"""The trainer's leases on completed groups: claim, renew, ack, release.

Each public method is one transaction (``sessions.py``). These lock group rows only, in id order
(``locked_groups``), the first step of the one lock order every writer keeps. A new claim skips
the group rows another claim has locked (``SKIP LOCKED`` on PostgreSQL); a claim retried with its
``lease_id`` returns what that lease holds.
An ack needs a live lease (``ack``): a lapsed one is renewed first, which only works if nobody
claimed the group since. A teacher's group (``metadata.source: teacher:<name>``, ``proxy/teachers.py``)
is never handed out: its calls are demonstrations, not samples of the policy. A late group (an
episode of it awaited its reward: ``Episodes.await_reward``) is never marked stale: the claim's
``max_staleness`` is about groups that waited on the trainer, not on their reward, and the trainer
judges a late group's age itself (its ``late`` rule: trained under the bounded importance weight,
or skipped ``late`` and counted).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from contract.vocabulary import TEACHER_PREFIX, AckStatus, TrainerSkip
from proxy.errors import Conflict, InvalidRequest, NotFound
from proxy.store.models import Call, Episode, Group
from proxy.store.records import Claim, EpisodeRecord, GroupRecord
from proxy.store.rows import episode_record, group_record
from proxy.store.sessions import Sessions, calls_of, locked_groups


def _teacher_source(group: Group) -> str | None:
    """The group's ``metadata.source`` when it names a teacher (every episode of it is one's: ``Teachers.check``)."""
    source = (group.meta or {}).get("source")
    return source if isinstance(source, str) and source.startswith(TEACHER_PREFIX) else None


def _lease_lost(group: Group, lease_id: str) -> Conflict:
    return Conflict(
        f"group {group.id} is no longer held by lease {lease_id} (it expired and the group was "
        "claimed again, or it was released)",
        code="lease_lost",
    )


async def _min_versions(session: AsyncSession, group_ids: list[str]) -> dict[str, int]:
    """Each group's oldest serving version over the calls it trains: a fork's replayed calls
    (``notes.replay``) carry their source's older version but are context only, never its age."""
    result = await session.execute(
        select(Episode.group_id, func.min(Call.policy_version))
        .join(Call, Call.episode_id == Episode.id)
        .where(
            Episode.group_id.in_(group_ids),
            Call.policy_version.is_not(None),
            Call.notes["replay"].as_string().is_(None),
        )
        .group_by(Episode.group_id)
    )
    return {gid: v for gid, v in result.all() if gid is not None and v is not None}


async def _late(session: AsyncSession, group_ids: list[str]) -> set[str]:
    """The groups with an episode that awaited its reward (``awaiting_since`` kept once rewarded)."""
    result = await session.scalars(
        select(Episode.group_id).where(Episode.group_id.in_(group_ids), Episode.awaiting_since.is_not(None)).distinct()
    )
    return {gid for gid in result.all() if gid is not None}


async def _held(session: AsyncSession, lease_id: str, group_ids: Sequence[str]) -> dict[str, Group]:
    """The groups, locked in id order; ``NotFound`` if one does not exist."""
    rows = {g.id: g for g in (await session.scalars(locked_groups(Group.id.in_(sorted(set(group_ids))))))}
    missing = [gid for gid in group_ids if gid not in rows]
    if missing:
        raise NotFound(f"groups not found: {missing}", param="group_ids")
    return rows


async def _keep_audits(session: AsyncSession, group_ids: Sequence[str], audits: Mapping[str, dict[str, Any]]) -> None:
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


class Leases:
    """The trainer's side of the groups: leased, renewed, acked (trained or skipped), released."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    async def claim(
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
        are marked ``stale`` and never offered again (a late group never is: the trainer judges its
        age); a teacher's group is marked ``skipped`` (its calls are no samples of the policy: GRPO
        never trains them) and never offered either, so it leaves the backlog that admission counts.
        A lease that expires offers the group again.
        A claim retried with the same client-chosen ``lease_id`` (its answer was lost) returns the
        groups that lease already holds, with the lease renewed, instead of leasing more. With
        ``delta`` the calls come as stored (``call_records``): linear in an episode's tokens.
        """
        now = time.time()
        if lease_id is not None:
            held = await self._renew_held(lease_id, owner, now + lease_s)
            if held:
                return await self._claimed(lease_id, now + lease_s, held, stale=0, delta=delta)
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
        if not self._sessions.sqlite:
            available = available.with_for_update(skip_locked=True)
        chosen: list[Group] = []
        stale = 0
        async with self._sessions.write() as session:
            while len(chosen) < max_groups:
                # Every row looked at is leased or marked stale (or skipped) below, and autoflush makes the next
                # query skip it: no offset needed (an offset would skip rows never looked at).
                batch = (await session.scalars(available.limit(max_groups * 2))).all()
                if not batch:
                    break
                versions = await _min_versions(session, [g.id for g in batch])
                late = await _late(session, [g.id for g in batch])
                for group in batch:
                    oldest = versions.get(group.id)
                    teacher = _teacher_source(group)
                    if teacher is not None:
                        group.train_status, group.train_reason = "skipped", "teacher"
                        group.train_note = f"{teacher}: demonstrations, never trained on-policy (GRPO)"
                    elif (
                        max_staleness is not None
                        and oldest is not None
                        and current_version - oldest > max_staleness
                        and group.id not in late
                    ):
                        group.train_status, group.train_reason = "stale", "stale"
                        group.train_note = f"oldest call at policy v{oldest}, current v{current_version}"
                        stale += 1
                    elif len(chosen) < max_groups:
                        group.lease_id, group.lease_owner, group.lease_expires_at = lease_id, owner, now + lease_s
                        chosen.append(group)
            await session.flush()
        return await self._claimed(lease_id, now + lease_s, [g.id for g in chosen], stale=stale, delta=delta)

    async def _renew_held(self, lease_id: str, owner: str, expires_at: float) -> list[str]:
        """A retried claim: the groups ``lease_id`` already holds (oldest first), renewed to ``expires_at``."""
        async with self._sessions.write() as session:
            held = sorted(
                (
                    await session.scalars(locked_groups(Group.lease_id == lease_id, Group.train_status == "pending"))
                ).all(),
                key=lambda g: (g.completed_at or 0.0, g.id),
            )
            for group in held:
                group.lease_owner, group.lease_expires_at = owner, expires_at
        return [g.id for g in held]

    async def _claimed(
        self, lease_id: str, expires_at: float, group_ids: list[str], *, stale: int, delta: bool
    ) -> Claim:
        """The claim answer: the leased groups with their episodes and calls."""
        async with self._sessions.read() as session:
            groups = {g.id: g for g in (await session.scalars(select(Group).where(Group.id.in_(group_ids)))).all()}
            episodes = (
                await session.scalars(
                    select(Episode).where(Episode.group_id.in_(group_ids)).order_by(Episode.group_index, Episode.id)
                )
            ).all()
            calls = await calls_of(session, [e.id for e in episodes], delta=delta)
        by_group: dict[str, list[EpisodeRecord]] = {gid: [] for gid in group_ids}
        for episode in episodes:
            by_group[episode.group_id or ""].append(episode_record(episode, calls[episode.id]))
        return Claim(
            lease_id=lease_id,
            lease_expires_at=expires_at,
            groups=[group_record(groups[gid], by_group[gid]) for gid in group_ids],
            stale=stale,
        )

    async def release(self, *, lease_id: str, group_ids: Sequence[str] | None = None) -> int:
        """Hand leased, untrained groups back at once (a trainer stopping before it trained them)."""
        where = [Group.lease_id == lease_id, Group.train_status == "pending"]
        if group_ids:
            where.append(Group.id.in_(list(group_ids)))
        async with self._sessions.write() as session:
            released = (await session.scalars(locked_groups(*where))).all()
            for group in released:
                group.lease_id, group.lease_owner, group.lease_expires_at = None, None, None
        return len(released)

    async def renew(self, *, lease_id: str, group_ids: Sequence[str], lease_s: float) -> float:
        """Extend a lease on the groups a trainer is training; returns the new expiry.

        All or nothing: if any of ``group_ids`` is no longer held by ``lease_id`` (it was re-leased
        or released after the lease expired) the answer is ``Conflict`` ``lease_lost`` and nothing
        changes, so the trainer must drop the step. A lease that expired but whose groups nobody
        claimed since is revived: no one else can have trained them. Groups this lease already
        acked are left as they are.
        """
        now = time.time()
        async with self._sessions.write() as session:
            rows = await _held(session, lease_id, group_ids)
            for group in rows.values():
                if group.lease_id != lease_id or group.train_status not in ("pending", "trained", "skipped"):
                    raise _lease_lost(group, lease_id)
            for group in rows.values():
                if group.train_status == "pending":
                    group.lease_expires_at = now + lease_s
        return now + lease_s

    async def ack(
        self,
        *,
        lease_id: str,
        group_ids: Sequence[str],
        step: int,
        status: AckStatus,
        note: str | None = None,
        audits: Mapping[str, dict[str, Any]] | None = None,
        reason: TrainerSkip | None = None,
    ) -> list[GroupRecord]:
        """Mark leased groups ``trained`` (or ``skipped``, for ``reason``) by ``step``; all or nothing.
        ``audits``: episode id -> the trainer's fidelity audit, kept on episodes of these groups only.

        The rule: an ack needs a live lease. Acking the same groups again with the same lease and
        step is a no-op (a retry, or a restarted trainer finishing its checkpoint). Otherwise a
        group must be pending and held by ``lease_id`` (``Conflict`` ``already_acked`` /
        ``lease_lost``), and the lease must not have expired (``Conflict`` ``lease_expired``): a
        trainer whose lease lapsed cannot know whether another claimed the group meanwhile, so it
        must first renew it (``renew``), which succeeds only if nobody did. That is the path
        of a trainer restarted after a crash between checkpoint and ack: its checkpoint holds the
        update, so renew-then-ack is right when the group is still its own, and ``lease_lost``
        (the group was claimed again and may be trained twice) is reported to it, never hidden.
        """
        now = time.time()
        async with self._sessions.write() as session:
            rows = await _held(session, lease_id, group_ids)
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
                    raise _lease_lost(group, lease_id)
                if group.lease_expires_at is None or group.lease_expires_at < now:
                    raise Conflict(
                        f"lease {lease_id} on group {group.id} expired "
                        f"{now - (group.lease_expires_at or now):.1f}s ago; renew it before acking "
                        "(the renewal fails if the group was claimed again)",
                        code="lease_expired",
                    )
                todo.append(group)
            if audits and todo:
                await _keep_audits(session, [g.id for g in todo], audits)
            for group in todo:
                group.train_status, group.trained_step, group.train_note = status, step, note
                group.train_reason = reason if status == "skipped" else None
                group.lease_expires_at = None
        return [group_record(g) for g in rows.values()]
