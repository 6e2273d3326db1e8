"""UnifiedPager: the facade the scheduler uses to share one page pool between KV and adapters.

Rules (docs/PAGE_POOL.md has the geometry and a worked example):
- KV blocks and adapters take pages from one free list; there is no split between them.
- When the free list is short, other sequences' reserved KV blocks (allocate_kv's reserve) are given
  back first, then idle (unpinned) adapters are evicted, least recently used first, and only when
  that is enough to fit the request: a request that cannot fit changes nothing.
- Pinned adapters and other sequences' KV are never taken. Preempting a sequence is the
  scheduler's decision (it calls free_kv).
- "Can't fit now" is a False/None result; "can never fit in this pool" is a CapacityError.

Not thread-safe: the engine's step loop is the only caller.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from loraplex.errors import CapacityError
from loraplex.lora.types import LoraAdapter

from .adapter_cache import AdapterCache
from .adapter_pages import AdapterResidency, place_adapter, plan_adapter
from .geometry import PoolGeometry
from .integrity import check_integrity
from .kv_cache import KvBlockTables, SeqBlocks
from .pool import ADAPTER, KV, PagePool


@dataclass(frozen=True)
class PoolStats:
    total_pages: int
    free_pages: int
    kv_pages: int
    adapter_pages: int
    num_sequences: int
    resident_adapters: int
    pinned_adapters: int
    adapter_evictions: int
    adapter_loads: int = 0  # adapters placed in the pool since start (a reload after eviction counts again)
    kv_reserved_pages: int = 0  # of kv_pages, those of blocks reserved past the tokens asked for


class UnifiedPager:
    def __init__(self, geometry: PoolGeometry, device: torch.device | str = "cpu") -> None:
        self.geometry = geometry
        self.pool = PagePool(geometry, device)
        self._kv = KvBlockTables(geometry.num_layers)
        self._adapters = AdapterCache()

    @property
    def device(self) -> torch.device:
        return self.pool.device

    # -- capacity ----------------------------------------------------------------------------

    def can_ever_fit(self, num_pages: int) -> bool:
        """Whether num_pages could fit in an otherwise empty pool."""
        return num_pages <= self.geometry.num_pages

    def available_pages(self) -> int:
        """Free pages plus pages that giving back every reserved KV block and evicting every idle
        adapter would free."""
        return self.pool.num_free + self._kv.reserved_pages + self._adapters.evictable_pages

    def _make_room(self, pages_needed: int, keep: SeqBlocks | None = None) -> bool:
        """Give back reserved KV blocks (but keep's), then evict idle adapters (LRU first), until
        pages_needed are free; False, changing nothing, if even all of that would not be enough."""
        shortfall = pages_needed - self.pool.num_free
        if shortfall <= 0:
            return True
        own = (keep.num_blocks - keep.used) * self.geometry.num_layers if keep is not None else 0
        if shortfall > self._kv.reserved_pages - own + self._adapters.evictable_pages:
            return False
        if self._kv.reserved_pages > own:
            for _, seq in self._kv.items():
                if seq.num_blocks > seq.used and seq is not keep:
                    self.pool.release(self._kv.trim(seq))
                    shortfall = pages_needed - self.pool.num_free
                    if shortfall <= 0:
                        return True
        for key in self._adapters.victims(shortfall):
            self.pool.release(self._adapters.remove(key))
            self._adapters.evictions += 1
        return True

    # -- KV ----------------------------------------------------------------------------------

    def allocate_kv(self, seq_id: Hashable, num_tokens: int, reserve_tokens: int = 0) -> bool:
        """Make seq_id's blocks hold num_tokens tokens in all (never shrinks). All or nothing:
        False, with nothing changed, when the pages cannot be found even by giving back other
        sequences' reserved blocks and evicting idle adapters.

        reserve_tokens: when the sequence needs new blocks and the free list has the pages for this
        many tokens more as well, take those blocks too, in the same allocation. The blocks one
        allocation takes lie layer by layer in adjacent pages (kv_cache.grow), so a decoding sequence
        that reserves reads its next blocks of a layer as one run of memory, where blocks taken one at
        a time lie one page every few hundred. Reserved blocks are the sequence's until its tokens reach
        them, and the first pages given back when the pool runs short (never by evicting for them)."""
        if reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be >= 0, got {reserve_tokens}")
        seq = self._kv.get(seq_id)
        have = seq.num_blocks if seq is not None else 0
        bs = self.geometry.block_size
        if num_tokens <= have * bs:  # the decode fast path: inside the blocks held
            if num_tokens < 0:
                raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
            if seq is None:
                self._kv.add(seq_id)
            elif num_tokens > seq.used * bs:  # into a reserved block
                self._kv.use(seq, -(-num_tokens // bs))
            return True
        need_blocks = -(-num_tokens // bs)
        layers = self.geometry.num_layers
        if need_blocks * layers > self.geometry.num_pages:
            raise CapacityError(
                f"sequence {seq_id!r}: {num_tokens} tokens need {need_blocks * layers} KV pages "
                f"({need_blocks} blocks x {layers} layers); the pool has {self.geometry.num_pages}"
            )
        pages_needed = (need_blocks - have) * layers
        want_blocks = min(-(-(num_tokens + reserve_tokens) // bs), self.geometry.num_pages // layers)
        if want_blocks > need_blocks and self.pool.num_free >= (want_blocks - have) * layers:
            pages = (want_blocks - have) * layers
        elif self._make_room(pages_needed, keep=seq):
            pages = pages_needed
        else:
            return False
        if seq is None:
            seq = self._kv.add(seq_id)
        self._kv.grow(seq, self.pool.take(pages, KV, seq.owner))
        self._kv.use(seq, need_blocks)
        return True

    def free_kv(self, seq_id: Hashable) -> None:
        """Return all of a sequence's pages (finish, abort, preemption); unknown ids are a no-op."""
        pages = self._kv.remove(seq_id)
        if pages is not None:
            self.pool.release(pages)

    def kv_num_blocks(self, seq_id: Hashable) -> int:
        seq = self._kv.get(seq_id)
        return seq.num_blocks if seq is not None else 0

    def block_tables(self, seq_ids: list) -> torch.Tensor:
        """[L, S, max_blocks] int32 on the pool device: page of block b of layer l of seq s,
        padded with 0 (callers know the lengths). KeyError for a sequence that holds no KV."""
        return self._kv.block_tables(seq_ids, self.pool.device)

    # -- adapters ----------------------------------------------------------------------------

    def load_adapter(self, key: Hashable, adapter: LoraAdapter, *, pin: bool = False) -> AdapterResidency | None:
        """Place the adapter (cast to the pool dtype), evicting idle LRU adapters only if that
        makes it fit. None, with nothing changed, if it cannot fit now; CapacityError if it is
        larger than the pool; AdapterError if it does not match the model. A key already
        resident returns its residency (the adapter argument is then not read). pin=True pins it
        in the same call, so no allocation can evict it between load and pin."""
        rec = self._adapters.get(key)
        if rec is not None:
            self._adapters.touch(key)
            if pin:
                self._adapters.pin(key)
            return rec.residency
        plan = plan_adapter(self.geometry, adapter)
        if not self.can_ever_fit(plan.num_pages):
            raise CapacityError(
                f"adapter {key!r} needs {plan.num_pages} pages ({plan.num_rows} rows); the pool has {self.geometry.num_pages}"
            )
        if not self._make_room(plan.num_pages):
            return None
        pages = self.pool.take(plan.num_pages, ADAPTER, self._adapters.next_owner())
        try:
            residency = place_adapter(self.pool, key, plan, pages)
        except BaseException:
            self.pool.release(pages)
            raise
        self._adapters.add(residency, pages)
        if pin:
            self._adapters.pin(key)
        return residency

    def get_adapter(self, key: Hashable) -> AdapterResidency | None:
        """The residency if resident (and mark it most recently used), else None."""
        rec = self._adapters.get(key)
        if rec is None:
            return None
        self._adapters.touch(key)
        return rec.residency

    def is_resident(self, key: Hashable) -> bool:
        """Like get_adapter without touching the LRU order."""
        return key in self._adapters

    def pin(self, key: Hashable) -> None:
        """One more user; AdapterNotFoundError if not resident."""
        self._adapters.pin(key)

    def unpin(self, key: Hashable) -> None:
        """One user fewer; RuntimeError below zero. At zero it becomes idle and most recently used."""
        self._adapters.unpin(key)

    def pin_count(self, key: Hashable) -> int:
        rec = self._adapters.get(key)
        return rec.pins if rec is not None else 0

    def unload_adapter(self, key: Hashable) -> bool:
        """Free an idle adapter's pages; False if it was not resident, RuntimeError if pinned."""
        if key not in self._adapters:
            return False
        self.pool.release(self._adapters.remove(key))
        return True

    # -- accounting --------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        return PoolStats(
            total_pages=self.geometry.num_pages,
            free_pages=self.pool.num_free,
            kv_pages=self._kv.num_pages,
            adapter_pages=self._adapters.num_pages,
            num_sequences=len(self._kv),
            resident_adapters=len(self._adapters),
            pinned_adapters=self._adapters.num_pinned,
            adapter_evictions=self._adapters.evictions,
            adapter_loads=self._adapters.next_owner(),  # every placement takes the next owner id
            kv_reserved_pages=self._kv.reserved_pages,
        )

    def check_integrity(self) -> None:
        """AssertionError unless every page has exactly one owner and all counters agree; O(pages)."""
        check_integrity(self.pool, self._kv, self._adapters)
