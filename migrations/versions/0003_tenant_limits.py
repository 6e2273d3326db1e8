"""Per-tenant admission settings: rate and concurrency limits, and the fair-share weight.

NULL limits mean "the server's default"; share (VTC weight) defaults to 1.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | Sequence[str] | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LIMITS = ('requests_per_minute', 'tokens_per_minute', 'max_concurrent')


def upgrade() -> None:
    for name in _LIMITS:
        op.add_column('tenants', sa.Column(name, sa.Integer(), nullable=True))
    op.add_column('tenants', sa.Column('share', sa.Float(), nullable=False, server_default='1.0'))


def downgrade() -> None:
    # SQLite >= 3.35 drops plain columns in place; a column with a server default needs batch mode there.
    with op.batch_alter_table('tenants') as batch:
        batch.drop_column('share')
        for name in reversed(_LIMITS):
            batch.drop_column(name)
