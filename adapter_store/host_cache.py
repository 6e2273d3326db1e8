"""Decoded adapters in host RAM: a byte-budgeted LRU keyed by version uuid, with single-flight loads.

- Keys are adapter version ids (uuids), never names: a re-upload is a new key.
- Concurrent get()/prefetch() of one version share one load; a failed load is not cached (the next
  call tries again) and its error reaches every waiter.
- An adapter larger than the whole budget is returned but not kept.
- Eviction listeners hear every key that leaves (the engine bridge uses this to drop engine copies).
- Prefetch threads run their torch work on one thread each (kernels.cpu_threads: a team of their own
  would slow every step of a CPU engine beside them).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from loraplex.errors import ConfigError
from loraplex.kernels.cpu_threads import confine_to_one_thread
from loraplex.lora.types import LoraAdapter

from .errors import StoreError
from .loader import LoadTimings
from .schemas import AdapterPublic

LoadFn = Callable[[AdapterPublic], tuple[LoraAdapter, LoadTimings]]


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int  # calls that started a load
    joined: int  # calls that waited on a load another call had started
    loads: int  # loads that succeeded
    load_failures: int
    evictions: int
    oversize: int  # loads too large to keep
    entries: int
    bytes: int
    budget_bytes: int
    load_seconds: float  # summed over successful loads


class HostCache:
    def __init__(self, budget_bytes: int, load: LoadFn, prefetch_workers: int = 2):
        if budget_bytes < 1:
            raise ConfigError(f"host cache budget must be positive, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._load = load
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._inflight: dict[str, Future[LoraAdapter]] = {}
        self._bytes = 0
        self._listeners: list[Callable[[str], None]] = []
        self._pool = ThreadPoolExecutor(max_workers=prefetch_workers, thread_name_prefix="adapter-prefetch",
                                        initializer=confine_to_one_thread)
        self._c = dict(hits=0, misses=0, joined=0, loads=0, load_failures=0, evictions=0, oversize=0)
        self._load_seconds = 0.0
        self.last_timings: LoadTimings | None = None

    def add_eviction_listener(self, fn: Callable[[str], None]) -> None:
        self._listeners.append(fn)

    def get(self, ref: AdapterPublic) -> LoraAdapter:
        """The decoded adapter, loading it (once, however many callers ask) if it is not cached."""
        found, fut, owner = self._lookup(ref)
        if found is not None:
            return found
        if owner:
            self._run_load(ref, fut)
        return fut.result()

    def prefetch(self, ref: AdapterPublic) -> Future[LoraAdapter]:
        """Start loading in the background (the admission path calls this as a request is accepted)."""
        found, fut, owner = self._lookup(ref)
        if found is not None:
            done: Future[LoraAdapter] = Future()
            done.set_result(found)
            return done
        if owner:
            self._pool.submit(self._run_load, ref, fut)
        return fut

    def peek(self, adapter_id: str) -> LoraAdapter | None:
        """The cached adapter without touching the LRU order or the counters."""
        with self._lock:
            return self._entries.get(adapter_id)

    def __contains__(self, adapter_id: str) -> bool:
        with self._lock:
            return adapter_id in self._entries

    def keys(self) -> list[str]:
        """Cached version ids, least recently used first."""
        with self._lock:
            return list(self._entries)

    def invalidate(self, adapter_id: str) -> bool:
        with self._lock:
            adapter = self._entries.pop(adapter_id, None)
            if adapter is not None:
                self._bytes -= adapter.nbytes
        if adapter is not None:
            self._notify([adapter_id])
        return adapter is not None

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**self._c, entries=len(self._entries), bytes=self._bytes,
                              budget_bytes=self.budget_bytes, load_seconds=self._load_seconds)

    def close(self) -> None:
        """Stop prefetching; loads not yet started fail their waiters rather than leave them hanging."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            orphans, self._inflight = list(self._inflight.values()), {}
        for fut in orphans:
            if not fut.done():
                fut.set_exception(StoreError("the adapter cache was closed before this load started"))

    # -- internals -----------------------------------------------------------------------------
    def _lookup(self, ref: AdapterPublic) -> tuple[LoraAdapter | None, Future[LoraAdapter], bool]:
        with self._lock:
            adapter = self._entries.get(ref.id)
            if adapter is not None:
                self._entries.move_to_end(ref.id)
                self._c["hits"] += 1
                return adapter, None, False  # type: ignore[return-value]
            fut = self._inflight.get(ref.id)
            if fut is not None:
                self._c["joined"] += 1
                return None, fut, False
            fut = Future()
            self._inflight[ref.id] = fut
            self._c["misses"] += 1
            return None, fut, True

    def _run_load(self, ref: AdapterPublic, fut: Future[LoraAdapter]) -> None:
        t0 = time.perf_counter()
        try:
            adapter, timings = self._load(ref)
        except BaseException as e:
            with self._lock:
                self._inflight.pop(ref.id, None)
                self._c["load_failures"] += 1
            fut.set_exception(e)
            return
        evicted = self._insert(ref.id, adapter, time.perf_counter() - t0, timings)
        fut.set_result(adapter)
        self._notify(evicted)

    def _insert(self, key: str, adapter: LoraAdapter, seconds: float, timings: LoadTimings) -> list[str]:
        evicted: list[str] = []
        with self._lock:
            self._inflight.pop(key, None)
            self._c["loads"] += 1
            self._load_seconds += seconds
            self.last_timings = timings
            size = adapter.nbytes
            if size > self.budget_bytes:
                self._c["oversize"] += 1
                return evicted
            self._entries[key] = adapter
            self._bytes += size
            while self._bytes > self.budget_bytes:
                victim, old = self._entries.popitem(last=False)  # never the new entry: it alone fits
                self._bytes -= old.nbytes
                self._c["evictions"] += 1
                evicted.append(victim)
        return evicted

    def _notify(self, keys: list[str]) -> None:
        for key in keys:
            for fn in self._listeners:
                fn(key)
