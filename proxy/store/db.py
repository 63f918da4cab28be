"""Database engine and schema migrations.

SQLite (the embedded default) runs in WAL mode so readers never block the recorder, with a busy
timeout so the control API and the recorder take turns on the single write lock. PostgreSQL is
reached through asyncpg. The schema is created and upgraded only by Alembic (``migrations/``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from proxy.store.rows import json_text

MIGRATIONS = Path(__file__).resolve().parents[2] / "migrations"


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


CONNECT_TIMEOUT_S = 10.0
"""PostgreSQL: the longest a request waits to connect, or for a pooled connection, before its 503
``store_unavailable`` (``faults.py``): a server that is down or unreachable never leaves a client hanging."""


def make_engine(
    url: str,
    *,
    synchronous: str = "NORMAL",
    pool_size: int = 10,
    immediate: bool = False,
    timeout_s: float = CONNECT_TIMEOUT_S,
) -> AsyncEngine:
    """Create the async engine, with SQLite pragmas applied to every new connection.

    ``immediate`` makes every SQLite transaction ``BEGIN IMMEDIATE``: it takes the write lock up
    front, so a read-then-write transaction waits its turn (busy timeout) instead of failing with
    SQLITE_BUSY when another writer committed after its read. JSON columns are written by
    ``json_text``, the same text the SQLite fast path writes. On PostgreSQL, ``timeout_s`` bounds a
    connect and a wait for a pooled connection, and every pooled connection is pinged before use,
    so after a server restart the pool reconnects by itself instead of failing on dead connections.
    """
    if not is_sqlite(url):
        return create_async_engine(
            url,
            pool_size=pool_size,
            max_overflow=pool_size,
            pool_pre_ping=True,
            pool_timeout=timeout_s,
            connect_args={"timeout": timeout_s},
            json_serializer=json_text,
        )
    pool: dict[str, Any] = {}
    if database := sqlite_file(url):
        Path(database).parent.mkdir(parents=True, exist_ok=True)
        # A fixed pool: overflow connections would be opened and closed again on every burst of
        # reads (each a thread, a file open and four pragmas); SQLite reads gain nothing from more.
        pool = {"pool_size": pool_size, "max_overflow": 0}
    engine = create_async_engine(url, connect_args={"timeout": 30}, json_serializer=json_text, **pool)
    begin = "BEGIN IMMEDIATE" if immediate else "BEGIN"

    @event.listens_for(engine.sync_engine, "connect")
    def _pragmas(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # SQLAlchemy's "begin" hook below issues BEGIN
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _begin(connection: Any) -> None:
        connection.exec_driver_sql(begin)

    return engine


def sqlite_file(url: str) -> str | None:
    """The database file of a SQLite URL, or None (not SQLite, or in memory)."""
    if not is_sqlite(url):
        return None
    database = make_url(url).database
    return database if database and database != ":memory:" and not database.startswith("file:") else None


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def migrate(url: str, revision: str = "head") -> None:
    """Upgrade the schema to ``revision``. Synchronous: call it before the event loop starts,
    or through ``asyncio.to_thread`` from inside one (Alembic's env runs its own loop)."""
    from alembic import command

    if is_sqlite(url):
        database = make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
    command.upgrade(alembic_config(url), revision)


async def migrate_async(url: str, revision: str = "head") -> None:
    await asyncio.to_thread(migrate, url, revision)
