"""episodes.awaiting_since: an episode may await a late reward (status ``awaiting``)

An episode whose workflow rewards it hours or days later (a human's review, a slow judge) used to
be abandoned by the idle reaper after ``episodes.deadline_s``, and its reward lost. Its workflow
now declares it (``POST /episodes/{id}/await_reward``, or ``late_rewards.tasks`` in the proxy's
settings); the status column takes the new value ``awaiting`` as it is (a string), and this column
records when the wait began, what ``late_rewards.max_wait_s`` counts from. Existing rows: NULL
(none ever awaited).

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 05:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("episodes", sa.Column("awaiting_since", sa.Double(), nullable=True))


def downgrade() -> None:
    episodes = sa.table("episodes", sa.column("status", sa.String))
    # An older proxy knows no ``awaiting``: such episodes are open again (its reaper then decides).
    op.execute(episodes.update().where(episodes.c.status == "awaiting").values(status="open"))
    with op.batch_alter_table("episodes") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("awaiting_since")
