"""Database engines: SQLite (a file, WAL, foreign keys on) or PostgreSQL, chosen by URL."""

from __future__ import annotations

from pathlib import Path

from loraplex.errors import ConfigError
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

# SQLite waits this long for another writer's lock instead of failing at once.
_SQLITE_BUSY_TIMEOUT_MS = 30_000


def make_engine(url: str) -> Engine:
    """An engine for url; creates the SQLite file's folder. ConfigError for an unsupported backend."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": _SQLITE_BUSY_TIMEOUT_MS / 1000})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    if backend == "postgresql":
        return create_engine(url, pool_pre_ping=True)
    raise ConfigError(f"database URL {parsed.render_as_string(hide_password=True)!r}: only sqlite and "
                      f"postgresql are supported")


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    cur = dbapi_conn.cursor()
    # SQLite leaves foreign keys off unless asked, per connection.
    cur.execute("PRAGMA foreign_keys=ON")
    # WAL lets readers (request resolution) run beside a writer (an upload); NORMAL is durable across
    # process crashes, which is what blob-before-row needs (a power cut may lose the last commit).
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute(f"PRAGMA busy_timeout={_SQLITE_BUSY_TIMEOUT_MS}")
    cur.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: rows are turned into dataclasses after commit, without another query.
    return sessionmaker(engine, expire_on_commit=False)
