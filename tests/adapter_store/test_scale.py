"""Scale: 10,000 adapters registered and listed page by page (SQLite and PostgreSQL); 1,000 distinct
adapters served through a host cache that holds 100, with outputs equal to the adapters loaded
directly from their folders and the LRU behaviour a reference model predicts."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from adapter_files import write_peft_adapter
from engine_setup import assert_same_outputs, random_prompts, run, tiny_llm
from loraplex.adapter_store import AdapterCreate
from loraplex.adapter_store.engine_bridge import EngineAdapterBridge
from loraplex.lora.peft_loader import load_peft_adapter
from store_helpers import assert_same_adapter, folder_files, new_tenant

N_REGISTERED = 10_000
N_DISTINCT = 1_000
CACHE_ENTRIES = 100


@pytest.mark.slow
@pytest.mark.parametrize("db", ["sqlite", "postgresql"])
def test_ten_thousand_adapters_register_and_list_with_pagination(make_store, tiny_config, tmp_path, db):
    store = make_store(db=db)
    tenant = new_tenant(store)
    # A few real, validated uploads give the blobs; the 10,000 rows share them by content address
    # (so every row has its blob, as blob-before-row requires, without writing 10,000 files).
    seeds = [store.upload_path(tenant, f"seed{i}", write_peft_adapter(tmp_path / f"s{i}", tiny_config,
                                                                        r=random.choice([1, 2, 4]), readme=False))
             for i in range(8)]
    names = [f"ad-{i:05d}-{random.randrange(10**6):06d}" for i in range(N_REGISTERED - len(seeds))]
    random.shuffle(names)
    t0 = time.perf_counter()
    for start in range(0, len(names), 1000):
        batch = []
        for n in names[start:start + 1000]:
            s = random.choice(seeds)
            batch.append(AdapterCreate(tenant_id=tenant, name=n, base_model_fingerprint=s.base_model_fingerprint,
                                       rank=s.rank, alpha=s.alpha, target_modules=s.target_modules, dtype=s.dtype,
                                       size_bytes=s.size_bytes, sha256=s.sha256, storage_key=s.storage_key))
        store.registry.add_adapters(batch)
    register_s = time.perf_counter() - t0
    assert store.registry.count_adapters(tenant) == N_REGISTERED

    listed, cursor, page_times = [], None, []
    page_size = random.choice([100, 250, 500])
    while True:
        t = time.perf_counter()
        page = store.list_adapters(tenant, limit=page_size, cursor=cursor)
        page_times.append(time.perf_counter() - t)
        listed += [(a.name, a.version) for a in page.items]
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert len(listed) == N_REGISTERED and len(set(listed)) == N_REGISTERED
    assert listed == sorted(listed)
    assert len(page_times) == -(-N_REGISTERED // page_size)
    # Keyset pagination: the last pages cost about what the first do (no OFFSET scan).
    first, last = sorted(page_times[:5])[2], sorted(page_times[-5:])[2]
    assert last < 5 * first + 0.05, (first, last)
    print(f"\n{db}: registered {N_REGISTERED - len(seeds)} rows in {register_s:.2f}s; "
          f"{len(page_times)} pages of {page_size} listed in {sum(page_times):.2f}s")
    # Any of them resolves and is served from its (shared) blob.
    for name in random.sample(names, 5):
        assert store.get(store.resolve(tenant, name)).max_rank in (1, 2, 4)


@pytest.mark.slow
def test_thousand_adapters_through_a_cache_of_a_hundred(make_store, tiny_model_dir, tiny_config, tmp_path):
    rank = random.choice([1, 2, 4])  # one size for all, so that the byte budget holds exactly 100
    folders = [write_peft_adapter(tmp_path / f"a{i}", tiny_config, r=rank, readme=False) for i in range(N_DISTINCT)]
    probe = load_peft_adapter("probe", folders[0], tiny_config, 16)
    store = make_store(host_cache_bytes=CACHE_ENTRIES * probe.nbytes)
    tenant = new_tenant(store)
    with ThreadPoolExecutor(8) as pool:  # concurrent uploads, as many clients would do
        refs = list(pool.map(lambda i: store.upload(tenant, f"a{i:04d}", folder_files(folders[i])),
                             range(N_DISTINCT)))
    assert len({r.id for r in refs}) == N_DISTINCT

    llm = tiny_llm(tiny_model_dir)
    bridge = EngineAdapterBridge(llm.engine, store)
    cache = store.cache
    evicted: list[str] = []
    cache.add_eviction_listener(evicted.append)

    # Pass 1: every adapter once, in batches of requests through the engine. Every served adapter is
    # checked tensor for tensor against the engine's own folder loader (equal adapters give equal outputs),
    # and a random tenth of the batch also runs folder-loaded copies side by side for output parity.
    batch_size = 50
    for start in range(0, N_DISTINCT, batch_size):
        ids = list(range(start, start + batch_size))
        served = [bridge.prepare(refs[i]) for i in ids]
        direct_ids = random.sample(ids, batch_size // 10)
        direct = {i: load_peft_adapter(f"direct-{i}", folders[i], tiny_config, 16) for i in direct_ids}
        for i in ids:
            want = direct.get(i) or load_peft_adapter("x", folders[i], tiny_config, 16)
            assert_same_adapter(llm.engine.adapters.host(llm.engine.adapters.resolve(served[i - start])), want)
        for i, adapter in direct.items():
            llm.engine.add_adapter(f"direct-{i}", adapter)
        prompts = random_prompts(batch_size, tiny_config.vocab_size)
        twins = [prompts[i - start] for i in direct_ids]
        # One token: the prompt logits already cover every adapter module at every position, and the
        # torch attention reference costs a step per token on the CPU.
        outs = run(llm, prompts + twins, served + [f"direct-{i}" for i in direct_ids], max_tokens=1)
        assert_same_outputs([outs[i - start] for i in direct_ids], outs[batch_size:], where=f"batch {start}")
        for i in direct_ids:
            llm.unload_adapter(f"direct-{i}")
        assert len(cache.keys()) <= CACHE_ENTRIES

    s = cache.stats()
    assert (s.misses, s.loads, s.hits) == (N_DISTINCT, N_DISTINCT, 0)
    assert s.evictions == N_DISTINCT - CACHE_ENTRIES and s.entries == CACHE_ENTRIES
    assert evicted == [r.id for r in refs[:N_DISTINCT - CACHE_ENTRIES]]  # least recently used first
    assert cache.keys() == [r.id for r in refs[-CACHE_ENTRIES:]]
    bridge.sync()
    in_engine = [n for n in llm.engine.adapters.names() if n.startswith(f"{tenant}/")]
    assert len(in_engine) == CACHE_ENTRIES  # the engine dropped what the cache evicted

    # Pass 2: a skewed random trace; the cache must do exactly what a reference LRU does.
    model: OrderedDict[str, None] = OrderedDict((r.id, None) for r in refs[-CACHE_ENTRIES:])
    hot = random.sample(range(N_DISTINCT), 150)
    trace = [random.choice(hot) if random.random() < 0.8 else random.randrange(N_DISTINCT) for _ in range(400)]
    hits = misses = 0
    for i in trace:
        key = refs[i].id
        if key in model:
            hits += 1
            model.move_to_end(key)
        else:
            misses += 1
            model[key] = None
            if len(model) > CACHE_ENTRIES:
                model.popitem(last=False)
        bridge.prepare(refs[i])
    s2 = cache.stats()
    assert (s2.hits - s.hits, s2.misses - s.misses) == (hits, misses)
    assert cache.keys() == list(model)
    # A final mixed batch over the trace's adapters still matches the folders.
    sample = random.sample(trace, 20)
    served = [bridge.prepare(refs[i]) for i in sample]
    for i in set(sample):
        llm.engine.add_adapter(f"direct-{i}", load_peft_adapter(f"direct-{i}", folders[i], tiny_config, 16))
    prompts = random_prompts(20, tiny_config.vocab_size)
    outs = run(llm, prompts + prompts, served + [f"direct-{i}" for i in sample], max_tokens=4)
    assert_same_outputs(outs[:20], outs[20:], where="final batch")
    assert torch.equal(store.get(refs[sample[0]]).modules[0].a,
                       load_peft_adapter("x", folders[sample[0]], tiny_config, 16).modules[0].a)
