"""AdapterStore: the registry, the blobs, uploads and the host cache behind one object.

This is what the server and the CLI hold. It needs the serving model's config (uploads are checked
against its shapes; decoded adapters are cast to the serving dtype) and one StoreConfig.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from loraplex.config import DTYPES
from loraplex.errors import ConfigError
from loraplex.lora.types import LoraAdapter
from loraplex.models.config import ModelConfig

from . import migrate
from .blobs import BlobRef, BlobStore
from .config import StoreConfig
from .fingerprint import model_fingerprint
from .garbage import GcReport, ScrubReport, collect_garbage, scrub
from .host_cache import CacheStats, HostCache
from .loader import AdapterLoader
from .object_store import open_object_store
from .registry import Registry
from .schemas import AdapterPublic, Page
from .staging import UploadFile, files_from_path
from .upload import Uploader


class AdapterStore:
    def __init__(self, config: StoreConfig, model: ModelConfig, registry: Registry, blobs: BlobStore):
        if config.dtype not in DTYPES:
            raise ConfigError(f"StoreConfig.dtype {config.dtype!r} is not one of {', '.join(DTYPES)}")
        if config.pin_memory and not torch.cuda.is_available():
            raise ConfigError("pin_memory=True needs a CUDA device (page-locked memory speeds copies to a GPU)")
        self.config = config
        self.model = model
        self.fingerprint = model_fingerprint(model)
        self.registry = registry
        self.blobs = blobs
        dtype = DTYPES[config.dtype]
        self.uploader = Uploader(config, registry, blobs, model, self.fingerprint, dtype)
        self.loader = AdapterLoader(registry, blobs, model, config.max_lora_rank, dtype, config.pin_memory)
        self.cache = HostCache(config.host_cache_bytes, self.loader.load, config.prefetch_workers)

    @classmethod
    def open(cls, config: StoreConfig, model: ModelConfig, upgrade_db: bool = True) -> "AdapterStore":
        """Connect to the database and object store named by config (applying migrations first)."""
        url = config.resolved_database_url
        if upgrade_db:
            migrate.upgrade(url)
        return cls(config, model, Registry.open(url), BlobStore(open_object_store(config)))

    def close(self) -> None:
        self.cache.close()
        self.registry.close()

    # -- writing -------------------------------------------------------------------------------
    def upload(self, tenant_id: str, name: str, files: Sequence[UploadFile],
               after_blob: Callable[[BlobRef], None] | None = None) -> AdapterPublic:
        return self.uploader.upload(tenant_id, name, files, after_blob)

    def upload_path(self, tenant_id: str, name: str, path: str | Path) -> AdapterPublic:
        """Upload a local PEFT folder or a .zip/.tar.gz archive."""
        return self.upload(tenant_id, name, files_from_path(Path(path)))

    def delete(self, tenant_id: str, name: str) -> int:
        """Delete every version of the name; in-flight requests keep the copies they already hold."""
        return self.registry.delete_adapter(tenant_id, name)

    # -- reading -------------------------------------------------------------------------------
    def resolve(self, tenant_id: str, name: str) -> AdapterPublic:
        """The newest ready version of the tenant's adapter for this base model (AdapterNotFoundError)."""
        return self.registry.resolve(tenant_id, name, self.fingerprint)

    def list_adapters(self, tenant_id: str, limit: int = 100, cursor: str | None = None) -> Page[AdapterPublic]:
        return self.registry.list_adapters(tenant_id, limit, cursor)

    def get(self, ref: AdapterPublic) -> LoraAdapter:
        """The decoded adapter through the host cache (AdapterUnavailableError if its blob is bad)."""
        return self.cache.get(ref)

    def prefetch(self, ref: AdapterPublic) -> Future[LoraAdapter]:
        return self.cache.prefetch(ref)

    def cache_stats(self) -> CacheStats:
        return self.cache.stats()

    # -- maintenance ---------------------------------------------------------------------------
    def collect_garbage(self, min_age_s: float | None = None, dry_run: bool = False) -> GcReport:
        age = self.config.gc_min_age_s if min_age_s is None else min_age_s
        return collect_garbage(self.registry, self.blobs, age, dry_run)

    def scrub(self) -> ScrubReport:
        return scrub(self.registry, self.blobs)
