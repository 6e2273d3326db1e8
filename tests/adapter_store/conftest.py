"""Fixtures for the adapter-store tests: a tiny model, real databases (SQLite files, a fresh PostgreSQL
database per session) and a real S3 endpoint (moto's server on 127.0.0.1).

PostgreSQL tests skip when the server is absent, except under CI (CI set), where they fail: CI must
never pass by skipping them.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from factories import make_tiny_model
from loraplex.adapter_store import AdapterStore, StoreConfig, migrate
from loraplex.models.config import ModelConfig, load_model_config

PG_HOST = os.environ.get("LORAPLEX_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("LORAPLEX_TEST_PG_PORT", "5432"))
PG_USERS = ("postgres", "root")
PREFIX = "loraplex_test_"


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The tiny model's ops are far too small to split: with two threads on a busy 2-core machine,
    OpenMP's waiting made engine steps ~9x slower than with one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("store-model"), "llama")


@pytest.fixture(scope="session")
def tiny_config(tiny_model_dir: Path) -> ModelConfig:
    return load_model_config(tiny_model_dir)


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


# -- S3 (moto's server, a real HTTP endpoint on loopback) ------------------------------------------

@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_settings(moto_endpoint: str) -> dict:
    """StoreConfig fields for a fresh bucket on the moto server."""
    import boto3

    settings = dict(s3_endpoint_url=moto_endpoint, s3_region="us-east-1", s3_access_key_id="testing",
                    s3_secret_access_key="testing")
    bucket = f"adapters-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=bucket)
    return dict(settings, object_store_url=f"s3://{bucket}/loraplex")


@pytest.fixture(params=["local", "s3"])
def objects_kind(request: pytest.FixtureRequest) -> str:
    return request.param


# -- stores ----------------------------------------------------------------------------------------

StoreFactory = Callable[..., AdapterStore]


@pytest.fixture
def make_store(tmp_path: Path, tiny_config: ModelConfig, request: pytest.FixtureRequest) -> Iterator[StoreFactory]:
    """make_store(db="sqlite"|"postgresql", objects="local"|"s3", **StoreConfig fields) -> AdapterStore."""
    opened: list[AdapterStore] = []

    def factory(db: str = "sqlite", objects: str = "local", model: ModelConfig | None = None,
                **fields) -> AdapterStore:
        settings: dict = dict(data_dir=tmp_path / f"data{len(opened)}", max_lora_rank=16)
        if db == "postgresql":
            settings["database_url"] = request.getfixturevalue("pg_url")
        if objects == "s3":
            settings.update(request.getfixturevalue("s3_settings"))
        settings.update(fields)
        store = AdapterStore.open(StoreConfig(**settings), model or tiny_config)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()

