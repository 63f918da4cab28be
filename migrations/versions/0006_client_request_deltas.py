"""calls: a client's own conversation (Messages ``messages``, Responses ``input``) stored as a delta too

An agent speaking the Messages API, or the Responses API without ``previous_response_id``, sends
its whole conversation every turn; ``client_request`` kept it whole, so those episodes still grew
with the square of their turns after migration 0004. ``client_from`` (how many items of the base
call's list come first) makes the list a delta on the same base as the call's prompt and messages.

The column comes first, in the migration's transaction. Then the stored calls of episodes with a
client request are converted, ``FLYWHEEL_MIGRATE_BATCH`` episodes (default 200) per committed
transaction, in episode id order; a call is rewritten only where its list extends its base's
(``pack`` decides, as it did for new calls then: a frozen copy, ``migrations/frozen_layout.py``).
Every intermediate state is readable (a NULL ``client_from`` is a whole list) and a second run
rewrites nothing it already did.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23 21:40:00
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from alembic import op

from migrations.frozen_layout import Heavy, Tail, heavies, pack

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

_INTEGER = ("ordinal", "encoding", "base_ordinal", "prompt_choice", "messages_from", "client_from")
_BINARY = ("prompt_ids", "choice_ids", "choice_logprobs")
_JSON = ("request", "prompt_token_ids", "choices", "client_request")
_calls = sa.table(
    "calls",
    sa.column("id", sa.Integer()),
    sa.column("episode_id", sa.String()),
    sa.column("api", sa.String()),
    *(sa.column(name, sa.Integer()) for name in _INTEGER),
    *(sa.column(name, sa.LargeBinary()) for name in _BINARY),
    *(sa.column(name, sa.JSON()) for name in _JSON),
)


def upgrade() -> None:
    with op.batch_alter_table("calls", schema=None) as batch_op:
        batch_op.add_column(sa.Column("client_from", sa.Integer(), nullable=True))
    with op.get_context().autocommit_block():
        convert(op.get_bind(), batch=int(os.environ.get("FLYWHEEL_MIGRATE_BATCH", "200")))


def convert(bind: Any, *, batch: int, limit: int | None = None) -> int:
    """Store the client lists of episodes with client requests as deltas, ``batch`` episodes per
    transaction; returns how many calls it rewrote. ``limit`` stops after that many batches."""
    converted, after, batches = 0, "", 0
    columns = [_calls.c.id, _calls.c.episode_id, *(_calls.c[n] for n in (*_INTEGER, *_BINARY, *_JSON))]
    while limit is None or batches < limit:
        bind.exec_driver_sql("BEGIN")
        try:
            episodes = (
                bind.execute(
                    sa.select(_calls.c.episode_id)
                    .where(_calls.c.episode_id > after, _calls.c.api != "chat", _calls.c.client_request.is_not(None))
                    .group_by(_calls.c.episode_id)
                    .order_by(_calls.c.episode_id)
                    .limit(batch)
                )
                .scalars()
                .all()
            )
            for episode_id in episodes:
                rows = bind.execute(
                    sa.select(*columns).where(_calls.c.episode_id == episode_id).order_by(_calls.c.ordinal)
                ).all()
                converted += _convert_episode(bind, rows)
            bind.exec_driver_sql("COMMIT")
        except BaseException:
            bind.exec_driver_sql("ROLLBACK")
            raise
        if not episodes:
            break
        after, batches = episodes[-1], batches + 1
    return converted


def _convert_episode(bind: Any, rows: list[Any]) -> int:
    """Give each call whose client list extends its base's the delta form of that list. The base is
    the one the writer chose (the last call before it with packable prompt ids), recomputed here
    from the whole calls exactly as the writer computes it."""
    tail: Tail | None = None
    updates = []
    for row, (ordinal, heavy) in zip(rows, heavies(rows), strict=True):
        packed = pack(ordinal, Heavy(heavy.request, heavy.prompt_token_ids, heavy.choices, heavy.client_request), tail)
        tail = packed.tail or tail
        if not row.encoding or row.client_from is not None or packed.client_from is None:
            continue
        assert row.base_ordinal in (None, packed.base_ordinal), (row.id, row.base_ordinal, packed.base_ordinal)
        updates.append(
            {
                "row_id": row.id,
                "v_base_ordinal": packed.base_ordinal,
                "v_client_from": packed.client_from,
                "v_client_request": packed.client_request,
            }
        )
    if updates:
        values = {
            name: sa.bindparam(f"v_{name}", type_=_calls.c[name].type)
            for name in ("base_ordinal", "client_from", "client_request")
        }
        bind.execute(_calls.update().where(_calls.c.id == sa.bindparam("row_id")).values(**values), updates)
    return len(updates)


def downgrade() -> None:
    raise NotImplementedError("0006 rewrote client requests as deltas; restore a backup taken before it to go back")
