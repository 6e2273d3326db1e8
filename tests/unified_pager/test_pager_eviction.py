"""Sharing the free list: KV growth evicts idle adapters LRU-first, never pinned ones, all or nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from loraplex.errors import AdapterNotFoundError, CapacityError
from loraplex.unified_pager.pool import KV
from pager_testkit import TINY, adapter_of_pages, assert_unchanged, small_pager, snapshot

L = TINY.num_layers  # pages per KV block


def test_kv_evicts_idle_adapters_least_recently_used_first():
    rng = random.Random()
    pager = small_pager(30)  # 10 KV blocks of 3 layers
    for k in range(4):
        assert pager.load_adapter(k, adapter_of_pages(pager, rng, 6)) is not None
    assert pager.stats().free_pages == 6
    pager.get_adapter(0)  # LRU order is now 1, 2, 3, 0
    assert pager.allocate_kv("s", 2 * 4)  # 2 blocks = 6 pages: fits without eviction
    assert pager.stats().adapter_evictions == 0
    assert pager.allocate_kv("s", 3 * 4)  # one more block: evicts exactly adapter 1
    assert [pager.is_resident(k) for k in range(4)] == [True, False, True, True]
    assert pager.stats().adapter_evictions == 1 and pager.stats().free_pages == 3
    assert pager.allocate_kv("t", 4 * 4)  # 12 pages: 3 free + evict 2 (6) + evict 3 (6)
    assert [pager.is_resident(k) for k in range(4)] == [True, False, False, False]
    assert pager.stats().free_pages == 3
    pager.check_integrity()


def test_pinned_adapters_are_never_evicted_and_failure_changes_nothing():
    rng = random.Random()
    pager = small_pager(30)
    pinned = pager.load_adapter("p", adapter_of_pages(pager, rng, 12), pin=True)
    idle = pager.load_adapter("i", adapter_of_pages(pager, rng, 6))
    assert pinned is not None and idle is not None
    assert pager.allocate_kv("s", 4)  # 3 pages
    table = pager.block_tables(["s"]).clone()
    pinned_rows = pager.pool.rows()[pinned.row_index].clone()
    snap = snapshot(pager)
    # 9 free + 6 evictable = 15 pages; 6 blocks x 3 layers = 18 needed: refused.
    assert not pager.allocate_kv("t", 6 * 4)
    assert_unchanged(pager, snap)
    assert pager.is_resident("i") and pager.kv_num_blocks("t") == 0
    # Growing an existing sequence past the limit fails the same way and keeps its blocks.
    assert not pager.allocate_kv("s", 7 * 4)
    assert_unchanged(pager, snap)
    assert torch.equal(pager.block_tables(["s"]), table)
    # 15 pages exactly: evicts the idle adapter, leaves the pinned one and its weights alone.
    assert pager.allocate_kv("t", 5 * 4)
    assert not pager.is_resident("i") and pager.is_resident("p")
    assert torch.equal(pager.pool.rows()[pinned.row_index], pinned_rows)
    assert torch.equal(pager.block_tables(["s"]), table)
    assert pager.stats().free_pages == 0
    # Nothing left but the pinned adapter and KV: even one more block fails, changing nothing.
    snap = snapshot(pager)
    assert not pager.allocate_kv("u", 1)
    assert_unchanged(pager, snap)
    pager.check_integrity()
    # Unpinned, it becomes evictable.
    pager.unpin("p")
    assert pager.allocate_kv("u", 1) and not pager.is_resident("p")
    pager.check_integrity()


def test_adapter_load_evicts_only_when_that_makes_it_fit():
    rng = random.Random()
    pager = small_pager(30)
    pager.load_adapter("a", adapter_of_pages(pager, rng, 9))
    pager.load_adapter("b", adapter_of_pages(pager, rng, 9))
    pager.pin("b")
    assert pager.allocate_kv("s", 3 * 4)  # 9 pages; 3 free
    snap = snapshot(pager)
    assert pager.load_adapter("c", adapter_of_pages(pager, rng, 13)) is None  # 3 + 9 evictable < 13
    assert_unchanged(pager, snap)
    res = pager.load_adapter("c", adapter_of_pages(pager, rng, 12))  # 3 + 9 = 12: evicts a
    assert res is not None and not pager.is_resident("a") and pager.is_resident("b")
    assert pager.stats().adapter_evictions == 1
    with pytest.raises(CapacityError):
        pager.load_adapter("huge", adapter_of_pages(pager, rng, 31))
    with pytest.raises(CapacityError):
        pager.allocate_kv("long", 11 * 4)  # 11 blocks x 3 layers > 30 pages: can never fit
    assert pager.can_ever_fit(30) and not pager.can_ever_fit(31)
    pager.check_integrity()


def test_pins_are_reference_counted():
    rng = random.Random()
    pager = small_pager(30)
    res = pager.load_adapter("a", adapter_of_pages(pager, rng, 6))
    assert pager.load_adapter("a", adapter_of_pages(pager, rng, 3)) is res  # resident: same record
    pager.pin("a")
    assert pager.load_adapter("a", None, pin=True) is res
    assert pager.pin_count("a") == 2 and pager.stats().pinned_adapters == 1
    with pytest.raises(RuntimeError, match="pinned"):
        pager.unload_adapter("a")
    pager.unpin("a")
    assert pager.stats().pinned_adapters == 1
    assert not pager.allocate_kv("s", 9 * 4)  # still pinned once
    pager.unpin("a")
    assert pager.stats().pinned_adapters == 0
    with pytest.raises(RuntimeError, match="not pinned"):
        pager.unpin("a")
    with pytest.raises(AdapterNotFoundError):
        pager.pin("nope")
    assert pager.unload_adapter("a") and not pager.unload_adapter("a")
    assert pager.get_adapter("a") is None
    assert pager.stats().adapter_evictions == 0  # an unload is not an eviction
    pager.check_integrity()


def test_kv_allocation_adds_only_missing_blocks_and_never_shrinks():
    pager = small_pager(60)
    bs = pager.geometry.block_size
    assert pager.allocate_kv("s", 0) and pager.kv_num_blocks("s") == 0 and pager.stats().num_sequences == 1
    assert pager.block_tables(["s"]).shape == (L, 1, 0)
    for n in range(1, 5 * bs + 1):
        before = pager.block_tables(["s"])
        assert pager.allocate_kv("s", n)
        assert pager.kv_num_blocks("s") == -(-n // bs)
        after = pager.block_tables(["s"])
        assert torch.equal(after[:, :, : before.shape[2]], before)  # existing blocks keep their pages
    assert pager.stats().kv_pages == 5 * L
    assert pager.allocate_kv("s", 1) and pager.kv_num_blocks("s") == 5
    with pytest.raises(ValueError):
        pager.allocate_kv("s", -1)
    pager.free_kv("s")
    pager.free_kv("s")  # idempotent
    assert pager.stats().kv_pages == 0 and pager.stats().free_pages == 60
    pager.check_integrity()


def test_blocks_taken_together_lie_in_adjacent_pages_per_layer():
    # Attention reads one layer's blocks of a sequence in turn: the blocks a chunk takes together are laid
    # out layer-major, so on a fresh pool each layer's new blocks are one run of pages.
    pager = small_pager(60)
    bs = pager.geometry.block_size
    n = 4
    assert pager.allocate_kv("s", n * bs)
    tables = pager.block_tables(["s"])[:, 0]  # [L, n]
    assert sorted(tables.flatten().tolist()) == list(range(n * L))
    for layer in range(L):
        first = int(tables[layer, 0])
        assert tables[layer].tolist() == list(range(first, first + n))
    # A later growth of two blocks: each layer's two new blocks adjacent again, the old blocks unmoved.
    assert pager.allocate_kv("s", (n + 2) * bs)
    grown = pager.block_tables(["s"])[:, 0]
    assert torch.equal(grown[:, :n], tables)
    for layer in range(L):
        assert int(grown[layer, n + 1]) == int(grown[layer, n]) + 1
    pager.free_kv("s")
    pager.check_integrity()


def test_integrity_check_catches_corruption():
    rng = random.Random()

    def fresh():
        p = small_pager(30)
        p.allocate_kv("s", 9)
        p.load_adapter("a", adapter_of_pages(p, rng, 6))
        p.check_integrity()
        return p

    p = fresh()
    page = int(p.block_tables(["s"])[0, 0, 0])
    p.pool.owner[page] = 99  # a KV page that claims another owner
    with pytest.raises(AssertionError, match=f"page {page}"):
        p.check_integrity()

    p = fresh()
    free_page = int(p.pool.free_pages()[0])
    p.pool.kind[free_page] = KV  # a free-list page marked as KV
    with pytest.raises(AssertionError, match="free list"):
        p.check_integrity()

    p = fresh()
    p.pool._free[p.pool._top - 1] = p.pool._free[p.pool._top - 2]  # the same page twice on the free list
    with pytest.raises(AssertionError, match="twice"):
        p.check_integrity()

    p = fresh()
    seq = p._kv.get("s")
    seq.table[1, 0] = seq.table[0, 0]  # two layers share a page
    with pytest.raises(AssertionError, match="twice"):
        p.check_integrity()

    p = fresh()
    p._adapters.evictable_pages += 1  # a counter that drifted
    with pytest.raises(AssertionError, match="evictable"):
        p.check_integrity()
