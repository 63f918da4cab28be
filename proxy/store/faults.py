"""Store faults as client errors: a store that is down, unreachable or full is a 503 or 507, never a 500.

The store's drivers fail in their own ways: asyncpg raises ``ConnectionRefusedError`` while
PostgreSQL is down and its own errors while it starts or shuts down, SQLAlchemy wraps a connection
cut mid-query as ``DBAPIError`` (``connection_invalidated``), sqlite3 answers "database or disk is
full". Inside the store's boundary (``translated``) every such error is one of two
``FlywheelError``s, chained to the original: ``StoreFull`` (507, ``store_full``) when the disk is
full, else ``StoreUnavailable`` (503, ``store_unavailable``). Both say the client may retry. Other
errors (a constraint, a bug) pass through unchanged.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy import exc as sa

from proxy.errors import FlywheelError, StoreFull, StoreUnavailable

log = logging.getLogger("flywheel.store")

SQLITE_FULL = 13
"""SQLite's result code for "database or disk is full"."""
# asyncpg's classes by name (asyncpg is an optional dependency): the connection is gone, the server
# refuses connections for now (starting, shutting down: 57P01-57P03), or its disk is full (53100).
_ASYNCPG_UNAVAILABLE = frozenset({"PostgresConnectionError", "OperatorInterventionError", "InterfaceError"})
_ASYNCPG_FULL = frozenset({"DiskFullError"})


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: SQLAlchemy's ``orig``, then ``__cause__`` (a bounded walk)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and len(chain) < 8 and current not in chain:
        chain.append(current)
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return chain


def _asyncpg_names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__ if cls.__module__.startswith("asyncpg")}


def _is_full(exc: BaseException) -> bool:
    if isinstance(exc, sqlite3.Error):
        return getattr(exc, "sqlite_errorcode", None) == SQLITE_FULL or "disk is full" in str(exc)
    return bool(_asyncpg_names(exc) & _ASYNCPG_FULL)


def _is_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, sa.DBAPIError) and exc.connection_invalidated:
        return True
    if isinstance(exc, (sa.OperationalError, sa.InterfaceError, sa.DisconnectionError, sa.TimeoutError)):
        return True
    # Raised inside the store's boundary, an OS error or a timeout is the connection's (asyncpg
    # connects with the standard library's sockets and raises their errors as they are).
    if isinstance(exc, (OSError, TimeoutError, sqlite3.OperationalError)):
        return True
    return bool(_asyncpg_names(exc) & _ASYNCPG_UNAVAILABLE)


def store_fault(exc: BaseException) -> StoreUnavailable | None:
    """The client error for a store failure, or None when ``exc`` is not one (it then passes on)."""
    if isinstance(exc, StoreUnavailable):
        return exc
    chain = _causes(exc)
    if any(_is_full(e) for e in chain):
        return StoreFull(
            "the store is full (database or disk is full); the write was rolled back. Retry once space is freed",
            code="store_full",
        )
    if any(_is_unavailable(e) for e in chain):
        return StoreUnavailable(
            f"the store is unavailable ({type(chain[-1]).__name__}); retry shortly",
            code="store_unavailable",
        )
    return None


@asynccontextmanager
async def translated() -> AsyncIterator[None]:
    """Run a store operation; a store failure leaves it as ``StoreFull`` or ``StoreUnavailable``."""
    try:
        yield
    except FlywheelError:
        raise
    except Exception as exc:
        fault = store_fault(exc)
        if fault is None:
            raise
        log.warning("store unavailable", extra={"code": fault.code, "error": repr(exc)})
        raise fault from exc
