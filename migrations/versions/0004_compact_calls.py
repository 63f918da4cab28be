"""calls: the compact layout (binary token ids and log-probs, prompts and messages as deltas); stored calls converted

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23 11:20:00

The columns come first, in the migration's transaction. Then the stored calls are converted
episode by episode, ``FLYWHEEL_MIGRATE_BATCH`` episodes (default 200) per committed transaction, in
episode id order: a run that stops keeps every batch it committed, and running it again (``python
-m proxy migrate``) finds the calls still in the JSON layout (``encoding`` 0) and goes on. Every
intermediate state is readable: a converted call refers only to an earlier call of its episode,
which reads back the same in either layout, and readers take both layouts.

The conversion uses the compact layout's ``pack`` from a frozen private copy
(``migrations/frozen_layout.py``, taken from ``proxy/store/delta.py`` as of revision 0006), so a
later change to the live layout never changes what this revision does.
"""

from __future__ import annotations

import os
from typing import Any

import sqlalchemy as sa
from alembic import op

from migrations.frozen_layout import COMPACT, Heavy, Tail, heavies, pack, tail_of

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

# This revision's columns, frozen: later revisions add layout columns (0006: client_from) that do
# not exist yet when it runs; rows read here have none, and ``stored`` reads them as absent.
_PACKED = ("base_ordinal", "prompt_choice", "prompt_ids", "messages_from", "choice_ids", "choice_logprobs")
_CHAIN = ("episode_id", "ordinal", "request", "prompt_token_ids", "choices", "encoding", *_PACKED)
_INTEGER = ("encoding", "ordinal", "base_ordinal", "prompt_choice", "messages_from")
_BINARY = ("prompt_ids", "choice_ids", "choice_logprobs")
_JSON = ("request", "prompt_token_ids", "choices")
_calls = sa.table(
    'calls',
    sa.column('id', sa.Integer()),
    sa.column('episode_id', sa.String()),
    *(sa.column(name, sa.Integer()) for name in _INTEGER),
    *(sa.column(name, sa.LargeBinary()) for name in _BINARY),
    *(sa.column(name, sa.JSON()) for name in _JSON),
)


def upgrade() -> None:
    with op.batch_alter_table('calls', schema=None) as batch_op:
        batch_op.add_column(sa.Column('encoding', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('base_ordinal', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('prompt_choice', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('prompt_ids', sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column('messages_from', sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column('choice_ids', sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column('choice_logprobs', sa.LargeBinary(), nullable=True))
    with op.get_context().autocommit_block():
        convert(op.get_bind(), batch=int(os.environ.get("FLYWHEEL_MIGRATE_BATCH", "200")))


def convert(bind: Any, *, batch: int, limit: int | None = None) -> int:
    """Convert the calls still in the JSON layout, ``batch`` episodes per transaction; returns how
    many calls it converted. ``limit`` stops after that many batches (the tests' interrupted run)."""
    converted, after, batches = 0, "", 0
    chain = [_calls.c.id, *(_calls.c[name] for name in _CHAIN)]
    while limit is None or batches < limit:
        bind.exec_driver_sql("BEGIN")
        try:
            episodes = bind.execute(
                sa.select(_calls.c.episode_id)
                .where(_calls.c.episode_id > after)
                .group_by(_calls.c.episode_id)
                .order_by(_calls.c.episode_id)
                .limit(batch)
            ).scalars().all()
            for episode_id in episodes:
                rows = bind.execute(sa.select(*chain).where(_calls.c.episode_id == episode_id).order_by(_calls.c.ordinal)).all()
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
    """Rewrite one episode's JSON-layout calls compactly, each a delta on the last usable call before it."""
    tail: Tail | None = None
    updates = []
    for row, (ordinal, heavy) in zip(rows, heavies(rows), strict=True):
        if row.encoding:
            tail = tail_of(ordinal, heavy) or tail
            continue
        packed = pack(ordinal, Heavy(heavy.request, heavy.prompt_token_ids, heavy.choices), tail)
        tail = packed.tail or tail
        updates.append(
            {
                "row_id": row.id,
                "v_encoding": COMPACT,
                "v_request": packed.request,
                "v_prompt_token_ids": packed.prompt_token_ids,
                "v_choices": packed.choices,
                **{f"v_{name}": getattr(packed, name) for name in _PACKED},
            }
        )
    if updates:
        names = [key[2:] for key in updates[0] if key != "row_id"]
        values = {name: sa.bindparam(f"v_{name}", type_=_calls.c[name].type) for name in names}
        bind.execute(_calls.update().where(_calls.c.id == sa.bindparam("row_id")).values(**values), updates)
    return len(updates)


def downgrade() -> None:
    raise NotImplementedError("0004 rewrote stored calls compactly; restore a backup taken before it to go back")
