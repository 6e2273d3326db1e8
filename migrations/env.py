"""Alembic environment: the registry's metadata, one connection, batch mode on SQLite (ALTER by copy)."""

from __future__ import annotations

import os

from alembic import context

from loraplex.adapter_store.db import make_engine
from loraplex.adapter_store.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:  # handed over by loraplex.adapter_store.migrate
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = os.environ.get("LORAPLEX_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


def run_migrations_offline() -> None:
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
