"""groups, episodes: (created_at, id) indexes for the dashboard's keyset pages

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-23 07:30:00
"""

from __future__ import annotations

from alembic import op


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index('ix_groups_created_id', 'groups', ['created_at', 'id'], unique=False)
    op.create_index('ix_episodes_created_id', 'episodes', ['created_at', 'id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_episodes_created_id', table_name='episodes')
    op.drop_index('ix_groups_created_id', table_name='groups')
