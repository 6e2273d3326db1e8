"""registry -> host cache -> engine: store-served adapters give the same outputs as adapters loaded from
their folders, re-uploads switch versions, tenants stay apart, and host-cache evictions reach the engine."""

from __future__ import annotations

import pytest
import torch

from adapter_files import write_peft_adapter
from engine_setup import assert_same_outputs, random_prompts, run, tiny_llm
from loraplex.adapter_store.engine_bridge import EngineAdapterBridge, engine_adapter_name
from loraplex.errors import AdapterNotFoundError, ConfigError
from store_helpers import new_tenant

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return tiny_llm(tiny_model_dir)


def test_store_served_adapters_match_folder_loaded_ones(llm, make_store, tiny_config, tmp_path):
    store = make_store()
    bridge = EngineAdapterBridge(llm.engine, store)
    tenant = new_tenant(store)
    folders = [write_peft_adapter(tmp_path / f"a{i}", tiny_config, r=r, targets=t)
               for i, (r, t) in enumerate([(1, ("q_proj",)), (4, ALL), (8, ("v_proj", "down_proj"))])]
    names = [bridge.prepare(store.upload_path(tenant, f"bot{i}", f)) for i, f in enumerate(folders)]
    for i, f in enumerate(folders):
        llm.load_adapter(f"direct-{i}", f)
    prompts = random_prompts(6, tiny_config.vocab_size)
    order = [0, 1, 2, 2, 1, 0]
    served = run(llm, prompts, [names[i] for i in order])
    direct = run(llm, prompts, [f"direct-{i}" for i in order])
    assert_same_outputs(served, direct)
    base = run(llm, prompts, [None] * 6)
    assert not any(torch.allclose(s[1], b[1]) for s, b in zip(served, base, strict=True))  # the adapters do something
    for i in range(3):
        llm.unload_adapter(f"direct-{i}")


def test_reupload_switches_the_engine_to_the_new_version(llm, make_store, tiny_config, tmp_path):
    store = make_store()
    bridge = EngineAdapterBridge(llm.engine, store)
    tenant = new_tenant(store)
    v1_dir, v2_dir = (write_peft_adapter(tmp_path / n, tiny_config, r=2) for n in ("v1", "v2"))
    v1 = store.upload_path(tenant, "bot", v1_dir)
    name = bridge.prepare_by_name(tenant, "bot")
    prompts = random_prompts(2, tiny_config.vocab_size)
    first = run(llm, prompts, [name, name])
    v2 = store.upload_path(tenant, "bot", v2_dir)
    assert bridge.prepare_by_name(tenant, "bot") == name  # same engine name ...
    assert llm.engine.adapters.resolve(name).version == v2.id != v1.id  # ... new version key
    llm.load_adapter("direct-v2", v2_dir)
    assert_same_outputs(run(llm, prompts, [name, name]), run(llm, prompts, ["direct-v2"] * 2))
    assert not torch.allclose(first[0][1], run(llm, prompts, [name, name])[0][1])
    llm.unload_adapter("direct-v2")


def test_tenants_get_separate_engine_names(llm, make_store, tiny_config, tmp_path):
    store = make_store()
    bridge = EngineAdapterBridge(llm.engine, store)
    a, b = new_tenant(store), new_tenant(store)
    ra = store.upload_path(a, "bot", write_peft_adapter(tmp_path / "a", tiny_config, r=2))
    rb = store.upload_path(b, "bot", write_peft_adapter(tmp_path / "b", tiny_config, r=2))
    na, nb = bridge.prepare(ra), bridge.prepare(rb)
    assert na == engine_adapter_name(ra) != nb == engine_adapter_name(rb)
    prompts = random_prompts(1, tiny_config.vocab_size) * 2
    out = run(llm, prompts, [na, nb])
    assert not torch.allclose(out[0][1], out[1][1])


def _five_adapters_cache_of_two(make_store, tiny_config, tmp_path):
    """A store with five rank-2 adapters of one tenant uploaded and a host cache that holds two of them (empty
    now): (store, tenant, refs, one adapter's bytes)."""
    store = make_store()
    tenant = new_tenant(store)
    refs = [store.upload_path(tenant, f"e{i}", write_peft_adapter(tmp_path / f"e{i}", tiny_config, r=2))
            for i in range(5)]
    size = store.get(refs[0]).nbytes
    store.cache.invalidate(refs[0].id)
    store.cache.budget_bytes = 2 * size
    return store, tenant, refs, size


def test_host_cache_evictions_drop_engine_copies(llm, make_store, tiny_config, tmp_path):
    store, tenant, refs, _ = _five_adapters_cache_of_two(make_store, tiny_config, tmp_path)
    bridge = EngineAdapterBridge(llm.engine, store)
    names = [bridge.prepare(r) for r in refs]
    bridge.sync()
    held = {n for n in llm.engine.adapters.names() if n.startswith(tenant)}
    assert held == set(names[-2:])
    # An evicted adapter comes back on the next prepare, through the store.
    again = bridge.prepare(refs[0])
    assert llm.engine.adapters.resolve(again).version == refs[0].id
    prompts = random_prompts(1, tiny_config.vocab_size)
    assert run(llm, prompts, [again])[0][0]


def test_bridge_refuses_mismatched_settings(llm, make_store):
    with pytest.raises(ConfigError, match="dtype"):
        EngineAdapterBridge(llm.engine, make_store(dtype="float16"))
    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineAdapterBridge(llm.engine, make_store(max_lora_rank=64))


def test_the_engine_still_loads_folders_without_any_database(tiny_model_dir, tiny_config, tmp_path):
    folder = write_peft_adapter(tmp_path / "plain", tiny_config, r=2)
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("plain", folder)
    assert run(llm, random_prompts(1, tiny_config.vocab_size), ["plain"])[0][0]


def test_deleted_adapters_leave_the_engine_but_queued_requests_finish(llm, make_store, tiny_config, tmp_path):
    store = make_store()
    bridge = EngineAdapterBridge(llm.engine, store)
    tenant = new_tenant(store)
    ref = store.upload_path(tenant, "doomed", write_peft_adapter(tmp_path / "d", tiny_config, r=2))
    name = bridge.prepare(ref)
    assert store.registry.get_adapter(ref.id).last_used_at is not None  # set when loaded into host RAM
    from loraplex.engine import SamplingParams

    # ignore_eos: a sampled end token would finish the request early and the length checks below would flake.
    req = llm.engine.add_request(random_prompts(1, tiny_config.vocab_size)[0],
                                 SamplingParams(max_tokens=2, ignore_eos=True), name)
    store.delete(tenant, "doomed")
    bridge.forget(tenant, "doomed")
    assert name not in llm.engine.adapters.names() and ref.id not in store.cache
    finished = []
    while llm.engine.has_unfinished():
        finished += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in finished] == [req.request_id] and len(finished[0].token_ids) == 2
    with pytest.raises(AdapterNotFoundError):
        store.resolve(tenant, "doomed")


def test_adapters_evicted_before_their_install_leave_the_engine_after_their_requests(
        llm, make_store, tiny_config, tmp_path):
    # The server's path: every request's adapter is prefetched on arrival and installed later, on the engine
    # thread. A burst of more adapters than the host cache holds evicts the first ones before they are
    # installed; the engine must not keep those copies outside the cache's budget once their requests end.
    store, tenant, refs, size = _five_adapters_cache_of_two(make_store, tiny_config, tmp_path)
    bridge = EngineAdapterBridge(llm.engine, store)
    # One after another: with the store's two prefetch threads, which loads finish last (and stay) would vary.
    decoded = [bridge.prefetch(r).result() for r in refs]
    assert [r.id in store.cache for r in refs] == [False, False, False, True, True]
    from loraplex.engine import SamplingParams

    prompts = random_prompts(5, tiny_config.vocab_size)
    reqs = [llm.engine.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True), bridge.install(r, a))
            for p, r, a in zip(prompts, refs, decoded, strict=True)]
    bridge.sync()
    held = {n for n in llm.engine.adapters.names() if n.startswith(tenant)}
    assert held == {engine_adapter_name(r) for r in refs[-2:]}
    finished = []
    while llm.engine.has_unfinished():
        finished += [o for o in llm.engine.step() if o.finished]
    assert sorted(o.request_id for o in finished) == sorted(r.request_id for r in reqs)
    assert all(len(o.token_ids) == 3 for o in finished)  # the dropped copies still served their requests
    # Their host copies are gone from the engine: only the cached two are held, in the table and the pool.
    versions = {k.version for k in llm.engine.adapters._host}
    assert not versions & {r.id for r in refs[:3]}
    # An adapter too large for the cache is served, then dropped the same way.
    store.cache.budget_bytes = size // 2
    big = store.upload_path(tenant, "big", write_peft_adapter(tmp_path / "big", tiny_config, r=2))
    name = bridge.install(big, bridge.prefetch(big).result())
    req = llm.engine.add_request(prompts[0], SamplingParams(max_tokens=2, ignore_eos=True), name)
    bridge.sync()
    assert name not in llm.engine.adapters.names()
    out = []
    while llm.engine.has_unfinished():
        out += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in out] == [req.request_id] and len(out[0].token_ids) == 2
    assert big.id not in {k.version for k in llm.engine.adapters._host}
