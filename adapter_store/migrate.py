"""Apply the Alembic migrations shipped in loraplex.migrations (`loraplex db upgrade`; the server at start).

Alembic keeps its migration context in module globals, so run these from one thread at a time in a
process; separate processes (servers starting together) are safe: on PostgreSQL they take an advisory
lock and migrate one after the other.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

from .db import make_engine


def alembic_config(url: str) -> Config:
    """An Alembic config pointing at the packaged migrations (works from an installed wheel too)."""
    folder = Path(str(files("loraplex.migrations")))
    cfg = Config(str(folder / "alembic.ini"))
    cfg.set_main_option("script_location", str(folder))
    # '%' is ConfigParser's interpolation character; a password may contain it.
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(url: str, revision: str = "head") -> None:
    _run(url, lambda cfg: command.upgrade(cfg, revision))


def downgrade(url: str, revision: str = "base") -> None:
    _run(url, lambda cfg: command.downgrade(cfg, revision))


def current_revision(url: str) -> str | None:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


# Any constant shared by every loraplex process: servers starting together on one PostgreSQL database
# take turns migrating instead of racing to create the same tables.
_PG_MIGRATION_LOCK = 0x6C6F7261706C6578  # "loraplex"


def _run(url: str, action) -> None:
    # One engine with our connect-time settings (SQLite pragmas), handed to env.py.
    engine: Engine = make_engine(url)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
            # (SQLite serialises writers on its own: the first DDL statement takes the file's write lock.)
            cfg = alembic_config(url)
            cfg.attributes["connection"] = conn
            action(cfg)
    finally:
        engine.dispose()
