"""episodes.train_audit: what the trainer made of each episode

The trainer's ack of a trained group carries a fidelity audit per episode (calls deduped, merged,
broken off, kept as context; tokens trained and scored under a grammar mask; the engine/trainer
log-prob gap). It is kept on the episode for the dashboard's episode page and the export.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-25 16:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("episodes", sa.Column("train_audit", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("train_audit")
