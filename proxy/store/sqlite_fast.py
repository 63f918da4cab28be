"""The SQLite fast path: the recorder's group commit and the model routes' episode check, each on a
plain ``sqlite3`` connection with a thread of its own.

Through aiosqlite every statement, cursor and commit is a hop to its thread and back (a dozen for
a group commit, half a dozen for a one-row read, plus the ORM); here a whole job is one hop, about
ten times less CPU and latency. It writes the rows the engine path writes (``rows`` decides which
calls are admitted, ordinals, types and JSON text) and commits with ``BEGIN IMMEDIATE`` like the
writer engine, so the two take turns on SQLite's write lock: the episode states it reads inside
that transaction cannot change before it commits. Everything else goes through the SQLAlchemy engines.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import TypeVar

from sqlalchemy.exc import IntegrityError

from proxy.store.delta import Tail
from proxy.store.models import Call, Episode
from proxy.store.records import NewCall
from proxy.store.rows import (
    CHAIN_COLUMNS,
    JSON_COLUMNS,
    ROW_FIELDS,
    Layout,
    admit,
    json_text,
    last_tail,
    pack_batch,
    uncached,
)

T = TypeVar("T")

_INSERT_CALL_SQL = "INSERT INTO {} (ordinal, {}) VALUES ({})".format(
    Call.__tablename__, ", ".join(f'"{name}"' for name in ROW_FIELDS), ", ".join("?" * (len(ROW_FIELDS) + 1))
)
_JSON_AT = [i for i, name in enumerate(ROW_FIELDS) if name in JSON_COLUMNS]
_CHAIN_SQL = "SELECT {} FROM {} WHERE episode_id = ? ORDER BY ordinal".format(
    ", ".join(f'"{name}"' for name in CHAIN_COLUMNS), Call.__tablename__
)
_CHAIN_JSON_AT = [i for i, name in enumerate(CHAIN_COLUMNS) if name in JSON_COLUMNS]
_EPISODE_STATE_SQL = f"SELECT status, group_id, fork_of FROM {Episode.__tablename__} WHERE id = ?"
# Each episode's status and highest ordinal: one max() per episode (an index seek) instead of
# GROUP BY over every call of the episodes.
_EPISODE_STATES_SQL = (
    f"SELECT id, status, (SELECT max(ordinal) FROM {Call.__tablename__} WHERE episode_id = "
    f"{Episode.__tablename__}.id) FROM {Episode.__tablename__} WHERE id IN ({{}})"
)


class SqliteWorker:
    """One plain ``sqlite3`` connection on its own thread; jobs run one at a time, in order.

    Same pragmas as the engine's connections, so ``synchronous`` keeps its meaning.
    """

    def __init__(self, path: str, *, synchronous: str = "NORMAL", name: str = "worker") -> None:
        self._path = path
        self._synchronous = synchronous
        self._conn: sqlite3.Connection | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"flywheel-sqlite-{name}")

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            conn = sqlite3.connect(self._path, isolation_level=None, check_same_thread=False, timeout=30)
            for pragma in (
                "journal_mode=WAL",
                f"synchronous={self._synchronous}",
                "busy_timeout=30000",
                "foreign_keys=ON",
            ):
                conn.execute(f"PRAGMA {pragma}")
            self._conn = conn
        return self._conn

    async def run(self, job: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``job(connection)`` on this worker's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, lambda: job(self._connection()))

    async def close(self) -> None:
        def _close() -> None:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

        await asyncio.get_running_loop().run_in_executor(self._thread, _close)
        self._thread.shutdown(wait=True)


def _row(ordinal: int, values: list[object]) -> tuple[object, ...]:
    for i in _JSON_AT:  # what SQLAlchemy's JSON type binds (None is the JSON text 'null')
        values[i] = json_text(values[i])
    return (ordinal, *values)


def _last_tail(conn: sqlite3.Connection, episode_id: str) -> Tail | None:
    """The episode's last usable call, read back (JSON parsed as SQLAlchemy's JSON type does)."""
    rows = []
    for values in conn.execute(_CHAIN_SQL, (episode_id,)):
        row = list(values)
        for i in _CHAIN_JSON_AT:
            row[i] = json.loads(row[i]) if row[i] is not None else None
        rows.append(SimpleNamespace(**dict(zip(CHAIN_COLUMNS, row, strict=True))))
    return last_tail(rows)


def _insert_calls(
    conn: sqlite3.Connection, calls: Sequence[NewCall], bases: Mapping[str, Tail | None]
) -> tuple[dict[str, str | None], dict[str, Tail], Layout]:
    """``Calls.insert``' transaction, on the writer thread; returns the refused episodes
    (id -> status, None if missing), whose calls were not written, the episodes' new last calls
    and how the calls were stored."""
    episode_ids = sorted({c.episode_id for c in calls})
    layout = Layout()
    conn.execute("BEGIN IMMEDIATE")
    try:
        found = conn.execute(_EPISODE_STATES_SQL.format(", ".join("?" * len(episode_ids))), episode_ids).fetchall()
        states = {eid: (status, last) for eid, status, last in found}
        admitted, refused = admit(calls, states)
        tails: dict[str, Tail] = {}
        if admitted:
            bases = dict(bases)
            for episode_id in uncached(admitted, states, bases):
                layout.base_reads += 1
                bases[episode_id] = _last_tail(conn, episode_id)
            rows, tails = pack_batch(admitted, bases, layout)
            conn.executemany(_INSERT_CALL_SQL, [_row(ordinal, values) for ordinal, values in rows])
        conn.execute("COMMIT")
        return refused, tails, layout
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def _episode_state(conn: sqlite3.Connection, episode_id: str) -> tuple[str, str | None, str | None] | None:
    row = conn.execute(_EPISODE_STATE_SQL, (episode_id,)).fetchone()
    return (row[0], row[1], row[2]) if row else None


class SqliteFastPath:
    """The two hot-path queries of a SQLite file store, each on its own connection and thread
    (an episode check never waits behind a group commit)."""

    def __init__(self, path: str, *, synchronous: str = "NORMAL") -> None:
        self._writer = SqliteWorker(path, synchronous=synchronous, name="recorder")
        self._reader = SqliteWorker(path, synchronous=synchronous, name="gate")

    async def insert_calls(
        self, calls: Sequence[NewCall], bases: Mapping[str, Tail | None]
    ) -> tuple[dict[str, str | None], dict[str, Tail], Layout]:
        """Write a batch in one transaction; returns the refused episodes as ``rows.admit`` does, and
        the new last calls and layout counts as ``rows.pack_batch`` does. A constraint failure is
        SQLAlchemy's ``IntegrityError``, as on the engine path, so the repository handles both alike."""
        try:
            return await self._writer.run(lambda conn: _insert_calls(conn, calls, bases))
        except sqlite3.IntegrityError as exc:
            raise IntegrityError(_INSERT_CALL_SQL, None, exc) from exc

    async def episode_state(self, episode_id: str) -> tuple[str, str | None, str | None] | None:
        return await self._reader.run(lambda conn: _episode_state(conn, episode_id))

    async def close(self) -> None:
        await self._writer.close()
        await self._reader.close()
