"""The object-store interface (local folder or S3) and the factory that picks one by URL.

Stores know nothing about content addressing: blobs.py names objects by their sha256 and verifies
them. Every put is atomic: a reader sees the whole object or none (never a partial write).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

from loraplex.errors import ConfigError

from .config import StoreConfig

# Keys are ours (content addresses), but the rule keeps a bug from writing outside the store.
_KEY = re.compile(r"^[a-z0-9][a-z0-9._-]*(/[a-z0-9][a-z0-9._-]*)*$")


def check_key(key: str) -> str:
    if not _KEY.match(key) or ".." in key:
        raise ValueError(f"object key {key!r} is not a safe key")
    return key


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: datetime  # UTC


class ObjectStore(Protocol):
    url: str

    def put(self, key: str, data: bytes) -> None:
        """Write the whole object atomically (replacing any object of that key)."""

    def get(self, key: str) -> bytes | bytearray:
        """The object's bytes (a bytearray where the store can fill one in place); BlobMissingError if none."""

    def stat(self, key: str) -> ObjectInfo | None:
        """Size and modification time, or None if missing."""

    def delete(self, key: str) -> None:
        """Remove the object; no error if it is already gone."""

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Every object whose key starts with prefix."""

    def remove_partial_writes(self, older_than_s: float) -> int:
        """Remove debris of writes that died midway (stores with atomic puts have none); returns how many."""


def open_object_store(config: StoreConfig) -> ObjectStore:
    url = config.resolved_object_store_url
    if url.startswith("file://"):
        from .local_objects import LocalObjectStore

        return LocalObjectStore(url.removeprefix("file://"))
    if url.startswith("s3://"):
        from .s3_objects import S3ObjectStore

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        return S3ObjectStore(bucket, prefix, config)
    raise ConfigError(f"object store URL {url!r} must start with file:// or s3://")
