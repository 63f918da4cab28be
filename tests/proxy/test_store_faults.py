"""Store faults become 503/507 client errors at the store's boundary (``proxy/store/faults.py``);
the same faults under load, with real servers: ``tests/integration/test_faults_store.py``."""

from __future__ import annotations

import sqlite3

import pytest
from sqlalchemy.exc import IntegrityError

from proxy.errors import StoreFull, StoreUnavailable
from proxy.store.faults import store_fault
from proxy.store.repository import Repository
from tests.support.services import free_port


async def test_a_postgresql_server_that_is_down_is_a_503_not_a_driver_error() -> None:
    repo = Repository(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/none", timeout_s=5)
    try:
        with pytest.raises(StoreUnavailable) as refused:
            await repo.episodes.episode_state("00000000-0000-0000-0000-000000000000")
    finally:
        await repo.close()
    error = refused.value
    assert (error.status_code, error.type, error.code) == (503, "service_unavailable", "store_unavailable")
    assert isinstance(error.__cause__, OSError)  # asyncpg's refused connect, chained


def test_a_full_disk_is_a_507_and_a_constraint_is_not_a_store_fault() -> None:
    full = store_fault(sqlite3.OperationalError("database or disk is full"))
    assert isinstance(full, StoreFull)
    assert (full.status_code, full.type, full.code) == (507, "insufficient_storage", "store_full")
    assert store_fault(IntegrityError("INSERT", None, sqlite3.IntegrityError("UNIQUE"))) is None
    assert store_fault(ValueError("a bug")) is None
