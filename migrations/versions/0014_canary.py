"""episodes.policy_arm, episodes.canary_version, canaries: a published adapter may first serve a canary

With ``policy.canary.share`` above 0 a publish no longer switches every caller at once: the new
version serves that share of new episodes (the canary arm) while the others stay on the current one
(the baseline arm), and the rewards of both decide, by ``proxy/canary.py``'s test, whether it is
promoted or rolled back. Each episode records its arm and the canary it belongs to (drawn when it
is created, indexed: a decision replays the canary's rewards); ``canaries`` holds each rollout, its
frozen test settings and its one decision with the evidence (``verdict`` NULL while it runs).
Existing rows: NULL (no canary ran), and no canary.

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("episodes", sa.Column("policy_arm", sa.String(16), nullable=True))
    op.add_column("episodes", sa.Column("canary_version", sa.Integer(), nullable=True))
    op.create_index("ix_episodes_canary_version", "episodes", ["canary_version"])
    op.create_table(
        "canaries",
        sa.Column("canary_version", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("baseline_version", sa.Integer(), nullable=False),
        sa.Column("share", sa.Double(), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("verdict", sa.String(16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("manual", sa.Boolean(), nullable=True),
        sa.Column("evidence", sa.JSON(), nullable=True),
        sa.Column("decided_at", sa.Double(), nullable=True),
        sa.ForeignKeyConstraint(["canary_version"], ["policy_versions.version"]),
        sa.PrimaryKeyConstraint("canary_version"),
    )


def downgrade() -> None:
    # An older proxy knows no canary: a running or rolled-back canary's version becomes the current if highest.
    op.drop_table("canaries")
    op.drop_index("ix_episodes_canary_version", "episodes")
    with op.batch_alter_table("episodes") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("canary_version")
        batch.drop_column("policy_arm")
