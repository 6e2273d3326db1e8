"""Migrations give exactly the models' schema, on SQLite and PostgreSQL, and go down and up again."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

import loraplex.migrations.versions as versions
from loraplex.adapter_store import migrate
from loraplex.adapter_store.db import make_engine
from loraplex.adapter_store.models import Base

TABLES = {"tenants", "api_keys", "adapters", "usage_events", "usage_hourly", "latency_hourly", "latency_daily"}


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return request.getfixturevalue("pg_databases").create()


def schema_diff(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
            return compare_metadata(ctx, Base.metadata)
    finally:
        engine.dispose()


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_head_gives_exactly_the_models_schema(empty_db_url):
    migrate.upgrade(empty_db_url)
    assert migrate.current_revision(empty_db_url) == migrate.head_revision()
    assert tables(empty_db_url) == TABLES
    assert schema_diff(empty_db_url) == []


def test_downgrade_base_then_upgrade_head(empty_db_url):
    migrate.upgrade(empty_db_url)
    migrate.downgrade(empty_db_url, "base")
    assert migrate.current_revision(empty_db_url) is None
    assert tables(empty_db_url) == set()
    migrate.upgrade(empty_db_url)
    assert tables(empty_db_url) == TABLES
    assert schema_diff(empty_db_url) == []


def test_upgrade_is_idempotent(empty_db_url):
    migrate.upgrade(empty_db_url)
    migrate.upgrade(empty_db_url)
    assert migrate.current_revision(empty_db_url) == migrate.head_revision()


def test_migrating_leaves_sys_path_alone(tmp_path, monkeypatch):
    # Alembic prepends its ini's prepend_sys_path to sys.path; ours had ".", so a server started in the checkout
    # put the checkout's root first, where kernels/ hid the `kernels` distribution that transformers 5 imports
    # while loading a model (the engine then failed to start).
    import sys

    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    migrate.upgrade(f"sqlite:///{tmp_path / 'registry.db'}")
    assert sys.path == before


def test_every_revision_has_an_upgrade_and_a_downgrade():
    names = [m.name for m in pkgutil.iter_modules(versions.__path__)]
    assert names, "no revisions found"
    for name in names:
        module = importlib.import_module(f"{versions.__name__}.{name}")
        for fn in ("upgrade", "downgrade"):
            assert callable(getattr(module, fn, None)), f"{name} has no {fn}()"


def test_servers_starting_together_migrate_once(pg_databases):
    """Three processes (as three servers would be) upgrade one fresh PostgreSQL database at once."""
    import subprocess
    import sys

    url = pg_databases.create()
    code = f"from loraplex.adapter_store import migrate; migrate.upgrade({url!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True) for _ in range(3)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    assert schema_diff(url) == []
