"""episodes.purged_at and the audit_log table: retention's purges and deletions on request

Retention purges a finished episode's bodies and token ids once its group is done with, keeping
its rows and counts (``purged_at`` says when), and deletes episodes on request; each such action is
an ``audit_log`` entry (when, who, what, how many rows). Existing episodes are whole.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-28 02:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("episodes", sa.Column("purged_at", sa.Double(), nullable=True))
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.Double(), nullable=False),
        sa.Column("actor", sa.String(64), nullable=False),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("target", sa.Text(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("audit_log")
    with op.batch_alter_table("episodes") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("purged_at")
