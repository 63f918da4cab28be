"""Policy versions: the published adapters, newest current; each public method is one transaction.

The current version lives here, not in a proxy's memory, so every replica routes alike
(``adapters.py`` re-reads it). Versions only move forward. A version published as a canary
(``canaries.py``) is not current while it runs, nor ever once rolled back: the current is the
highest version that is neither.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Select, func, or_, select

from contract.vocabulary import BASE_VERSION
from proxy.errors import Conflict
from proxy.store import canaries
from proxy.store.canaries import Canaries
from proxy.store.models import Canary, PolicyVersion
from proxy.store.records import CanaryStart, PolicyVersionRecord
from proxy.store.sessions import Sessions


def _policy(row: PolicyVersion) -> PolicyVersionRecord:
    return PolicyVersionRecord(
        version=row.version,
        name=row.name,
        adapter_path=row.adapter_path,
        created_at=row.created_at,
        metadata=row.meta or {},
    )


def _current() -> Select[PolicyVersion]:
    passed_over = select(Canary.canary_version).where(or_(Canary.verdict.is_(None), Canary.verdict == "rollback"))
    return (
        select(PolicyVersion)
        .where(PolicyVersion.version.not_in(passed_over))
        .order_by(PolicyVersion.version.desc())
        .limit(1)
    )


class Versions:
    """The policy versions aggregate, and their canaries (``canaries``)."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions
        self.canaries = Canaries(sessions)

    async def current(self) -> PolicyVersionRecord | None:
        """The highest published version not running as a canary nor rolled back, or None before the first publish."""
        async with self._sessions.read() as session:
            row = (await session.scalars(_current())).first()
        return _policy(row) if row else None

    async def canary(self) -> PolicyVersionRecord | None:
        """The version running as a canary, or None."""
        async with self._sessions.read() as session:
            running = await canaries.running(session)
            row = await session.get(PolicyVersion, running.canary_version) if running else None
        return _policy(row) if row else None

    async def next_number(self) -> int:
        """The version number a publish without one takes."""
        async with self._sessions.read() as session:
            latest = (await session.execute(select(func.max(PolicyVersion.version)))).scalar()
        return (latest or BASE_VERSION) + 1

    async def add(
        self,
        *,
        version: int,
        name: str,
        adapter_path: str,
        metadata: dict[str, Any],
        canary: CanaryStart | None = None,
    ) -> PolicyVersionRecord:
        """Make ``version`` current, or with ``canary`` start it as the running canary. Versions only
        move forward: publishing an old number is a conflict; so is any publish while a canary runs
        (409 ``canary_pending``: promote or roll it back first)."""
        async with self._sessions.write() as session:
            # Concurrent publishes serialise on the newest version's row (SQLite: BEGIN IMMEDIATE).
            newest = select(PolicyVersion.version).order_by(PolicyVersion.version.desc()).limit(1)
            latest = (await session.execute(newest.with_for_update())).scalar() or 0
            pending = await canaries.running(session)
            if pending is not None:
                raise Conflict(
                    f"canary v{pending.canary_version} is still running: promote or roll it back before publishing",
                    param="version",
                    code="canary_pending",
                )
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
            if canary is not None:
                await session.flush()  # the version row first: the canary references it
                session.add(
                    Canary(
                        canary_version=version,
                        baseline_version=canary.baseline_version,
                        share=canary.share,
                        settings=canary.settings,
                        started_at=row.created_at,
                    )
                )
        return _policy(row)

    # Last in the class: below a method named ``list``, mypy reads ``list[...]`` as that method.
    async def list(self, limit: int = 100) -> list[PolicyVersionRecord]:
        """The newest ``limit`` versions, newest first."""
        async with self._sessions.read() as session:
            rows = (
                await session.scalars(select(PolicyVersion).order_by(PolicyVersion.version.desc()).limit(limit))
            ).all()
        return [_policy(r) for r in rows]
