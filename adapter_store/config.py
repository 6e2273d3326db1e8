"""The adapter store's one configuration object, passed explicitly to everything that needs it.

Defaults keep everything under one data folder (SQLite file + local object folder), so a server
started with no flags works offline. PostgreSQL and S3 are chosen by URL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from loraplex.config import default_cache_dir
from loraplex.errors import ConfigError

GiB = 1 << 30
MiB = 1 << 20


def default_data_dir() -> Path:
    """LORAPLEX_DATA_DIR, else <LORAPLEX_HOME>/data: the registry file and the object folder live here."""
    explicit = os.environ.get("LORAPLEX_DATA_DIR")
    return Path(explicit) if explicit else default_cache_dir() / "data"


@dataclass(frozen=True)
class StoreConfig:
    data_dir: Path = field(default_factory=default_data_dir)
    # SQLAlchemy URL; None: sqlite file <data_dir>/registry.db. PostgreSQL: postgresql+psycopg://...
    database_url: str | None = None
    # file:///abs/path or s3://bucket/prefix; None: file://<data_dir>/objects
    object_store_url: str | None = None
    # For S3-compatible stores (MinIO, R2, moto). Credentials: these if set, else boto3's usual chain.
    s3_endpoint_url: str | None = None
    s3_region: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: str | None = None
    max_lora_rank: int = 256
    # An upload (all files together, or the archive) and its unpacked contents are capped at this.
    max_upload_bytes: int = 2 * GiB
    max_archive_members: int = 64
    host_cache_bytes: int = 4 * GiB  # decoded adapters kept in host RAM
    prefetch_workers: int = 2
    dtype: str = "float32"  # the dtype adapters are decoded to (the engine's)
    pin_memory: bool = False  # page-locked host copies, for fast copies to a CUDA device
    gc_min_age_s: float = 3600.0  # an unreferenced blob younger than this may belong to an upload in flight

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))  # a str from flags or the environment
        for name in ("max_lora_rank", "max_upload_bytes", "max_archive_members", "host_cache_bytes",
                     "prefetch_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"StoreConfig.{name} must be a positive integer, got {value!r}")
        if self.gc_min_age_s < 0:
            raise ConfigError(f"StoreConfig.gc_min_age_s must be >= 0, got {self.gc_min_age_s}")
        url = self.object_store_url
        if url is not None and not (url.startswith("file://") or url.startswith("s3://")):
            raise ConfigError(f"object store URL {url!r} must start with file:// or s3://")

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{Path(self.data_dir) / 'registry.db'}"

    @property
    def resolved_object_store_url(self) -> str:
        return self.object_store_url or f"file://{Path(self.data_dir) / 'objects'}"

    @staticmethod
    def from_env(**overrides) -> "StoreConfig":
        """Read LORAPLEX_DATABASE_URL, LORAPLEX_OBJECT_STORE_URL, LORAPLEX_S3_ENDPOINT_URL; overrides win."""
        env = {
            "database_url": os.environ.get("LORAPLEX_DATABASE_URL"),
            "object_store_url": os.environ.get("LORAPLEX_OBJECT_STORE_URL"),
            "s3_endpoint_url": os.environ.get("LORAPLEX_S3_ENDPOINT_URL"),
        }
        values = {k: v for k, v in env.items() if v}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return StoreConfig(**values)

    def with_(self, **changes) -> "StoreConfig":
        return replace(self, **changes)
