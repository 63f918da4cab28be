"""episodes.abandon_cause: who or what abandoned an episode, as a value, not a reason's prefix

The trainer never penalizes an abandon that is not the agent's doing. It used to tell by the
reason's first words, written in four places; the cause is now a column every abandoner sets
(``contract.vocabulary.AbandonCause``). Existing rows get theirs from the prefixes those writers
used until now, frozen here.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25 17:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

PREFIXES = (("no reward within", "deadline"), ("interrupted:", "interrupted"), ("infrastructure: ", "infrastructure"))
"""The reason prefixes of each blameless cause before this migration; every other abandon was the agent's."""


def upgrade() -> None:
    op.add_column("episodes", sa.Column("abandon_cause", sa.String(16), nullable=True))
    episodes = sa.table(
        "episodes", sa.column("status", sa.String), sa.column("abandon_reason", sa.Text), sa.column("abandon_cause")
    )
    abandoned = episodes.c.status == "abandoned"
    for prefix, cause in PREFIXES:
        op.execute(
            episodes.update()
            .where(abandoned, episodes.c.abandon_reason.startswith(prefix, autoescape=True))
            .values(abandon_cause=cause)
        )
    op.execute(episodes.update().where(abandoned, episodes.c.abandon_cause.is_(None)).values(abandon_cause="agent"))


def downgrade() -> None:
    with op.batch_alter_table("episodes") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("abandon_cause")
