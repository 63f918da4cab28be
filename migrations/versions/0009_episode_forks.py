"""episodes.fork_of, fork_at, fork_rule, diverged_at, divergence: episodes forked from another at turn k

A fork episode replays its source's first ``fork_at`` answered calls from the record and samples
from there (``proxy/replay.py``); where its agent's request differs from the recorded one, the
replay ends and the call is marked (``diverged_at``, ``divergence``). Existing episodes are no forks.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-26 03:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("episodes", sa.Column("fork_of", sa.String(36), nullable=True))
    op.add_column("episodes", sa.Column("fork_at", sa.Integer, nullable=True))
    op.add_column("episodes", sa.Column("fork_rule", sa.String(16), nullable=True))
    op.add_column("episodes", sa.Column("diverged_at", sa.Integer, nullable=True))
    op.add_column("episodes", sa.Column("divergence", sa.JSON, nullable=True))
    op.create_index("ix_episodes_fork_of", "episodes", ["fork_of"])


def downgrade() -> None:
    op.drop_index("ix_episodes_fork_of", table_name="episodes")
    with op.batch_alter_table("episodes") as batch:  # SQLite drops a column by copying the table
        for column in ("divergence", "diverged_at", "fork_rule", "fork_at", "fork_of"):
            batch.drop_column(column)
