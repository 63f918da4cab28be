"""Retention in the store: purging finished episodes' bodies and token ids, deleting episodes on
request, and the audit log of both.

Each public method is one transaction (``sessions.py``), its audit entry written in it: an action
and its entry commit together or not at all.

**Purge** (``purge``) empties a call row of everything the agent or the engine said (request,
answer, error, the client's own request, prompt and sampled ids, log-probs, the grammar noted from
the request) and keeps what is counted: status, token counts, versions, timings, model names, each
choice's index and finish reason, and the notes minus the grammar, plus ``notes.purged`` (the time),
so every reader of one call (the trainer, the dashboard) knows it has no ids. ``exact_ids`` becomes
false and the row leaves the compact layout (no deltas: its episode's calls are purged together).
The episode row keeps its outcome and gets ``purged_at``. Eligible, and only these: episodes
finished (rewarded or abandoned) before the cutoff, not yet purged, whose group is done with: a
complete group its trainer acked ``trained`` or ``skipped``, or that a claim found ``stale``, or a
``failed`` group (never offered to a trainer); a lone episode (never trained by GRPO) once it is
finished. Never an open episode (its agent is still calling), an episode of an open group (its group
may still be trained), of a complete group pending training (offered to claims, or leased: a trainer
is reading it), nor the source of a fork episode still open (its replay reads the source's record).
A purged episode cannot be forked (``forks.py``). On PostgreSQL the candidates are locked (skipping
rows another transaction holds) and checked again, as the idle sweep does.

**Delete** (``delete_episode``, ``delete_user``) removes episodes from every table: their calls, the
episodes, and the episodes forked from them, transitively (a fork's replayed calls are copies of its
source's). A group that loses members keeps its remaining ones: its ``size`` drops to what is left;
an open group whose remaining members are all finished completes (``complete`` or ``failed`` by
``min_rewarded``, as a reward would complete it); a complete group pending training is judged again
by the same rule and becomes ``failed`` if its rewarded members no longer suffice; a lapsed lease on it
is cleared, so a trainer still holding it gets ``lease_lost``; a trained, skipped, stale or failed
group keeps its status (that is its history). A group left without members is deleted. A group
under a live lease is never touched: ``Conflict`` ``group_leased`` (409), and nothing is deleted.
Locks: group rows, then episode rows, each in id order (the one lock order); the set of forks is
read again under the locks, and if a fork appeared meanwhile the transaction starts over.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from sqlalchemy import delete, func, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import aliased

from contract.vocabulary import AuditAction, GroupStatus
from proxy.errors import Conflict, NotFound
from proxy.store.delta import Tails
from proxy.store.models import AuditEntry, Call, Episode, Group
from proxy.store.sessions import Sessions, locked_groups

FINISHED: Final = ("rewarded", "abandoned")
DONE_TRAINING: Final = ("trained", "skipped", "stale")
"""Train statuses of a complete group that no trainer will read again."""
SWEEPER: Final = "retention"
"""The actor of the sweeper's purges in the audit log."""
_FORK_TRIES = 3


@dataclass(slots=True)
class Purged:
    episodes: int = 0
    calls: int = 0
    audit_id: int | None = None
    """The batch's audit entry (None: nothing was purged)."""


@dataclass(slots=True)
class Deleted:
    episodes: list[str] = field(default_factory=list)
    """Ids of the deleted episodes: those asked for, then their forks."""
    forks: int = 0
    """Of those, episodes deleted because they were forked from one asked for."""
    calls: int = 0
    groups_deleted: list[str] = field(default_factory=list)
    groups_changed: list[str] = field(default_factory=list)
    """Groups that lost members and kept others (their size and perhaps status changed)."""
    audit_id: int = 0


@dataclass(slots=True)
class AuditRecord:
    id: int
    at: float
    actor: str
    action: AuditAction
    target: str
    rows: int
    detail: dict[str, Any]


class _ForksMoved(Exception):
    """A fork of a deleted episode was created between reading the forks and locking them."""


def _eligible(before: float) -> list[Any]:
    """The purge's rule (module docstring) as WHERE clauses on ``Episode``."""
    group_done = (
        select(Group.id)
        .where(
            Group.id == Episode.group_id,
            (Group.status == "failed") | ((Group.status == "complete") & Group.train_status.in_(DONE_TRAINING)),
        )
        .correlate(Episode)
        .exists()
    )
    fork = aliased(Episode)
    open_fork = select(fork.id).where(fork.fork_of == Episode.id, fork.status == "open").correlate(Episode).exists()
    return [
        Episode.status.in_(FINISHED),
        Episode.purged_at.is_(None),
        Episode.finished_at < before,
        Episode.group_id.is_(None) | group_done,
        ~open_fork,
    ]


def purged_choices(choices: Any) -> list[dict[str, Any]]:
    """What a purged call keeps of its choices: each one's index and finish reason."""
    kept = []
    for i, choice in enumerate(choices if isinstance(choices, list) else ()):
        raw = choice if isinstance(choice, dict) else {}
        kept.append({"index": raw.get("index", i), "finish_reason": raw.get("finish_reason")})
    return kept


def purged_notes(notes: Any, at: float) -> dict[str, Any]:
    """A purged call's notes: the proxy's decisions kept, the grammar (the request's tools or
    format, as the engine compiled them) dropped, ``purged`` set to when."""
    kept = dict(notes) if isinstance(notes, dict) else {}
    sampling = kept.get("sampling")
    if isinstance(sampling, dict) and "grammar" in sampling:
        kept["sampling"] = {k: v for k, v in sampling.items() if k != "grammar"}
    kept["purged"] = at
    return kept


_EMPTIED: Final[dict[str, Any]] = {
    "request": {},
    "response": None,
    "error": None,
    "prompt_token_ids": None,
    "client_request": None,
    "exact_ids": False,
    "encoding": 0,
    "base_ordinal": None,
    "prompt_choice": None,
    "prompt_ids": None,
    "messages_from": None,
    "client_from": None,
    "choice_ids": None,
    "choice_logprobs": None,
}
"""The columns a purge empties on every call row (the JSON layout, whole: no delta is left)."""


async def _audit(
    session: AsyncSession, *, actor: str, action: AuditAction, target: str, rows: int, detail: dict[str, Any]
) -> int:
    entry = AuditEntry(at=time.time(), actor=actor, action=action, target=target, rows=rows, detail=detail)
    session.add(entry)
    await session.flush()
    return entry.id


class Retention:
    """The retention aggregate: purges, deletions on request, the audit log. ``min_rewarded`` is
    the completion rule of a group that loses members (``episodes.py``'s)."""

    def __init__(
        self, sessions: Sessions, tails: Tails, *, min_rewarded: int = 2, sqlite_file: str | None = None
    ) -> None:
        self._sessions = sessions
        self._tails = tails
        self.min_rewarded = min_rewarded
        self._sqlite_file = sqlite_file

    # -- purge -----------------------------------------------------------------------------------

    async def purge(self, *, before: float, limit: int, actor: str = SWEEPER) -> Purged:
        """Purge up to ``limit`` eligible episodes finished before ``before`` (epoch s), oldest
        first, with one audit entry; ``Purged.episodes < limit`` means none is left."""
        now = time.time()
        async with self._sessions.write() as session:
            candidates = select(Episode.id).where(*_eligible(before)).order_by(Episode.finished_at).limit(limit)
            if not self._sessions.sqlite:
                candidates = candidates.with_for_update(of=Episode, skip_locked=True)
            ids = list((await session.scalars(candidates)).all())
            if ids and not self._sessions.sqlite:
                # Locked, checked again (a new statement sees what committed since: a fork just created).
                ids = list(await session.scalars(select(Episode.id).where(Episode.id.in_(ids), *_eligible(before))))
            if not ids:
                return Purged()
            rows = (
                await session.execute(select(Call.id, Call.choices, Call.notes).where(Call.episode_id.in_(ids)))
            ).all()
            if rows:
                await session.execute(
                    update(Call),
                    [
                        {"id": cid, **_EMPTIED, "choices": purged_choices(choices), "notes": purged_notes(notes, now)}
                        for cid, choices, notes in rows
                    ],
                )
            await session.execute(update(Episode).where(Episode.id.in_(ids)).values(purged_at=now))
            audit_id = await _audit(
                session,
                actor=actor,
                action="purge",
                target=f"finished before {before:.3f}",
                rows=len(rows),
                detail={"episodes": len(ids), "calls": len(rows), "before": before},
            )
        return Purged(episodes=len(ids), calls=len(rows), audit_id=audit_id)

    async def reclaim(self) -> int:
        """A SQLite file with ``auto_vacuum=INCREMENTAL``: hand the pages purges and deletions freed
        back to the file system (the file shrinks); returns how many were free. Otherwise 0: SQLite
        reuses freed pages for new rows (the file stops growing), PostgreSQL's autovacuum does."""
        if self._sqlite_file is None:
            return 0
        return await asyncio.to_thread(_incremental_vacuum, self._sqlite_file)

    # -- delete ------------------------------------------------------------------------------------

    async def delete_episode(self, episode_id: str, *, actor: str) -> Deleted:
        """Delete one episode, its calls and its forks (``NotFound`` if there is no such episode)."""

        async def roots(session: AsyncSession) -> list[str]:
            if await session.get(Episode, episode_id) is None:
                raise NotFound(f"episode {episode_id} not found", param="episode_id")
            return [episode_id]

        return await self._delete(roots, actor=actor, action="delete_episode", target=episode_id)

    async def delete_user(self, user: str, *, key: str, actor: str) -> Deleted:
        """Delete every episode whose ``metadata[key]`` is ``user`` (and their forks); none is no error."""

        async def roots(session: AsyncSession) -> list[str]:
            query = select(Episode.id).where(Episode.meta[key].as_string() == user).order_by(Episode.id)
            return list((await session.scalars(query)).all())

        return await self._delete(roots, actor=actor, action="delete_user", target=f"user:{user}")

    async def _delete(self, roots: Any, *, actor: str, action: AuditAction, target: str) -> Deleted:
        for _ in range(_FORK_TRIES):
            try:
                async with self._sessions.write() as session:
                    deleted = await self._delete_in(session, await roots(session), actor, action, target)
            except _ForksMoved:
                continue
            for episode_id in deleted.episodes:
                self._tails.drop(episode_id)
            return deleted
        raise Conflict("the episodes were being forked while deleting them; try again", code="episodes_busy")

    async def _delete_in(
        self, session: AsyncSession, roots: list[str], actor: str, action: AuditAction, target: str
    ) -> Deleted:
        ids = await _with_forks(session, roots)
        groups = sorted({g for g in (await _groups_of(session, ids)) if g is not None})
        locked = (await session.scalars(locked_groups(Group.id.in_(groups)))).all() if groups else []
        if ids:
            await session.execute(select(Episode.id).where(Episode.id.in_(ids)).order_by(Episode.id).with_for_update())
        if await _with_forks(session, roots) != ids:
            raise _ForksMoved
        now = time.time()
        leased = [g for g in locked if g.train_status == "pending" and g.lease_id and (g.lease_expires_at or 0) >= now]
        if leased:
            raise Conflict(
                f"group {leased[0].id} is leased to a trainer ({leased[0].lease_owner}) until its lease ends "
                "or is acked; delete its episodes after that",
                code="group_leased",
            )
        calls = 0
        if ids:
            calls = int((await session.execute(select(func.count()).where(Call.episode_id.in_(ids)))).scalar_one() or 0)
            await session.execute(delete(Call).where(Call.episode_id.in_(ids)))
            await session.execute(delete(Episode).where(Episode.id.in_(ids)))
        gone, changed = await self._settle(session, locked, now)
        deleted = Deleted(
            episodes=ids,
            forks=len(ids) - len(set(roots)),
            calls=calls,
            groups_deleted=gone,
            groups_changed=changed,
        )
        deleted.audit_id = await _audit(
            session,
            actor=actor,
            action=action,
            target=target,
            rows=calls + len(ids) + len(gone),
            detail={
                "episodes": len(ids),
                "forks": deleted.forks,
                "calls": calls,
                "groups_deleted": len(gone),
                "groups_changed": len(changed),
            },
        )
        return deleted

    async def _settle(self, session: AsyncSession, groups: Sequence[Group], now: float) -> tuple[list[str], list[str]]:
        """The groups that lost members after the deletion (module docstring): deleted when empty,
        else resized and, where still undecided, completed or judged again."""
        if not groups:
            return [], []
        counts: dict[str, dict[str, int]] = {g.id: {} for g in groups}
        result = await session.execute(
            select(Episode.group_id, Episode.status, func.count())
            .where(Episode.group_id.in_(list(counts)))
            .group_by(Episode.group_id, Episode.status)
        )
        for gid, member_status, n in result.all():
            if gid is not None:
                counts[gid][member_status] = int(n)
        gone: list[str] = []
        changed: list[str] = []
        for group in groups:
            left = counts[group.id]
            total = sum(left.values())
            if total == 0:
                await session.delete(group)
                gone.append(group.id)
                continue
            changed.append(group.id)
            group.size = total
            undecided = group.status == "open" or (group.status == "complete" and group.train_status == "pending")
            if undecided and left.get("open", 0) == 0 and left.get("awaiting", 0) == 0:
                judged: GroupStatus = (
                    "complete" if left.get("rewarded", 0) >= min(self.min_rewarded, total) else "failed"
                )
                if group.status == "open" or judged == "failed":
                    group.status, group.completed_at = judged, group.completed_at or now
            if group.train_status == "pending":
                group.lease_id, group.lease_owner, group.lease_expires_at = None, None, None
        await session.flush()
        return gone, changed

    # -- the audit log -----------------------------------------------------------------------------

    async def audit_log(self, *, limit: int = 100, before_id: int | None = None) -> list[AuditRecord]:
        """Entries newest first; ``before_id`` pages on (entries with a smaller id)."""
        query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
        if before_id is not None:
            query = query.where(AuditEntry.id < before_id)
        async with self._sessions.read() as session:
            return [
                AuditRecord(e.id, e.at, e.actor, e.action, e.target, e.rows, e.detail or {})
                for e in (await session.scalars(query)).all()
            ]


def _incremental_vacuum(path: str) -> int:
    """Free pages of an incremental auto-vacuum file, returned to the file system; 0 for another
    file. Its own connection: the pragma frees one page per step, and only ``executescript`` steps
    it to the end (the drivers' ``execute`` steps once)."""
    db = sqlite3.connect(path, timeout=30)
    try:
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
            return 0
        free = int(db.execute("PRAGMA freelist_count").fetchone()[0])
        if free:
            db.executescript("PRAGMA incremental_vacuum;")
        return free
    finally:
        db.close()


async def _with_forks(session: AsyncSession, roots: Iterable[str]) -> list[str]:
    """``roots`` (those that exist) and every episode forked from them, transitively: roots first, in order."""
    ids = list(dict.fromkeys(roots))
    if ids:
        ids = [e for e in ids if e in set(await session.scalars(select(Episode.id).where(Episode.id.in_(ids))))]
    seen = set(ids)
    frontier = list(ids)
    while frontier:
        found = (
            await session.scalars(select(Episode.id).where(Episode.fork_of.in_(frontier)).order_by(Episode.id))
        ).all()
        frontier = [e for e in found if e not in seen]
        seen.update(frontier)
        ids += frontier
    return ids


async def _groups_of(session: AsyncSession, ids: list[str]) -> list[str | None]:
    if not ids:
        return []
    return list((await session.scalars(select(Episode.group_id).where(Episode.id.in_(ids)))).all())
