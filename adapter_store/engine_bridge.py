"""Feed store adapters to an EngineCore: registry -> host cache -> engine (which places them in the pool).

The engine keys adapters by AdapterKey(name, version); the bridge gives it the tenant-qualified name
"<tenant_id>/<adapter name>" and the version uuid, so two tenants' adapters of one name never meet
and a re-upload is a new key everywhere. The engine keeps working without any of this: adapters
loaded from folders (LLM.load_adapter) do not touch the store.

Threads: prepare() must run on the thread that drives the EngineCore (it calls add_adapter); the
host-cache load it may wait on runs wherever prefetch() started it. Host-cache evictions arrive on
any thread, so they are queued and applied to the engine by the next prepare() or sync().
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from loraplex.engine.engine_core import EngineCore
from loraplex.errors import AdapterNotFoundError, ConfigError
from loraplex.lora.types import LoraAdapter

from .schemas import AdapterPublic
from .store import AdapterStore


def engine_adapter_name(ref: AdapterPublic) -> str:
    return f"{ref.tenant_id}/{ref.name}"


class EngineAdapterBridge:
    def __init__(self, engine: EngineCore, store: AdapterStore):
        if store.config.dtype != engine.config.dtype:
            raise ConfigError(f"the store decodes adapters to {store.config.dtype} but the engine runs "
                              f"{engine.config.dtype}; give both the same dtype")
        if store.config.max_lora_rank > engine.config.max_lora_rank:
            raise ConfigError(f"the store accepts rank {store.config.max_lora_rank} but the engine's "
                              f"max_lora_rank is {engine.config.max_lora_rank}")
        self.engine = engine
        self.store = store
        self._evicted: list[str] = []
        self._evicted_lock = threading.Lock()
        self._by_version: dict[str, str] = {}  # version uuid -> engine name, for what the engine holds
        store.cache.add_eviction_listener(self._on_evict)

    def resolve(self, tenant_id: str, name: str) -> AdapterPublic:
        return self.store.resolve(tenant_id, name)

    def prefetch(self, ref: AdapterPublic) -> Future[LoraAdapter]:
        """Start the object-store fetch now so that it overlaps queueing (any thread)."""
        return self.store.prefetch(ref)

    def prepare(self, ref: AdapterPublic) -> str:
        """Make this version the engine's copy of its name; returns the name to pass to add_request."""
        return self.install(ref, self.store.get(ref))  # a hit, or waits for the (single-flight) load

    def install(self, ref: AdapterPublic, adapter: LoraAdapter) -> str:
        """prepare() for an adapter already decoded (by prefetch, off the engine thread): the engine
        thread then never waits on object storage."""
        self.sync()
        name = engine_adapter_name(ref)
        try:
            current = self.engine.adapters.resolve(name)
        except AdapterNotFoundError:
            current = None
        if current is None or current.version != ref.id:
            self.engine.add_adapter(name, adapter, version=ref.id)
            if current is not None:
                self._by_version.pop(current.version, None)
            self._by_version[ref.id] = name
        if ref.id not in self.store.cache:
            # Evicted between its load and now (a burst of prefetches larger than the cache), or too large
            # to keep: its eviction was heard before the engine held it, so queue it again. The next sync()
            # drops the engine's copy; the request about to be added keeps it until it finishes. Without
            # this the engine would hold it, outside the host-cache budget, until a later load evicted it.
            self._on_evict(ref.id)
        return name

    def prepare_by_name(self, tenant_id: str, name: str) -> str:
        return self.prepare(self.resolve(tenant_id, name))

    def forget(self, tenant_id: str, name: str) -> None:
        """After the adapter is deleted in the store: drop the engine's copy (requests already queued keep
        theirs and finish) and the host cache's copies of every version of it."""
        engine_name = f"{tenant_id}/{name}"
        try:
            self.engine.unload_adapter(engine_name)
        except AdapterNotFoundError:
            pass
        for version, held in list(self._by_version.items()):
            if held == engine_name:
                del self._by_version[version]
                self.store.cache.invalidate(version)

    def sync(self) -> None:
        """Drop engine copies of versions the host cache has evicted (requests using them keep theirs)."""
        with self._evicted_lock:
            evicted, self._evicted = self._evicted, []
        for version in evicted:
            name = self._by_version.pop(version, None)
            if name is None:
                continue
            try:
                if self.engine.adapters.resolve(name).version == version:
                    self.engine.unload_adapter(name)
            except AdapterNotFoundError:
                pass

    def _on_evict(self, version: str) -> None:
        with self._evicted_lock:
            self._evicted.append(version)
