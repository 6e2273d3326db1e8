"""Database fixtures shared by the test folders that need a real registry (import them into a conftest):
SQLite files and fresh PostgreSQL databases.

PostgreSQL tests skip when the server is absent, except under CI (CI set), where they fail: CI must
never pass by skipping them.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from loraplex.adapter_store import migrate

PG_HOST = os.environ.get("LORAPLEX_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("LORAPLEX_TEST_PG_PORT", "5432"))
PG_USERS = ("postgres", "root")
PREFIX = "loraplex_test_"


# -- PostgreSQL ------------------------------------------------------------------------------------

def _pg_connect(dbname: str):
    import psycopg

    errors = []
    for user in PG_USERS:
        try:
            return psycopg.connect(host=PG_HOST, port=PG_PORT, user=user, dbname=dbname, autocommit=True,
                                   connect_timeout=3), user
        except psycopg.OperationalError as e:
            errors.append(f"{user}: {e}")
    raise ConnectionError("; ".join(errors))


@pytest.fixture(scope="session")
def pg_admin() -> Callable[[], tuple[object, str]]:
    try:
        conn, _ = _pg_connect("test")
        conn.close()
    except (ConnectionError, ImportError) as e:
        message = f"PostgreSQL at {PG_HOST}:{PG_PORT} is not reachable: {e}"
        if os.environ.get("CI"):
            pytest.fail(f"{message} (CI is set: PostgreSQL tests must run)")
        pytest.skip(message)
    return lambda: _pg_connect("test")


class PgDatabases:
    """Creates fresh databases and drops them all at the end of the session.

    Names carry their creation time, so a later session can drop what a killed one left behind.
    """

    STALE_AFTER_S = 6 * 3600

    def __init__(self, admin):
        self._admin = admin
        self._names: list[str] = []

    def create(self) -> str:
        name = f"{PREFIX}{int(time.time())}_{uuid.uuid4().hex[:8]}"
        conn, user = self._admin()
        with conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        self._names.append(name)
        return f"postgresql+psycopg://{user}@{PG_HOST}:{PG_PORT}/{name}"

    def drop_all(self) -> None:
        conn, _ = self._admin()
        with conn:
            for name in self._names:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def sweep_stale(self) -> None:
        """Drop test databases older than STALE_AFTER_S that nobody is connected to."""
        conn, _ = self._admin()
        with conn:
            rows = conn.execute(
                "SELECT datname FROM pg_database d WHERE datname LIKE %s AND NOT EXISTS "
                "(SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)", (PREFIX + "%",)).fetchall()
            for (name,) in rows:
                stamp = name.removeprefix(PREFIX).split("_")[0]
                if stamp.isdigit() and time.time() - int(stamp) > self.STALE_AFTER_S:
                    conn.execute(f'DROP DATABASE IF EXISTS "{name}"')


@pytest.fixture(scope="session")
def pg_databases(pg_admin) -> Iterator[PgDatabases]:
    dbs = PgDatabases(pg_admin)
    dbs.sweep_stale()
    yield dbs
    dbs.drop_all()


@pytest.fixture(scope="session")
def pg_url(pg_databases: PgDatabases) -> str:
    """One migrated database shared by the session's PostgreSQL tests (each uses its own tenants)."""
    url = pg_databases.create()
    migrate.upgrade(url)
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'registry.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
