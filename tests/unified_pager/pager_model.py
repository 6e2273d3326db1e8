"""A UnifiedPager driven beside a plain-Python model of what it must do.

Every operation is applied to both, and ``check()`` compares them: return values, eviction
order, counts, page ownership (check_integrity), waste, and the pool's contents (each
sequence's KV pages hold that sequence's marker value; each resident adapter's rows hold its
weights), so a page handed to two owners, or a write through a wrong index, shows.
"""

from __future__ import annotations

import math

import pytest
import torch

from loraplex.errors import CapacityError
from loraplex.lora.types import MODULE_INDEX, LoraAdapter
from loraplex.unified_pager.pager import PoolStats, UnifiedPager


def packed_rows(adapter: LoraAdapter, d: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, D]: the documented packing, rebuilt independently of the pager."""
    parts = []
    for m in sorted(adapter.modules, key=lambda m: (m.layer, MODULE_INDEX[m.module])):
        parts += [m.a.t().to(dtype).reshape(-1, d), m.b.t().to(dtype).reshape(-1, d)]
    return torch.cat(parts)


class CheckedPager:
    def __init__(self, pager: UnifiedPager) -> None:
        self.p = pager
        g = pager.geometry
        self.g = g
        self.tokens: dict[object, int] = {}  # seq -> tokens its blocks hold
        self.marker: dict[object, float] = {}  # seq -> value written into all its KV pages
        self.pins: dict[object, int] = {}  # resident adapter -> pin count
        self.npages: dict[object, int] = {}
        self.expected: dict[object, torch.Tensor] = {}  # resident adapter -> [rows, D] contents
        self.lru: list = []  # idle adapters, least recently used first
        self.free = g.num_pages
        self.evictions = 0
        self.loads = 0
        self._next_marker = 1.0

    # -- the model's eviction rule -----------------------------------------------------------

    def _room(self, need: int) -> bool:
        shortfall = need - self.free
        if shortfall <= 0:
            return True
        if shortfall > sum(self.npages[k] for k in self.lru):
            return False
        while self.free < need:
            victim = self.lru.pop(0)
            self.free += self.npages.pop(victim)
            del self.pins[victim], self.expected[victim]
            self.evictions += 1
        return True

    def _touch(self, key) -> None:
        if key in self.lru:
            self.lru.remove(key)
            self.lru.append(key)

    # -- operations --------------------------------------------------------------------------

    def grow(self, seq, n_tokens: int) -> bool:
        have = math.ceil(self.tokens.get(seq, 0) / self.g.block_size)
        want = math.ceil(n_tokens / self.g.block_size)
        if want * self.g.num_layers > self.g.num_pages:
            with pytest.raises(CapacityError):
                self.p.allocate_kv(seq, n_tokens)
            return False
        need = max(0, want - have) * self.g.num_layers
        expect = self._room(need)
        assert self.p.allocate_kv(seq, n_tokens) is expect
        if expect:
            self.free -= need
            self.tokens[seq] = max(n_tokens, self.tokens.get(seq, 0))
            if seq not in self.marker:
                self.marker[seq] = self._next_marker
                self._next_marker += 1.0
            if need:  # the new pages get the sequence's marker, as attention would write K/V
                self.p.pool.kv_view()[self.p.block_tables([seq]).flatten().long()] = self.marker[seq]
        return expect

    def free_seq(self, seq) -> None:
        self.p.free_kv(seq)
        if seq in self.tokens:
            self.free += math.ceil(self.tokens.pop(seq) / self.g.block_size) * self.g.num_layers
            del self.marker[seq]

    def load(self, key, adapter: LoraAdapter, pin: bool) -> bool:
        if key in self.pins:
            assert self.p.load_adapter(key, adapter, pin=pin) is not None
            self._touch(key)
            if pin:
                self.pin(key, already_done=True)
            return True
        rows = sum(m.a.numel() + m.b.numel() for m in adapter.modules) // self.g.row_width
        need = math.ceil(rows / self.g.rows_per_page)
        if need > self.g.num_pages:
            with pytest.raises(CapacityError):
                self.p.load_adapter(key, adapter, pin=pin)
            return False
        expect = self._room(need)
        res = self.p.load_adapter(key, adapter, pin=pin)
        assert (res is not None) is expect
        if expect:
            assert res.num_rows == rows and res.num_pages == need  # waste under one page
            self.free -= need
            self.loads += 1
            self.npages[key] = need
            self.pins[key] = 1 if pin else 0
            if not pin:
                self.lru.append(key)
            self.expected[key] = packed_rows(adapter, self.g.row_width, self.g.dtype)
        return expect

    def get(self, key) -> None:
        res = self.p.get_adapter(key)
        assert (res is not None) == (key in self.pins)
        self._touch(key)

    def pin(self, key, already_done: bool = False) -> None:
        if not already_done:
            self.p.pin(key)
        if self.pins[key] == 0:
            self.lru.remove(key)
        self.pins[key] += 1

    def unpin(self, key) -> None:
        if self.pins.get(key, 0) == 0:
            with pytest.raises((RuntimeError, KeyError)):
                self.p.unpin(key)
            return
        self.p.unpin(key)
        self.pins[key] -= 1
        if self.pins[key] == 0:
            self.lru.append(key)

    def unload(self, key) -> None:
        if self.pins.get(key, 0) > 0:
            with pytest.raises(RuntimeError):
                self.p.unload_adapter(key)
            return
        assert self.p.unload_adapter(key) is (key in self.pins)
        if key in self.pins:
            self.lru.remove(key)
            self.free += self.npages.pop(key)
            del self.pins[key], self.expected[key]

    # -- comparison --------------------------------------------------------------------------

    def check(self, contents: bool = False) -> None:
        self.p.check_integrity()
        kv_pages = sum(math.ceil(t / self.g.block_size) for t in self.tokens.values()) * self.g.num_layers
        assert self.p.stats() == PoolStats(
            total_pages=self.g.num_pages,
            free_pages=self.free,
            kv_pages=kv_pages,
            adapter_pages=sum(self.npages.values()),
            num_sequences=len(self.tokens),
            resident_adapters=len(self.pins),
            pinned_adapters=sum(1 for n in self.pins.values() if n),
            adapter_evictions=self.evictions,
            adapter_loads=self.loads,
        )
        assert self.p._adapters.idle_keys() == self.lru  # same LRU order, so same future victims
        for seq, t in self.tokens.items():
            assert self.p.kv_num_blocks(seq) == math.ceil(t / self.g.block_size)  # waste under one block
        if contents:
            self.check_contents()

    def check_contents(self) -> None:
        # One gather per kind (not one per owner): cheap enough to run often.
        pages, values = [], []
        for seq, value in self.marker.items():
            if self.p.kv_num_blocks(seq):
                seq_pages = self.p.block_tables([seq]).flatten().long()
                pages.append(seq_pages)
                values.append(torch.full((len(seq_pages),), value))
        if pages:
            held = self.p.pool.tensor[torch.cat(pages)]  # [n, page_elems]
            bad = (held != torch.cat(values).to(held.dtype)[:, None]).any(dim=1)
            assert not bad.any(), f"KV page {int(torch.cat(pages)[bad][0])} was overwritten"
        if self.expected:
            res = [self.p._adapters.get(k).residency for k in self.expected]
            rows = self.p.pool.rows()[torch.cat([r.row_index for r in res])]
            assert torch.equal(rows, torch.cat(list(self.expected.values()))), "adapter rows were overwritten"

    def drain(self) -> None:
        """Free everything; the pool must be empty again."""
        for seq in list(self.tokens):
            self.free_seq(seq)
        for key in list(self.pins):
            while self.pins[key]:
                self.unpin(key)
            self.unload(key)
        self.check()
        s = self.p.stats()
        assert s.free_pages == s.total_pages and s.kv_pages == s.adapter_pages == 0
        assert s.num_sequences == s.resident_adapters == s.pinned_adapters == 0
