"""Adapters packed ahead of time (pack_adapter) land in the pool bit for bit as unpacked ones do.

The reference below is the placement as it was before packing existed: every matrix written into
a buffer of whole pages (tail zeroed), then the pages copied in; it shares no code with the pager.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from loraplex.errors import AdapterError
from loraplex.lora.types import MODULE_INDEX, LoraAdapter
from loraplex.unified_pager import PoolGeometry, RowLayout, UnifiedPager, pack_adapter
from loraplex.unified_pager.adapter_pages import logical_to_physical, plan_adapter, write_pages
from pager_testkit import ODD, SMOLLM2, TINY, model_config, random_adapter, small_pager

# Rank ranges on both sides of the numpy/torch switch in the B^T copies (rank 31 / 32).
RANKS = [(1, 1), (1, 8), (9, 40), (31, 33), (64, 128)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits, so that equality also holds for NaN (stale pool contents) and -0.0."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _reference_rows(adapter: LoraAdapter, d: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_rows, D]: A^T then B^T of each module in (layer, TARGET_MODULES) order."""
    ordered = sorted(adapter.modules, key=lambda m: (m.layer, MODULE_INDEX[m.module]))
    parts = [t.to(dtype).reshape(-1, d) for m in ordered for t in (m.a.t().contiguous(), m.b.t().contiguous())]
    return torch.cat(parts)


def _reference_write(pool: torch.Tensor, rows: torch.Tensor, pages: list[int], rpp: int) -> None:
    """The pre-packing placement: whole pages from a zero-tailed buffer, one index_copy_."""
    buf = torch.zeros(len(pages) * rpp, rows.shape[1], dtype=rows.dtype)
    buf[: rows.shape[0]] = rows
    pool.index_copy_(0, torch.tensor(pages, dtype=torch.int64), buf.view(len(pages), -1))


def _fragment(pager, rng: random.Random) -> None:
    """KV scattered over the pool so adapters get non-contiguous, shuffled pages."""
    for i in range(12):
        pager.allocate_kv(("frag", i), rng.randint(1, 3 * pager.geometry.block_size))
    for i in rng.sample(range(12), 6):
        pager.free_kv(("frag", i))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [TINY, ODD], ids=["tiny", "odd"])
def test_packed_and_unpacked_placement_write_the_same_pool(cfg, dtype):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    adapters = [random_adapter(cfg, rng, ranks=r, name=f"a{k}") for k, r in enumerate(RANKS)]
    layout = RowLayout.for_model(cfg, dtype)
    packed = [pack_adapter(a, layout) for a in adapters]  # once, for every page size below
    crossings = 0
    for block_size in (1, 3, 4):  # other page sizes, the same RowLayout
        pagers = [small_pager(14000, cfg, dtype, block_size) for _ in range(3)]
        for p in pagers:
            assert p.geometry.row_layout == layout
            p.pool.tensor.fill_(float("nan"))  # stale contents: tails must come out zeroed
            _fragment(p, random.Random(seed))  # the same ops, so the same pages in all three
        unpacked_pager, packed_pager, ref_pager = pagers
        expected = ref_pager.pool.tensor.clone()
        rpp = ref_pager.geometry.rows_per_page
        for k, (adapter, pk) in enumerate(zip(adapters, packed, strict=True)):
            assert plan_adapter(packed_pager.geometry, pk).packed_rows is pk.packed.rows  # the fast path
            assert plan_adapter(unpacked_pager.geometry, adapter).packed_rows is None
            ru = unpacked_pager.load_adapter(k, adapter, pin=True)
            rp = packed_pager.load_adapter(k, pk, pin=True)
            assert ru is not None and rp is not None
            pages = rp.pages.tolist()
            assert ru.pages.tolist() == pages and len(pages) == -(-rp.num_rows // rpp)
            crossings += len(set(np.diff(pages).tolist()) - {1}) > 0  # pages not in one run
            assert torch.equal(ru.row_index, rp.row_index) and ru.slots == rp.slots
            assert torch.equal(ru.layout, rp.layout) and torch.equal(ru.scales, rp.scales)
            assert (ru.num_rows, ru.max_rank, ru.nbytes) == (rp.num_rows, rp.max_rank, rp.nbytes)
            _reference_write(expected, _reference_rows(adapter, layout.row_width, dtype), pages, rpp)
        assert torch.equal(_bits(packed_pager.pool.tensor), _bits(expected)), f"seed {seed}"
        assert torch.equal(_bits(unpacked_pager.pool.tensor), _bits(expected)), f"seed {seed}"
        packed_pager.check_integrity()
    assert crossings > 0


def test_packed_modules_are_views_of_one_buffer_with_the_same_values():
    rng = random.Random()
    adapter = random_adapter(TINY, rng, ranks=(1, 40), modules=["v_proj", "q_proj", "down_proj"])  # unsorted
    layout = RowLayout.for_model(TINY, torch.float32)
    packed = pack_adapter(adapter, layout)
    rows = packed.packed.rows
    num_rows = PoolGeometry.for_model(TINY, 1 << 20, torch.float32).adapter_num_rows(adapter)
    assert rows.shape == (num_rows, layout.row_width)
    base, end = rows.data_ptr(), rows.data_ptr() + rows.numel() * rows.element_size()
    assert [(m.layer, m.module) for m in packed.modules] == [(m.layer, m.module) for m in adapter.modules]
    for m, p in zip(adapter.modules, packed.modules, strict=True):
        assert (p.rank, p.scale) == (m.rank, m.scale)
        assert p.a.shape == m.a.shape and p.b.shape == m.b.shape
        assert torch.equal(p.a, m.a) and torch.equal(p.b, m.b)
        assert base <= p.a.data_ptr() < end and base <= p.b.data_ptr() < end
    # The host holds the weights once: the same bytes as before, counted once.
    assert packed.nbytes == adapter.nbytes == rows.numel() * 4
    assert pack_adapter(packed, layout) is packed  # already packed for this layout
    assert dataclasses.replace(packed, name="other").packed is packed.packed  # same modules: rows kept
    # Other modules: the rows no longer hold its weights, so they are dropped (and not counted).
    swapped = dataclasses.replace(packed, modules=adapter.modules)
    assert swapped.packed is None and swapped.nbytes == adapter.nbytes


def test_a_pool_with_another_layout_packs_the_modules_itself():
    rng = random.Random()
    adapter = random_adapter(TINY, rng, ranks=(1, 16))
    packed = pack_adapter(adapter, RowLayout.for_model(TINY, torch.float32))
    for dtype, shapes in ((torch.bfloat16, True), (torch.float32, False)):
        g = small_pager(300, TINY, dtype).geometry
        if not shapes:  # a geometry built without the model's shapes: another layout too
            g = dataclasses.replace(g, module_shapes=None)
        plain, other = UnifiedPager(g), UnifiedPager(g)
        assert other.geometry.row_layout != packed.packed.layout
        assert plan_adapter(other.geometry, packed).packed_rows is None
        other.load_adapter("k", packed)
        plain.load_adapter("k", adapter)
        assert torch.equal(_bits(other.pool.tensor), _bits(plain.pool.tensor))


def test_packing_checks_what_placement_checks():
    rng = random.Random()
    # Another model with the same D and dtype but other MLP shapes: the pager refuses the adapter.
    other_model = model_config(48, 3, 1, 16, 96, 3)
    adapter = random_adapter(other_model, rng, modules=["up_proj"])
    with pytest.raises(AdapterError, match="does not match the base model"):
        pack_adapter(adapter, RowLayout.for_model(TINY, torch.float32))
    packed = pack_adapter(adapter, RowLayout.for_model(other_model, torch.float32))
    pager = small_pager(300, TINY)
    with pytest.raises(AdapterError, match="does not match the base model"):
        pager.load_adapter("k", packed)  # another layout: checked like any unpacked adapter
    assert pager.stats().free_pages == 300
    deeper = random_adapter(model_config(48, 3, 1, 16, 80, 4), rng, layers=[3], modules=["q_proj"])
    with pytest.raises(AdapterError, match="layer 3 q_proj: layer out of range"):
        pack_adapter(deeper, RowLayout.for_model(TINY, torch.float32))  # TINY has 3 layers


def test_row_layout_depends_on_model_and_dtype_only():
    for cfg in (TINY, ODD, SMOLLM2):
        for dtype in (torch.float32, torch.bfloat16):
            layout = RowLayout.for_model(cfg, dtype)
            for block_size in (1, 4, 16):
                assert PoolGeometry.for_model(cfg, 64 << 20, dtype, block_size).row_layout == layout
    assert RowLayout.for_model(TINY, torch.float32) != RowLayout.for_model(TINY, torch.float16)


def test_adapter_num_pages_of_packed_adapters():
    rng = random.Random()
    for _ in range(10):
        adapter = random_adapter(ODD, rng, ranks=(1, 70))
        packed = pack_adapter(adapter, RowLayout.for_model(ODD, torch.float32))
        for block_size in (1, 2, 5):
            g = small_pager(10, ODD, torch.float32, block_size).geometry
            assert g.adapter_num_pages(packed) == g.adapter_num_pages(adapter)


def test_logical_to_physical_matches_the_formula():
    rng = np.random.default_rng()
    for _ in range(50):
        rpp = int(rng.integers(1, 20))
        pages = rng.permutation(200)[: int(rng.integers(1, 30))].astype(np.int64)
        total = len(pages) * rpp
        start = int(rng.integers(0, total))
        count = int(rng.integers(0, total - start + 1))
        want = [pages[r // rpp] * rpp + r % rpp for r in range(start, start + count)]
        got = logical_to_physical(pages, rpp, start, count)
        assert got.dtype == np.int64 and got.tolist() == want


@pytest.mark.parametrize("order", ["one run", "few runs", "scattered", "descending"])
def test_write_pages_by_runs_and_by_index_give_the_same_pages(order):
    # Both ways write_pages copies full pages (plain copies per run, or one indexed copy), and the
    # partial last page, against the reference.
    pager = small_pager(400, ODD)
    g = pager.geometry
    rpp = g.rows_per_page
    gen = torch.Generator().manual_seed(0)
    num_pages = 64
    rows = torch.randn(num_pages * rpp - rpp // 2, g.row_width, generator=gen)  # the last page half full
    rng = np.random.default_rng(0)
    pages = {
        "one run": np.arange(100, 100 + num_pages),
        "few runs": np.concatenate([np.arange(300, 340), np.arange(10, 34)]),
        "scattered": rng.permutation(400)[:num_pages],
        "descending": np.arange(200 + num_pages, 200, -1),
    }[order].astype(np.int64)
    pager.pool.tensor.fill_(float("nan"))
    expected = pager.pool.tensor.clone()
    _reference_write(expected, rows, pages.tolist(), rpp)
    write_pages(pager.pool, pages, rows)
    assert torch.equal(_bits(pager.pool.tensor), _bits(expected))
