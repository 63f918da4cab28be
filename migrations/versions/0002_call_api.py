"""calls: the API the client spoke, its own request and the answer id it saw

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 03:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('calls', schema=None) as batch_op:
        batch_op.add_column(sa.Column('api', sa.String(length=16), server_default='chat', nullable=False))
        batch_op.add_column(sa.Column('client_request', sa.JSON(), nullable=True))
        batch_op.add_column(sa.Column('response_id', sa.String(length=64), nullable=True))
        batch_op.create_index(batch_op.f('ix_calls_response_id'), ['response_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('calls', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_calls_response_id'))
        batch_op.drop_column('response_id')
        batch_op.drop_column('client_request')
        batch_op.drop_column('api')
