"""The store hands the engine adapters already packed in pool-row layout: same weights, bytes counted
once, and placed by the engine's pool exactly as the same adapter read from its folder."""

from __future__ import annotations

import torch

from adapter_files import write_peft_adapter
from engine_setup import tiny_llm
from loraplex.lora.peft_loader import load_peft_adapter
from loraplex.unified_pager import RowLayout, UnifiedPager
from loraplex.unified_pager.adapter_pages import plan_adapter
from store_helpers import assert_same_adapter, new_tenant

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_loaded_adapters_are_packed_for_the_engines_pool(make_store, tiny_config, tiny_model_dir, tmp_path):
    store = make_store()
    tenant = new_tenant(store)
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=8, targets=ALL)
    ref = store.upload_path(tenant, "a", folder)
    adapter = store.get(ref)
    packed = adapter.packed
    assert packed is not None and packed.layout == RowLayout.for_model(tiny_config, torch.float32)
    assert store.cache.last_timings.pack_s > 0
    # The same weights as the folder gives, held once: the host cache counts the packed rows.
    direct = load_peft_adapter("a", folder, tiny_config, 16)
    assert_same_adapter(adapter, direct)
    assert adapter.nbytes == direct.nbytes == packed.rows.numel() * packed.rows.element_size()
    assert store.cache_stats().bytes == adapter.nbytes

    # The engine's pool has this layout (whatever its page size), so placement copies the rows.
    geometry = tiny_llm(tiny_model_dir).engine.pager.geometry
    assert geometry.row_layout == packed.layout
    assert plan_adapter(geometry, adapter).packed_rows is packed.rows
    from_store, from_folder = UnifiedPager(geometry), UnifiedPager(geometry)
    res = from_store.load_adapter("k", adapter)
    assert res is not None and from_folder.load_adapter("k", direct) is not None
    assert torch.equal(from_store.pool.tensor, from_folder.pool.tensor)
    assert from_store.pool.rows()[res.row_index].abs().sum() > 0
