"""The pool's accounting check: every page owned exactly once, and every counter agrees.

One O(num_pages) pass with numpy plus a Python loop over owners (sequences and adapters), so it
is cheap enough to run after every operation in tests and when the engine is idle.
"""

from __future__ import annotations

import numpy as np

from .adapter_cache import AdapterCache
from .kv_cache import KvBlockTables
from .pool import ADAPTER, FREE, KIND_NAMES, KV, PagePool


def _fail(msg: str) -> None:
    raise AssertionError(f"page pool integrity: {msg}")


def _check_owned(pool: PagePool, kind: int, owned: list[tuple[object, int, np.ndarray]]) -> int:
    """Each (name, owner id, pages) holds pages of this kind marked with its id, and no page is
    held twice; returns the number of pages held."""
    if not owned:
        held = np.zeros(0, dtype=np.int64)
    else:
        held = np.concatenate([p for _, _, p in owned]).astype(np.int64)
        owners = np.concatenate([np.full(len(p), o, dtype=np.int64) for _, o, p in owned])
        if held.min(initial=0) < 0 or held.max(initial=0) >= pool.num_pages:
            _fail(f"{KIND_NAMES[kind]} page id out of range 0..{pool.num_pages}")
        counts = np.bincount(held, minlength=pool.num_pages)
        if counts.max(initial=0) > 1:
            dup = np.flatnonzero(counts > 1)[:5].tolist()
            _fail(f"pages {dup} are held twice by {KIND_NAMES[kind]} owners")
        bad = np.flatnonzero((pool.kind[held] != kind) | (pool.owner[held] != owners))
        if len(bad):
            page = int(held[bad[0]])
            name = next(n for n, o, _ in owned if o == owners[bad[0]])
            _fail(
                f"page {page} is held by {KIND_NAMES[kind]} {name!r} but marked "
                f"{KIND_NAMES.get(int(pool.kind[page]), '?')} owner {int(pool.owner[page])}"
            )
    marked = int(np.count_nonzero(pool.kind == kind))
    if marked != len(held):
        _fail(f"{marked} pages are marked {KIND_NAMES[kind]} but their owners hold {len(held)}")
    return len(held)


def check_integrity(pool: PagePool, kv: KvBlockTables, adapters: AdapterCache) -> None:
    g = pool.geometry
    if pool.kind.shape != (g.num_pages,) or pool.owner.shape != (g.num_pages,):
        _fail("ownership arrays do not have one entry per page")
    unknown = ~np.isin(pool.kind, (FREE, KV, ADAPTER))
    if unknown.any():
        _fail(f"page {int(np.flatnonzero(unknown)[0])} has an unknown kind")

    # The free list: no repeats, every entry marked free, and every free-marked page on it.
    free = pool.free_pages()
    if free.min(initial=0) < 0 or free.max(initial=0) >= g.num_pages:
        _fail("free list holds an out-of-range page id")
    if np.bincount(free, minlength=g.num_pages).max(initial=0) > 1:
        _fail("free list holds a page twice")
    not_free = np.flatnonzero(pool.kind[free] != FREE)
    if len(not_free):
        page = int(free[not_free[0]])
        _fail(f"page {page} is on the free list but marked {KIND_NAMES.get(int(pool.kind[page]), '?')}")
    if int(np.count_nonzero(pool.kind == FREE)) != len(free):
        _fail(f"{int(np.count_nonzero(pool.kind == FREE))} pages are marked free but the free list has {len(free)}")

    # KV: each sequence's pages, one per layer per block.
    seqs = []
    reserved = 0
    for seq_id, s in kv.items():
        if s.table.shape[0] != g.num_layers or s.num_blocks > s.table.shape[1]:
            _fail(f"sequence {seq_id!r} has a malformed block table {s.table.shape} with {s.num_blocks} blocks")
        if not 0 <= s.used <= s.num_blocks:
            _fail(f"sequence {seq_id!r} uses {s.used} of its {s.num_blocks} blocks")
        seqs.append((seq_id, s.owner, s.pages()))
        reserved += (s.num_blocks - s.used) * g.num_layers
    kv_held = _check_owned(pool, KV, seqs)
    if kv_held != kv.num_pages:
        _fail(f"KV counter says {kv.num_pages} pages, sequences hold {kv_held}")
    if reserved != kv.reserved_pages:
        _fail(f"KV reserve counter says {kv.reserved_pages} pages, sequences reserve {reserved}")

    # Adapters: pages match the residency, pins and the LRU order agree.
    held, evictable, pinned = [], 0, 0
    idle = set(adapters.idle_keys())
    for key, rec in adapters.items():
        res = rec.residency
        if res.key != key:
            _fail(f"adapter stored under {key!r} says its key is {res.key!r}")
        if len(rec.pages) != -(-res.num_rows // g.rows_per_page):
            _fail(f"adapter {key!r} holds {len(rec.pages)} pages for {res.num_rows} rows")
        if not np.array_equal(res.pages.cpu().numpy(), rec.pages):
            _fail(f"adapter {key!r}: device page table differs from the host copy")
        if rec.pins < 0:
            _fail(f"adapter {key!r} has a negative pin count")
        if (rec.pins == 0) != (key in idle):
            _fail(f"adapter {key!r} with {rec.pins} pins is {'' if key in idle else 'not '}in the idle LRU")
        if rec.pins == 0:
            evictable += len(rec.pages)
        else:
            pinned += 1
        held.append((key, rec.owner, rec.pages))
    if len(idle) + pinned != len(adapters):
        _fail(f"idle LRU has {len(idle)} adapters, {pinned} pinned, {len(adapters)} resident")
    ad_held = _check_owned(pool, ADAPTER, held)
    if ad_held != adapters.num_pages:
        _fail(f"adapter counter says {adapters.num_pages} pages, adapters hold {ad_held}")
    if evictable != adapters.evictable_pages:
        _fail(f"evictable counter says {adapters.evictable_pages} pages, idle adapters hold {evictable}")
    if pinned != adapters.num_pinned:
        _fail(f"pinned counter says {adapters.num_pinned}, {pinned} adapters are pinned")

    if len(free) + kv_held + ad_held != g.num_pages:
        _fail(f"free {len(free)} + kv {kv_held} + adapter {ad_held} != {g.num_pages} pages")
