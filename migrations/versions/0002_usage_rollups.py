"""Usage rollups for reports: hourly counters, hourly and daily latency histograms and percentiles;
usage_events.ttft_target_ms.

Rows recorded before this revision are not rolled up (there was no metering writer before it).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | Sequence[str] | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COUNTERS = ('requests', 'ok', 'cancelled', 'refused', 'errors', 'prompt_tokens', 'completion_tokens',
             'ttft_count', 'ttft_targeted', 'ttft_within')


def _key_columns(table: str, time_column: str = 'epoch_hour') -> list:
    return [
        sa.Column('tenant_id', sa.String(length=36), nullable=False),
        sa.Column(time_column, sa.Integer(), autoincrement=False, nullable=False),
        sa.Column('adapter_key', sa.String(length=36), nullable=False),
        sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'],
                                name=op.f(f'fk_{table}_tenant_id_tenants'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('tenant_id', time_column, 'adapter_key', name=op.f(f'pk_{table}')),
    ]


def _latency_columns() -> list:
    metrics = ('ttft', 'itl', 'e2e')
    return ([sa.Column(f'{m}_hist', sa.LargeBinary(), nullable=False) for m in metrics]
            + [sa.Column(f'{m}_p{p}', sa.Float(), nullable=True) for m in metrics for p in (50, 90, 99)])


def upgrade() -> None:
    op.add_column('usage_events', sa.Column('ttft_target_ms', sa.Float(), nullable=True))
    op.create_table('usage_hourly', *_key_columns('usage_hourly'),
                    *[sa.Column(name, sa.BigInteger(), nullable=False) for name in _COUNTERS])
    op.create_index('ix_usage_hourly_epoch_hour', 'usage_hourly', ['epoch_hour'])
    op.create_table('latency_hourly', *_key_columns('latency_hourly'), *_latency_columns())
    op.create_index('ix_latency_hourly_epoch_hour', 'latency_hourly', ['epoch_hour'])
    op.create_table('latency_daily', *_key_columns('latency_daily', 'epoch_day'), *_latency_columns())
    op.create_index('ix_latency_daily_epoch_day', 'latency_daily', ['epoch_day'])


def downgrade() -> None:
    op.drop_index('ix_latency_daily_epoch_day', table_name='latency_daily')
    op.drop_table('latency_daily')
    op.drop_index('ix_latency_hourly_epoch_hour', table_name='latency_hourly')
    op.drop_table('latency_hourly')
    op.drop_index('ix_usage_hourly_epoch_hour', table_name='usage_hourly')
    op.drop_table('usage_hourly')
    # SQLite >= 3.35 drops a plain (unindexed, unconstrained) column in place.
    op.drop_column('usage_events', 'ttft_target_ms')
