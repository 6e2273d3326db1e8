"""Adapters known to one engine: host copies by versioned key, and their residency in the pool.

A name maps to its newest version; every cache key (this table, the pool) is the versioned
AdapterKey, never the name, so a re-load under the same name can never be served stale weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.errors import AdapterNotFoundError, CapacityError
from loraplex.lora.types import LoraAdapter
from loraplex.unified_pager import AdapterResidency, UnifiedPager


@dataclass(frozen=True)
class AdapterKey:
    name: str
    version: str  # unique per load: a counter here, the store's uuid later


class AdapterTable:
    def __init__(self, pager: UnifiedPager):
        self._pager = pager
        self._host: dict[AdapterKey, LoraAdapter] = {}
        self._current: dict[str, AdapterKey] = {}
        self._refs: dict[AdapterKey, int] = {}
        self._counter = 0

    def add(self, name: str, adapter: LoraAdapter, version: str | None = None) -> AdapterKey:
        pages = self._pager.geometry.adapter_num_pages(adapter)
        if not self._pager.can_ever_fit(pages):
            raise CapacityError(
                f"adapter {name!r} needs {pages} pool pages but the pool has only "
                f"{self._pager.geometry.num_pages}; raise pool_bytes"
            )
        self._counter += 1
        key = AdapterKey(name, version or str(self._counter))
        old = self._current.get(name)
        self._host[key] = adapter
        self._current[name] = key
        if old is not None:
            self._retire(old)
        return key

    def remove(self, name: str) -> None:
        key = self._current.pop(name, None)
        if key is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        self._retire(key)

    def _retire(self, key: AdapterKey) -> None:
        """Forget a version that no name points to, once no request uses it."""
        if self._refs.get(key, 0) == 0 and self._current.get(key.name) != key:
            self._host.pop(key, None)
            if self._pager.get_adapter(key) is not None:
                self._pager.unload_adapter(key)

    def resolve(self, name: str) -> AdapterKey:
        key = self._current.get(name)
        if key is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        return key

    def names(self) -> list[str]:
        return sorted(self._current)

    def host(self, key: AdapterKey) -> LoraAdapter:
        return self._host[key]

    def acquire(self, key: AdapterKey) -> None:
        """A request holds this version: keep its host copy even if the name is re-loaded."""
        self._refs[key] = self._refs.get(key, 0) + 1

    def release(self, key: AdapterKey) -> None:
        n = self._refs[key] - 1
        if n:
            self._refs[key] = n
        else:
            del self._refs[key]
            self._retire(key)

    def ensure_resident(self, key: AdapterKey) -> AdapterResidency | None:
        """The adapter's pool residency, placing it (and evicting idle adapters) if needed;
        None when the pool cannot take it now."""
        res = self._pager.get_adapter(key)
        if res is None:
            res = self._pager.load_adapter(key, self._host[key])
        return res
