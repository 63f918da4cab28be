"""episodes: (status, created_at, id) replaces the status index

The dashboard's episodes page filtered by status sorted every episode of that status on SQLite
(167 ms a page at 100,000 episodes, ``bench/ui_pages.py``); with the status first and the keyset
columns after it, the page is one index range on SQLite and PostgreSQL. The single-column status
index is its prefix, so it goes.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 12:10:00
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_episodes_status_created_id", "episodes", ["status", "created_at", "id"], unique=False)
    op.drop_index("ix_episodes_status", table_name="episodes")


def downgrade() -> None:
    op.create_index("ix_episodes_status", "episodes", ["status"], unique=False)
    op.drop_index("ix_episodes_status_created_id", table_name="episodes")
