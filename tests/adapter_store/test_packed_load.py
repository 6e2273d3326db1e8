"""The store hands the engine adapters already packed in pool-row layout: same weights, bytes counted
once, and placed by the engine's pool exactly as the same adapter read from its folder. A folder read
straight into packed rows (load_packed_folder) keeps every refusal of the folder loader."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapter_files import write_peft_adapter
from engine_setup import tiny_llm
from loraplex.errors import AdapterError
from loraplex.lora.peft_loader import WEIGHTS_FILE, load_peft_adapter
from loraplex.unified_pager import RowLayout, UnifiedPager, load_packed_folder, pack_adapter
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


def test_a_folder_loaded_packed_equals_load_then_pack(tiny_config, tmp_path):
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=8, targets=ALL)
    layout = RowLayout.for_model(tiny_config, torch.float32)
    got = load_packed_folder("a", folder, tiny_config, 16, layout)
    want = pack_adapter(load_peft_adapter("a", folder, tiny_config, 16), layout)
    assert torch.equal(got.packed.rows, want.packed.rows)
    assert_same_adapter(got, want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_folder_loaded_packed_refuses_non_finite_weights(tiny_config, tmp_path, bad):
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=8, targets=ALL)
    weights = load_file(folder / WEIGHTS_FILE)
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    t = weights[key].clone()
    t.view(-1)[int(torch.randint(t.numel(), ()))] = bad
    save_file({**weights, key: t}, folder / WEIGHTS_FILE)
    layout = RowLayout.for_model(tiny_config, torch.float32)
    with pytest.raises(AdapterError, match=r"'a'.*model\.layers\.1\.mlp\.up_proj lora_B contains NaN or Inf"):
        load_packed_folder("a", folder, tiny_config, 16, layout)
    # A cast to a narrower dtype is still checked for overflow, as load_peft_adapter does.
    save_file({**weights, key: weights[key] * 1e6}, folder / WEIGHTS_FILE)
    with pytest.raises(AdapterError, match="too large for torch.float16"):
        load_packed_folder("a", folder, tiny_config, 16, RowLayout.for_model(tiny_config, torch.float16))


def test_the_engine_packs_a_folder_as_it_loads_it(tiny_config, tiny_model_dir, tmp_path):
    """EngineCore.load_adapter packs at load time, so that the first step using the adapter places it with
    page copies of these rows instead of packing it then; the weights are the folder's."""
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=8, targets=ALL)
    engine = tiny_llm(tiny_model_dir).engine
    key = engine.load_adapter("a", folder)
    adapter = engine.adapters.host(key)
    assert adapter.packed is not None and adapter.packed.layout == engine.pager.geometry.row_layout
    assert plan_adapter(engine.pager.geometry, adapter).packed_rows is adapter.packed.rows
    assert_same_adapter(adapter, load_peft_adapter("a", folder, tiny_config, 16))
    # A second folder of the same shape is packed by the plan the first taught (pack_plan.py).
    second = write_peft_adapter(tmp_path / "b", tiny_config, r=8, targets=ALL)
    got = engine.adapters.host(engine.load_adapter("b", second))
    assert engine.pack_plans.hits == 1
    assert_same_adapter(got, load_peft_adapter("b", second, tiny_config, 16))


@pytest.mark.parametrize("objects", ["local", "s3"])
def test_blobs_of_one_shape_are_packed_by_a_plan(make_store, tiny_config, tmp_path, objects):
    """The second blob of a shape skips the decode (the loader's plan packs it from the fetched bytes,
    a bytearray from the local folder, bytes from S3) and holds the folder's weights, as the first does."""
    store = make_store(objects=objects)
    tenant = new_tenant(store)
    folders = [write_peft_adapter(tmp_path / f"a{i}", tiny_config, r=8, targets=ALL) for i in range(3)]
    folders.append(write_peft_adapter(tmp_path / "other", tiny_config, r=4, targets=("q_proj",)))
    layout = RowLayout.for_model(tiny_config, torch.float32)
    for i, folder in enumerate(folders):
        adapter = store.get(store.upload_path(tenant, f"a{i}", folder))
        want = load_packed_folder(f"a{i}", folder, tiny_config, 16, layout)
        assert torch.equal(adapter.packed.rows, want.packed.rows)
        assert_same_adapter(adapter, want)
        assert adapter.config == want.config and adapter.packed.modules is adapter.modules
        timings = store.cache.last_timings
        assert (timings.decode_s == 0) == (i in (1, 2))  # planned: no decode; the first of a shape decodes
    assert (store.loader.plans.hits, len(store.loader.plans)) == (2, 2)
