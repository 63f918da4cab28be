"""Alembic environment: runs migrations on the async engine named by ``sqlalchemy.url``."""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.ext.asyncio import create_async_engine

from proxy.store.models import Base
from proxy.store.rows import json_text

target_metadata = Base.metadata


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection, target_metadata=target_metadata, render_as_batch=connection.dialect.name == "sqlite"
    )
    with context.begin_transaction():
        context.run_migrations()


async def _online() -> None:
    # JSON columns written by a migration get the text every writer stores (``rows.json_text``).
    engine = create_async_engine(context.config.get_main_option("sqlalchemy.url"), json_serializer=json_text)
    async with engine.connect() as connection:
        await connection.run_sync(_run)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata, literal_binds=True
    )
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_online())
