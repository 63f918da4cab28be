"""The transaction rule in one place: every way into the store opens here.

``Sessions`` owns the engines: the reader, and on SQLite a writer of its own whose transactions
start with ``BEGIN IMMEDIATE`` (on PostgreSQL one engine does both). An aggregate (``episodes.py``,
``calls.py``, ...) opens one ``write()`` or ``read()`` per public method, so each method is one
transaction, and every one of them passes ``translated``: a store that is down, unreachable or full
leaves as ``StoreUnavailable`` or ``StoreFull`` (503, 507), never as a driver's error. On a SQLite
file the recorder's group commit and the episode check take ``fast`` instead (``sqlite_fast.py``).

The lock order every writer keeps on PostgreSQL (group rows sorted by id, then episode rows sorted by
id) is spelled by ``locked_groups`` and ``lock_group``; ``calls_of`` is the calls read that the
episodes and the trainer's claims share.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from sqlalchemy import Select, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, async_sessionmaker

from proxy.store.db import CONNECT_TIMEOUT_S, is_sqlite, make_engine, sqlite_file
from proxy.store.faults import translated
from proxy.store.models import Call, Group
from proxy.store.records import CallRecord
from proxy.store.rows import call_records
from proxy.store.sqlite_fast import SqliteFastPath


class Sessions:
    """The store's engines and the only way to open a transaction on them."""

    def __init__(
        self,
        url: str,
        *,
        synchronous: str = "NORMAL",
        pool_size: int = 10,
        sqlite_fast_path: bool = True,
        timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.sqlite = is_sqlite(url)
        """SQLite takes no row locks: ``BEGIN IMMEDIATE`` serialises its writers instead."""
        self._reader = make_engine(url, synchronous=synchronous, pool_size=pool_size, timeout_s=timeout_s)
        self._writer: AsyncEngine = (
            make_engine(url, synchronous=synchronous, immediate=True) if self.sqlite else self._reader
        )
        self._read_sessions = async_sessionmaker(self._reader, expire_on_commit=False)
        self._write_sessions = async_sessionmaker(self._writer, expire_on_commit=False)
        # SQLite files: the recorder's group commits and the model routes' episode check each get
        # a plain connection on a thread of their own (see sqlite_fast); the rest uses the engines.
        path = sqlite_file(url) if sqlite_fast_path else None
        self.fast = SqliteFastPath(path, synchronous=synchronous) if path else None
        """The SQLite fast path, or None (PostgreSQL, an in-memory SQLite, or turned off); its
        callers wrap it in ``translated`` as ``write()`` and ``read()`` do."""

    async def close(self) -> None:
        if self.fast is not None:
            await self.fast.close()
        await self._reader.dispose()
        if self._writer is not self._reader:
            await self._writer.dispose()

    # Every way into the store passes ``translated``: a store that is down, unreachable or full
    # leaves here as ``StoreUnavailable`` or ``StoreFull`` (503, 507), never as a driver's error.
    @asynccontextmanager
    async def write(self) -> AsyncIterator[AsyncSession]:
        """One write transaction: committed when the block ends, rolled back if it raises."""
        async with translated(), self._write_sessions() as session, session.begin():
            yield session

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncSession]:
        async with translated(), self._read_sessions() as session:
            yield session

    @asynccontextmanager
    async def connect(self) -> AsyncIterator[AsyncConnection]:
        """One write transaction on a Core connection (the recorder's batch insert, no ORM)."""
        async with translated(), self._writer.begin() as conn:
            yield conn

    async def ping(self) -> None:
        async with self.read() as session:
            await session.execute(select(1))


def locked_groups(*where: Any) -> Select[Group]:
    """Group rows matching ``where``, locked in id order (the one lock order; a no-op on SQLite)."""
    return select(Group).where(*where).order_by(Group.id).with_for_update()


async def lock_group(session: AsyncSession, group_id: str | None) -> None:
    """Serialise group completion: two rewards of one group must not both miss the other."""
    if group_id is not None:
        await session.execute(select(Group.id).where(Group.id == group_id).with_for_update())


async def calls_of(
    session: AsyncSession, episode_ids: list[str], *, delta: bool = False
) -> dict[str, list[CallRecord]]:
    """The episodes' calls in ordinal order, by episode id; with ``delta`` as stored (``call_records``)."""
    out: dict[str, list[CallRecord]] = {eid: [] for eid in episode_ids}
    if not episode_ids:
        return out
    result = await session.execute(
        select(Call.__table__).where(Call.episode_id.in_(episode_ids)).order_by(Call.episode_id, Call.ordinal)
    )
    for record in call_records(result.all(), delta=delta):
        out[record.episode_id].append(record)
    return out
