"""The adapter store: registry (SQLAlchemy + Alembic), content-addressed object storage (local or S3),
validated uploads, and a host-RAM cache of decoded adapters.

Typical use (the server does this at start)::

    store = AdapterStore.open(StoreConfig.from_env(), model_config)   # applies migrations
    tenant = store.registry.ensure_tenant("acme")
    ref = store.upload_path(tenant.id, "support-bot", "/path/to/peft-folder")
    adapter = store.get(store.resolve(tenant.id, "support-bot"))      # a LoraAdapter for the engine

Names are imported on first use, so `loraplex db upgrade` (registry only) does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "BlobRef": "blobs", "BlobStore": "blobs",
    "StoreConfig": "config",
    "AdapterUnavailableError": "errors", "BlobCorruptError": "errors", "BlobMissingError": "errors",
    "ConflictError": "errors", "NotFoundError": "errors", "StoreError": "errors",
    "GcReport": "garbage", "ScrubReport": "garbage",
    "CacheStats": "host_cache", "HostCache": "host_cache",
    "AdapterLoader": "loader", "LoadTimings": "loader",
    "ObjectInfo": "object_store", "ObjectStore": "object_store", "open_object_store": "object_store",
    "Registry": "registry",
    "AdapterCreate": "schemas", "AdapterPublic": "schemas", "ApiKeyCreate": "schemas", "ApiKeyCreated": "schemas",
    "ApiKeyPublic": "schemas", "Page": "schemas", "TenantCreate": "schemas", "TenantPublic": "schemas",
    "UsageEventCreate": "schemas",
    "UploadFile": "staging", "files_from_path": "staging",
    "AdapterStore": "store",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    # ruff: noqa: F401
    from .blobs import BlobRef, BlobStore
    from .config import StoreConfig
    from .errors import (
        AdapterUnavailableError,
        BlobCorruptError,
        BlobMissingError,
        ConflictError,
        NotFoundError,
        StoreError,
    )
    from .garbage import GcReport, ScrubReport
    from .host_cache import CacheStats, HostCache
    from .loader import AdapterLoader, LoadTimings
    from .object_store import ObjectInfo, ObjectStore, open_object_store
    from .registry import Registry
    from .schemas import (
        AdapterCreate,
        AdapterPublic,
        ApiKeyCreate,
        ApiKeyCreated,
        ApiKeyPublic,
        Page,
        TenantCreate,
        TenantPublic,
        UsageEventCreate,
    )
    from .staging import UploadFile, files_from_path
    from .store import AdapterStore
