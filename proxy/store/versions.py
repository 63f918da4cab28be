"""Policy versions: the published adapters, newest current; each public method is one transaction.

The current version lives here, not in a proxy's memory, so every replica routes alike
(``adapters.py`` re-reads it). Versions only move forward.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select

from contract.vocabulary import BASE_VERSION
from proxy.errors import Conflict
from proxy.store.models import PolicyVersion
from proxy.store.records import PolicyVersionRecord
from proxy.store.sessions import Sessions


def _policy(row: PolicyVersion) -> PolicyVersionRecord:
    return PolicyVersionRecord(
        version=row.version,
        name=row.name,
        adapter_path=row.adapter_path,
        created_at=row.created_at,
        metadata=row.meta or {},
    )


class Versions:
    """The policy versions aggregate."""

    def __init__(self, sessions: Sessions) -> None:
        self._sessions = sessions

    async def current(self) -> PolicyVersionRecord | None:
        """The highest published version, or None before the first publish."""
        async with self._sessions.read() as session:
            row = (await session.scalars(select(PolicyVersion).order_by(PolicyVersion.version.desc()).limit(1))).first()
        return _policy(row) if row else None

    async def next_number(self) -> int:
        """The version number a publish without one takes."""
        async with self._sessions.read() as session:
            latest = (await session.execute(select(func.max(PolicyVersion.version)))).scalar()
        return (latest or BASE_VERSION) + 1

    async def add(self, *, version: int, name: str, adapter_path: str, metadata: dict[str, Any]) -> PolicyVersionRecord:
        """Make ``version`` current. Versions only move forward: publishing an old number is a conflict."""
        async with self._sessions.write() as session:
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

    # Last in the class: below a method named ``list``, mypy reads ``list[...]`` as that method.
    async def list(self, limit: int = 100) -> list[PolicyVersionRecord]:
        """The newest ``limit`` versions, newest first."""
        async with self._sessions.read() as session:
            rows = (
                await session.scalars(select(PolicyVersion).order_by(PolicyVersion.version.desc()).limit(limit))
            ).all()
        return [_policy(r) for r in rows]
