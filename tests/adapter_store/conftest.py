"""Fixtures for the adapter-store tests: a tiny model, real databases (SQLite files, a fresh PostgreSQL
database per session) and a real S3 endpoint (moto's server on 127.0.0.1).

PostgreSQL tests skip when the server is absent, except under CI (CI set), where they fail: CI must
never pass by skipping them.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# The database fixtures (SQLite files, fresh PostgreSQL databases) live in tests/db_fixtures.py.
from db_fixtures import db_url, pg_admin, pg_databases, pg_url, sqlite_url  # noqa: F401
from factories import make_tiny_model
from loraplex.adapter_store import AdapterStore, StoreConfig
from loraplex.models.config import ModelConfig, load_model_config

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

