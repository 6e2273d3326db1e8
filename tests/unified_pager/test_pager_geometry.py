"""Geometry arithmetic: row width, page size, page counts for KV and adapters."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loraplex.errors import AdapterError, ConfigError
from loraplex.lora.types import TARGET_MODULES, LoraAdapter, LoraModuleWeights
from loraplex.unified_pager.adapter_pages import plan_adapter
from loraplex.unified_pager.geometry import PoolGeometry, row_width_for
from loraplex.unified_pager.pool import PagePool
from pager_testkit import ODD, SMOLLM2, TINY, geometry_with_pages, model_config, random_adapter


def _lora(cfg, rank, modules, layers, name="x"):
    mods = []
    for layer in layers:
        for m in modules:
            in_f, out_f = cfg.module_shape(m)
            mods.append(LoraModuleWeights(layer, m, rank, 2.0, torch.randn(rank, in_f), torch.randn(out_f, rank)))
    return LoraAdapter(name, tuple(mods), rank)


def test_smollm2_worked_example():
    # The numbers docs/PAGE_POOL.md walks through.
    g = PoolGeometry.for_model(SMOLLM2, 1 << 30, torch.bfloat16)
    assert row_width_for(SMOLLM2) == 64
    assert (g.row_width, g.rows_per_page, g.page_elems, g.page_bytes) == (64, 96, 6144, 12288)
    assert g.num_pages == (1 << 30) // 12288 == 87381
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.block_size) == (30, 3, 64, 16)
    assert [g.kv_pages_for_tokens(n) for n in (0, 1, 16, 17, 1000)] == [0, 30, 30, 60, 63 * 30]

    qv8 = _lora(SMOLLM2, 8, ["q_proj", "v_proj"], range(30))
    # q: A 8*576/64 = 72 rows, B^T 72 rows; v: A 72 rows, B^T 8*192/64 = 24 rows -> 240 per layer.
    assert g.adapter_num_rows(qv8) == 240 * 30 == 7200
    assert g.adapter_num_pages(qv8) == 75
    all16 = _lora(SMOLLM2, 16, list(TARGET_MODULES), range(30))
    assert g.adapter_num_rows(all16) == 2544 * 30 == 76320
    assert g.adapter_num_pages(all16) == 795
    # A page holds exactly the adapter's bytes when rows divide evenly: no padding to a max rank.
    assert g.adapter_num_pages(all16) * g.page_bytes == sum(m.a.numel() + m.b.numel() for m in all16.modules) * 2
    slots = plan_adapter(g, qv8).slots  # q = module 0, v = module 2
    assert [(slots[(0, 0)].a_row, slots[(0, 0)].b_row), (slots[(0, 2)].a_row, slots[(0, 2)].b_row)] == [(0, 72), (144, 216)]
    assert slots[(1, 0)].a_row == 240
    r1 = _lora(SMOLLM2, 1, ["q_proj"], [0])
    assert (g.adapter_num_rows(r1), g.adapter_num_pages(r1)) == (18, 1)


@pytest.mark.parametrize(
    "cfg, d",
    [(TINY, 16), (ODD, 8), (model_config(72, 3, 1, 24, 180, 2), 12), (model_config(80, 5, 1, 16, 144, 2), 16)],
)
def test_row_width_for_shapes_that_are_not_powers_of_two(cfg, d):
    assert row_width_for(cfg) == d
    g = geometry_with_pages(cfg, 10, torch.float16, block_size=3)
    assert g.row_width == d and g.rows_per_page * d == g.page_elems == 2 * 3 * cfg.kv_size
    pool = PagePool(g)
    assert pool.tensor.shape == (10, g.page_elems) and pool.tensor.dtype == torch.float16
    assert pool.rows().shape == (10 * g.rows_per_page, d)
    assert pool.kv_view().shape == (10, 2, 3, cfg.num_kv_heads, cfg.head_dim)
    # Both views alias the one tensor.
    assert pool.rows().data_ptr() == pool.kv_view().data_ptr() == pool.tensor.data_ptr()


@settings(max_examples=60, deadline=None)
@given(
    head_dim=st.sampled_from([8, 12, 16, 24, 40, 64, 80, 96, 128]),
    heads=st.integers(1, 12),
    group=st.integers(1, 4),
    hidden_mult=st.integers(1, 12),
    inter_mult=st.integers(1, 40),
    layers=st.integers(1, 6),
    block_size=st.integers(1, 32),
    extra_pages=st.integers(0, 50),
    seed=st.integers(0, 2**31),
)
def test_geometry_properties_on_random_shapes(head_dim, heads, group, hidden_mult, inter_mult, layers, block_size, extra_pages, seed):
    kv_heads = max(1, heads // group)
    heads = kv_heads * group
    hidden = heads * head_dim if hidden_mult == 1 else 8 * hidden_mult * 3
    inter = 8 * inter_mult
    cfg = model_config(hidden, heads, kv_heads, head_dim, inter, layers)
    page_bytes = 2 * block_size * cfg.kv_size * 4
    pool_bytes = (layers + extra_pages) * page_bytes + page_bytes - 1  # a partial page is not a page
    g = PoolGeometry.for_model(cfg, pool_bytes, torch.float32, block_size)
    d = g.row_width
    assert g.num_pages == layers + extra_pages
    for width in (hidden, cfg.q_size, cfg.kv_size, inter, head_dim, g.page_elems):
        assert width % d == 0
    assert g.rows_per_page * d == g.page_elems
    adapter = random_adapter(cfg, random.Random(seed), ranks=(1, 9))
    rows = g.adapter_num_rows(adapter)
    assert rows * d == sum(m.a.numel() + m.b.numel() for m in adapter.modules)
    assert g.adapter_num_pages(adapter) == math.ceil(rows / g.rows_per_page)
    assert (g.adapter_num_pages(adapter) - 1) * g.rows_per_page < rows  # waste under one page
    n = random.Random(seed).randint(0, 500)
    assert g.kv_pages_for_tokens(n) == math.ceil(n / block_size) * layers


def test_budget_smaller_than_one_block_for_every_layer_is_refused():
    page_bytes = 2 * 16 * SMOLLM2.kv_size * 2
    assert PoolGeometry.for_model(SMOLLM2, 30 * page_bytes, torch.bfloat16).num_pages == 30
    with pytest.raises(ConfigError, match="30 pages"):
        PoolGeometry.for_model(SMOLLM2, 30 * page_bytes - 1, torch.bfloat16)
    with pytest.raises(ConfigError):
        PoolGeometry.for_model(SMOLLM2, 1 << 30, torch.bfloat16, block_size=0)
    with pytest.raises(ConfigError):
        PoolGeometry.for_model(SMOLLM2, 1 << 30, torch.int8)


def test_geometry_that_does_not_hold_a_kv_block_is_refused():
    with pytest.raises(ConfigError, match="KV block"):
        PoolGeometry(num_pages=4, row_width=16, rows_per_page=3, block_size=4, num_layers=2,
                     num_kv_heads=1, head_dim=16, dtype=torch.float32)


def test_adapters_that_do_not_match_the_model_are_refused():
    g = geometry_with_pages(TINY, 50)
    good = _lora(TINY, 4, ["q_proj"], [0])
    assert g.adapter_num_rows(good) == 4 * (48 + 48) // 16
    other_model = _lora(ODD, 4, ["q_proj"], [0])
    with pytest.raises(AdapterError, match="base model"):
        g.adapter_num_rows(other_model)
    with pytest.raises(AdapterError, match="layer out of range"):
        g.adapter_num_rows(_lora(TINY, 4, ["q_proj"], [TINY.num_layers]))
    bad_rank = LoraModuleWeights(0, "q_proj", 4, 1.0, torch.randn(3, 48), torch.randn(48, 4))
    with pytest.raises(AdapterError, match="rank 4"):
        g.adapter_num_rows(LoraAdapter("x", (bad_rank,), 4))
    unknown = LoraModuleWeights(0, "lm_head", 4, 1.0, torch.randn(4, 48), torch.randn(48, 4))
    with pytest.raises(AdapterError, match="unknown target module"):
        g.adapter_num_rows(LoraAdapter("x", (unknown,), 4))


def test_public_names_import_from_the_package_root():
    # The scheduler and kernels import these from loraplex.unified_pager itself. If this fails with
    # "unknown location", the editable install is stale (its finder maps the folder as a namespace
    # package): reinstall with `pip install --no-deps --no-build-isolation -e .`.
    import loraplex.unified_pager as up

    for name in ("PoolGeometry", "ModuleSlot", "AdapterResidency", "UnifiedPager", "PoolStats", "PagePool"):
        assert hasattr(up, name), f"loraplex.unified_pager does not export {name} (package __init__ not run?)"
