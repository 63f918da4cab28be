"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-22 08:56:12.427725
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('groups',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('task_id', sa.String(length=256), nullable=False),
    sa.Column('size', sa.Integer(), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.Column('completed_at', sa.Double(), nullable=True),
    sa.Column('train_status', sa.String(length=16), nullable=False),
    sa.Column('lease_id', sa.String(length=36), nullable=True),
    sa.Column('lease_owner', sa.String(length=128), nullable=True),
    sa.Column('lease_expires_at', sa.Double(), nullable=True),
    sa.Column('trained_step', sa.Integer(), nullable=True),
    sa.Column('train_note', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_groups_lease_id'), ['lease_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_groups_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_groups_task_id'), ['task_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_groups_train_status'), ['train_status'], unique=False)

    op.create_table('policy_versions',
    sa.Column('version', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('adapter_path', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('version'),
    sa.UniqueConstraint('name')
    )
    op.create_table('trainer_steps',
    sa.Column('step', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.PrimaryKeyConstraint('step')
    )
    op.create_table('episodes',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('group_id', sa.String(length=36), nullable=True),
    sa.Column('group_index', sa.Integer(), nullable=True),
    sa.Column('task_id', sa.String(length=256), nullable=True),
    sa.Column('metadata', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('reward', sa.Double(), nullable=True),
    sa.Column('call_rewards', sa.JSON(), nullable=True),
    sa.Column('reward_metadata', sa.JSON(), nullable=True),
    sa.Column('abandon_reason', sa.Text(), nullable=True),
    sa.Column('created_at', sa.Double(), nullable=False),
    sa.Column('finished_at', sa.Double(), nullable=True),
    sa.ForeignKeyConstraint(['group_id'], ['groups.id'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_episodes_group_id'), ['group_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_episodes_status'), ['status'], unique=False)
        batch_op.create_index(batch_op.f('ix_episodes_task_id'), ['task_id'], unique=False)

    op.create_table('calls',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('episode_id', sa.String(length=36), nullable=False),
    sa.Column('ordinal', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('stream', sa.Boolean(), nullable=False),
    sa.Column('request', sa.JSON(), nullable=False),
    sa.Column('response', sa.JSON(), nullable=True),
    sa.Column('status_code', sa.Integer(), nullable=False),
    sa.Column('error', sa.JSON(), nullable=True),
    sa.Column('prompt_token_ids', sa.JSON(), nullable=True),
    sa.Column('choices', sa.JSON(), nullable=False),
    sa.Column('exact_ids', sa.Boolean(), nullable=False),
    sa.Column('model_requested', sa.String(length=256), nullable=False),
    sa.Column('model_served', sa.String(length=256), nullable=True),
    sa.Column('policy_version', sa.Integer(), nullable=True),
    sa.Column('replica', sa.String(length=128), nullable=True),
    sa.Column('started_at', sa.Double(), nullable=False),
    sa.Column('latency_ms', sa.Double(), nullable=False),
    sa.Column('ttft_ms', sa.Double(), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=True),
    sa.Column('completion_tokens', sa.Integer(), nullable=True),
    sa.Column('notes', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['episode_id'], ['episodes.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('episode_id', 'ordinal', name='uq_calls_episode_ordinal')
    )
    with op.batch_alter_table('calls', schema=None) as batch_op:
        batch_op.create_index('ix_calls_episode_started', ['episode_id', 'started_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_calls_policy_version'), ['policy_version'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('calls', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_calls_policy_version'))
        batch_op.drop_index('ix_calls_episode_started')

    op.drop_table('calls')
    with op.batch_alter_table('episodes', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_episodes_task_id'))
        batch_op.drop_index(batch_op.f('ix_episodes_status'))
        batch_op.drop_index(batch_op.f('ix_episodes_group_id'))

    op.drop_table('episodes')
    op.drop_table('trainer_steps')
    op.drop_table('policy_versions')
    with op.batch_alter_table('groups', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_groups_train_status'))
        batch_op.drop_index(batch_op.f('ix_groups_task_id'))
        batch_op.drop_index(batch_op.f('ix_groups_status'))
        batch_op.drop_index(batch_op.f('ix_groups_lease_id'))

    op.drop_table('groups')
