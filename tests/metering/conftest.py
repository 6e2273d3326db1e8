"""Fixtures for the metering tests: real registries on a SQLite file and on PostgreSQL (tests/db_fixtures.py:
under CI, missing PostgreSQL fails instead of skipping), tenants and adapter versions to meter."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from db_fixtures import db_url, pg_admin, pg_databases, pg_url, sqlite_url  # noqa: F401
from loraplex.adapter_store import Registry
from metering_data import Fleet, make_fleet


@pytest.fixture
def registry(db_url: str) -> Iterator[Registry]:  # noqa: F811 - db_url is the imported fixture
    reg = Registry.open(db_url)
    yield reg
    reg.close()


@pytest.fixture
def fleet(registry: Registry) -> Fleet:
    """Three fresh tenants (the PostgreSQL database is shared by the session) and their adapters."""
    return make_fleet(registry)
