"""Which adapters are resident, which are pinned, and the LRU order of the idle ones.

Pinned adapters (used by a running or admitted request) are never evicted. Idle ones sit in an
OrderedDict, least recently used first, so choosing victims walks from the front and touching
an adapter is O(1). The pages idle adapters hold are counted as they change, so "could eviction
make room?" is answered without walking the list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator

import numpy as np

from loraplex.errors import AdapterNotFoundError

from .adapter_pages import AdapterResidency


class AdapterRecord:
    __slots__ = ("residency", "owner", "pages", "pins")

    def __init__(self, residency: AdapterResidency, owner: int, pages: np.ndarray) -> None:
        self.residency = residency
        self.owner = owner  # id the adapter's pages carry in PagePool.owner
        self.pages = pages  # [P] int64 host copy (residency.pages may live on the device)
        self.pins = 0


class AdapterCache:
    def __init__(self) -> None:
        self._records: dict[Hashable, AdapterRecord] = {}
        self._idle: OrderedDict[Hashable, AdapterRecord] = OrderedDict()  # unpinned, LRU first
        self._next_owner = 0
        self.num_pages = 0  # pages held by all resident adapters
        self.evictable_pages = 0  # pages held by idle adapters
        self.num_pinned = 0  # adapters with at least one pin
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._records

    def get(self, key: Hashable) -> AdapterRecord | None:
        return self._records.get(key)

    def items(self) -> Iterator[tuple[Hashable, AdapterRecord]]:
        return iter(self._records.items())

    def idle_keys(self) -> list[Hashable]:
        """Idle adapters, least recently used first."""
        return list(self._idle)

    def next_owner(self) -> int:
        return self._next_owner

    def _record(self, key: Hashable) -> AdapterRecord:
        rec = self._records.get(key)
        if rec is None:
            raise AdapterNotFoundError(f"adapter {key!r} is not resident in the page pool")
        return rec

    # -- membership --------------------------------------------------------------------------

    def add(self, residency: AdapterResidency, pages: np.ndarray) -> AdapterRecord:
        """A new resident adapter, idle and most recently used."""
        rec = AdapterRecord(residency, self._next_owner, pages)
        self._next_owner += 1
        self._records[residency.key] = rec
        self._idle[residency.key] = rec
        self.num_pages += len(pages)
        self.evictable_pages += len(pages)
        return rec

    def remove(self, key: Hashable) -> np.ndarray:
        """Forget an idle adapter; returns its pages ([P] int64) for the pool to take back."""
        rec = self._record(key)
        if rec.pins:
            raise RuntimeError(f"adapter {key!r} is pinned {rec.pins} time(s); unpin it before unloading")
        del self._records[key]
        del self._idle[key]
        self.num_pages -= len(rec.pages)
        self.evictable_pages -= len(rec.pages)
        return rec.pages

    def touch(self, key: Hashable) -> None:
        """Mark as most recently used (a pinned adapter re-enters the LRU order when unpinned)."""
        if key in self._idle:
            self._idle.move_to_end(key)

    # -- pins --------------------------------------------------------------------------------

    def pin(self, key: Hashable) -> None:
        rec = self._record(key)
        if rec.pins == 0:
            del self._idle[key]
            self.evictable_pages -= len(rec.pages)
            self.num_pinned += 1
        rec.pins += 1

    def unpin(self, key: Hashable) -> None:
        rec = self._record(key)
        if rec.pins == 0:
            raise RuntimeError(f"adapter {key!r} is not pinned: unpin without a matching pin")
        rec.pins -= 1
        if rec.pins == 0:
            self._idle[key] = rec  # most recently used: it was in use until now
            self.evictable_pages += len(rec.pages)
            self.num_pinned -= 1

    # -- eviction ----------------------------------------------------------------------------

    def victims(self, pages_needed: int) -> list[Hashable]:
        """Idle adapters, LRU first, whose pages together reach pages_needed (callers check
        evictable_pages >= pages_needed first, so the walk always succeeds)."""
        out: list[Hashable] = []
        got = 0
        for key, rec in self._idle.items():
            if got >= pages_needed:
                break
            out.append(key)
            got += len(rec.pages)
        return out
