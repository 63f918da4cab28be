"""calls.receipt: the proxy's own id of each call, sent with its answer

A service in front of which Flywheel records traffic posts feedback on one call of an episode (a
user's thumbs-down on one answer), often long after, without counting the episode's calls. Every
answer now carries ``x-flywheel-call-id``, a receipt the proxy draws when the call arrives (a
streamed answer's headers go out before its record is written, so the ordinal cannot serve), and
``call_rewards`` may be keyed by it. Unique, indexed for that lookup. Existing rows: NULL (their
answers carried no receipt).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("calls") as batch:  # SQLite adds a unique index only through a copy
        batch.add_column(sa.Column("receipt", sa.String(40), nullable=True))
        batch.create_index("ix_calls_receipt", ["receipt"], unique=True)


def downgrade() -> None:
    with op.batch_alter_table("calls") as batch:
        batch.drop_index("ix_calls_receipt")
        batch.drop_column("receipt")
