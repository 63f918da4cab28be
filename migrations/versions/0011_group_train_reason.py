"""groups.train_reason: why a group was never trained, as a value, not a note's wording

Skips used to be counted by matching the trainer's and the claim's notes (``deploy/groups.py``);
the reason is now a column the ack (``reason``) and the claim set (``contract.vocabulary.SkipReason``),
the note staying text for people. Existing rows get theirs once, here: ``stale`` from the status
(exact), and the rest from the notes' openings their writers used until now, frozen here. A note
that joins several reasons (a trainer before one note per group) or matches none stays NULL,
counted as ``other``.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-28 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

OPENINGS = (
    ("all ", " rewards equal (", "equal"),
    ("all ", " outcomes equal (", "shaping_only"),
    ("", " rewarded episodes (or penalized abandons, or rewarded choices)", "few"),
    ("no trainable calls", "", "empty"),
    ("non-finite gradient", "", "nonfinite"),
    ("teacher:", ": demonstrations, never trained on-policy", "teacher"),
)
"""(opening, then somewhere after it, reason) of each skip note a trainer (``trainer/data.py``,
``trainer/loop.py``) or the claim (teacher groups) wrote before this migration."""


def upgrade() -> None:
    op.add_column("groups", sa.Column("train_reason", sa.String(16), nullable=True))
    groups = sa.table(
        "groups", sa.column("train_status", sa.String), sa.column("train_note", sa.Text), sa.column("train_reason")
    )
    op.execute(groups.update().where(groups.c.train_status == "stale").values(train_reason="stale"))
    note = groups.c.train_note
    for opening, then, reason in OPENINGS:
        op.execute(
            groups.update()
            .where(
                groups.c.train_status == "skipped",
                note.startswith(opening, autoescape=True),
                note.contains(then, autoescape=True),
                ~note.contains("; ", autoescape=True),
                groups.c.train_reason.is_(None),
            )
            .values(train_reason=reason)
        )


def downgrade() -> None:
    with op.batch_alter_table("groups") as batch:  # SQLite drops a column by copying the table
        batch.drop_column("train_reason")
