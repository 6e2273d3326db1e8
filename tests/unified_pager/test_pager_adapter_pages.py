"""Adapter weights written into pool pages read back exactly through the residency's indices."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from loraplex.lora.types import MODULE_INDEX, TARGET_MODULES
from pager_testkit import ODD, TINY, random_adapter, small_pager


def _expected_physical(pages: list[int], rpp: int, start: int, count: int) -> list[int]:
    return [pages[r // rpp] * rpp + r % rpp for r in range(start, start + count)]


def _fragment(pager, rng: random.Random) -> None:
    """Leave KV scattered over the pool so adapters get non-contiguous, shuffled pages."""
    for i in range(12):
        pager.allocate_kv(("frag", i), rng.randint(1, 3 * pager.geometry.block_size))
    for i in rng.sample(range(12), 6):
        pager.free_kv(("frag", i))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cfg", [TINY, ODD], ids=["tiny", "odd"])
def test_weights_read_back_exactly_for_mixed_ranks(cfg, dtype):
    rng = random.Random()
    pager = small_pager(12000, cfg, dtype)
    g = pager.geometry
    _fragment(pager, rng)
    # Mark every KV page so that a stray adapter write would show.
    kv = pager.pool.kv_view()
    kv_pages = [p for s in range(12) if pager.kv_num_blocks(("frag", s))
                for p in pager.block_tables([("frag", s)]).unique().tolist()]
    kv[kv_pages] = 7.0

    rows = pager.pool.rows()
    residencies = []
    crossings = 0
    for k, ranks in enumerate([(1, 1), (1, 8), (9, 64), (65, 128), (128, 128)]):
        adapter = random_adapter(cfg, rng, ranks=ranks, name=f"a{k}")
        res = pager.load_adapter(("a", k), adapter, pin=True)  # pinned: later loads must not evict it
        assert res is not None
        pages = res.pages.tolist()
        assert res.num_pages == g.adapter_num_pages(adapter) == -(-res.num_rows // g.rows_per_page)
        assert (res.num_pages - 1) * g.rows_per_page < res.num_rows  # waste under one page
        assert res.nbytes == res.num_pages * g.page_bytes
        assert res.max_rank == adapter.max_rank
        for m in adapter.modules:
            key = (m.layer, MODULE_INDEX[m.module])
            s = res.slots[key]
            in_f, out_f = m.a.shape[1], m.b.shape[0]
            assert (s.layer, s.module, s.rank, s.in_features, s.out_features) == (m.layer, key[1], m.rank, in_f, out_f)
            assert s.scale == pytest.approx(m.scale)
            na, nb = m.rank * in_f // g.row_width, m.rank * out_f // g.row_width
            assert s.b_row == s.a_row + na
            # The same rows three ways: the cached index, physical_rows, and the formula.
            want_a = _expected_physical(pages, g.rows_per_page, s.a_row, na)
            want_b = _expected_physical(pages, g.rows_per_page, s.b_row, nb)
            assert res.a_index(*key).tolist() == res.physical_rows(s.a_row, na).tolist() == want_a
            assert res.b_index(*key).tolist() == res.physical_rows(s.b_row, nb).tolist() == want_b
            crossings += len({r // g.rows_per_page for r in want_a + want_b}) > 1
            at = rows[res.a_index(*key)].reshape(in_f, m.rank)  # A^T [in, r]
            bt = rows[res.b_index(*key)].reshape(m.rank, out_f)
            assert torch.equal(at, m.a.t().to(dtype))
            assert torch.equal(bt, m.b.t().to(dtype))
        residencies.append((res, adapter))
    assert crossings > 0  # some matrices straddle pages (and the pages are not contiguous)
    assert (kv[kv_pages] == 7.0).all()
    pager.check_integrity()
    # Earlier adapters survive later loads untouched.
    for res, adapter in residencies:
        for m in adapter.modules:
            key = (m.layer, MODULE_INDEX[m.module])
            assert torch.equal(rows[res.a_index(*key)].reshape(-1, m.rank), m.a.t().to(dtype))


def test_packing_order_layout_and_scales():
    rng = random.Random()
    pager = small_pager(500)
    adapter = random_adapter(TINY, rng, ranks=(1, 32), layers=[0, 2], modules=["v_proj", "q_proj", "down_proj"])
    res = pager.load_adapter("k", adapter)
    d = pager.geometry.row_width
    # Slots are packed back to back in (layer, TARGET_MODULES) order: q before v before down.
    ordered = sorted(res.slots.values(), key=lambda s: (s.layer, s.module))
    row = 0
    for s in ordered:
        assert s.a_row == row
        row = s.b_row + s.rank * s.out_features // d
    assert row == res.num_rows
    assert res.layout.shape == (TINY.num_layers, len(TARGET_MODULES), 3) and res.layout.dtype == torch.int32
    assert res.scales.shape == (TINY.num_layers, len(TARGET_MODULES)) and res.scales.dtype == torch.float32
    for layer in range(TINY.num_layers):
        for module in range(len(TARGET_MODULES)):
            s = res.slots.get((layer, module))
            if s is None:
                assert res.layout[layer, module].tolist() == [0, 0, 0] and res.scales[layer, module] == 0
            else:
                assert res.layout[layer, module].tolist() == [s.rank, s.a_row, s.b_row]
                assert res.scales[layer, module].item() == pytest.approx(s.scale)
    assert res.pages.dtype == torch.int64 and res.pages.shape == (res.num_pages,)
    with pytest.raises(IndexError):
        res.physical_rows(res.num_rows - 1, 2)


def test_index_tensors_are_cached_not_recomputed():
    pager = small_pager(200)
    res = pager.load_adapter("k", random_adapter(TINY, random.Random(), modules=["q_proj", "up_proj"]))
    key = next(iter(res.slots))
    assert res.a_index(*key) is res.a_index(*key)
    assert res.b_index(*key) is res.b_index(*key)
    assert res.a_index(*key).dtype == torch.int64
    # Every per-slot index is a view of one row_index tensor (one allocation per adapter).
    assert res.a_index(*key).untyped_storage().data_ptr() == res.row_index.untyped_storage().data_ptr()


def test_lora_delta_from_pool_rows_matches_host_weights():
    # What the torch kernels compute, through the pool: delta = scale * (x @ A^T) @ B^T.
    rng = random.Random()
    pager = small_pager(600)
    _fragment(pager, rng)
    adapter = random_adapter(TINY, rng, ranks=(1, 24))
    res = pager.load_adapter("k", adapter)
    rows = pager.pool.rows()
    x_by_in = {}
    for m in adapter.modules:
        key = (m.layer, MODULE_INDEX[m.module])
        s = res.slots[key]
        x = x_by_in.setdefault(s.in_features, torch.randn(5, s.in_features))
        at = rows.index_select(0, res.a_index(*key)).view(-1, s.rank)  # [in, r]
        bt = rows.index_select(0, res.b_index(*key)).view(s.rank, -1)  # [r, out]
        got = s.scale * (x @ at) @ bt
        want = m.scale * (x @ m.a.t()) @ m.b.t()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # same math, other summation order


def test_block_tables_give_each_layer_its_own_page():
    pager = small_pager(100)
    g = pager.geometry
    assert pager.allocate_kv("s", 2 * g.block_size + 1)
    assert pager.allocate_kv("t", 1)
    bt = pager.block_tables(["s", "t"])
    assert bt.shape == (g.num_layers, 2, 3) and bt.dtype == torch.int32
    s_pages = bt[:, 0, :].flatten().tolist()
    assert len(set(s_pages)) == 3 * g.num_layers
    assert bt[:, 1, 1:].eq(0).all() and len(set(bt[:, 1, 0].tolist())) == g.num_layers
    assert not set(s_pages) & set(bt[:, 1, 0].tolist())
    # Writing K/V of token 5 of layer 1 through the table lands only in that page's slot.
    kv = pager.pool.kv_view()
    page, off = int(bt[1, 0, 5 // g.block_size]), 5 % g.block_size
    kv[page, 0, off] = 1.5
    assert np.count_nonzero(pager.pool.tensor.numpy()) == g.num_kv_heads * g.head_dim
    with pytest.raises(KeyError):
        pager.block_tables(["s", "nobody"])


def test_last_page_tail_is_zeroed():
    """Rows past an adapter's last row are zero, not garbage: the page becomes a KV block later."""
    import random

    from pager_testkit import TINY, random_adapter, small_pager

    pager = small_pager(400)
    pager.pool.tensor.fill_(float("nan"))
    res = pager.load_adapter("a", random_adapter(TINY, random.Random()))
    rows = pager.pool.rows()
    last = int(res.pages[-1])
    rpp = pager.geometry.rows_per_page
    tail = res.num_rows - (len(res.pages) - 1) * rpp
    assert torch.count_nonzero(rows[last * rpp + tail : (last + 1) * rpp]) == 0
    assert torch.isfinite(rows[last * rpp + tail : (last + 1) * rpp]).all()
