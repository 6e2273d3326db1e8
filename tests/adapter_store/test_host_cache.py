"""The host-RAM cache: byte-budgeted LRU by version id, single-flight loads, prefetch, counters."""

from __future__ import annotations

import random
import threading
from collections import OrderedDict

import pytest
import torch

from adapter_files import write_peft_adapter
from loraplex.adapter_store import AdapterUnavailableError, HostCache
from store_helpers import new_tenant


@pytest.fixture
def store(make_store):
    return make_store()


def upload_many(store, tiny_config, tmp_path, n: int, ranks=(2,)):
    tenant = new_tenant(store)
    refs = []
    for i in range(n):
        folder = write_peft_adapter(tmp_path / f"a{i}", tiny_config, r=random.choice(ranks), readme=False)
        refs.append(store.upload_path(tenant, f"a{i}", folder))
    return refs


def test_lru_by_bytes_with_counters(store, tiny_config, tmp_path):
    refs = upload_many(store, tiny_config, tmp_path, 4)
    size = store.get(refs[0]).nbytes
    cache = HostCache(3 * size, store.loader.load)
    evicted = []
    cache.add_eviction_listener(evicted.append)
    for r in refs[:3]:
        cache.get(r)
    cache.get(refs[0])  # refs[1] is now least recently used
    cache.get(refs[3])
    assert evicted == [refs[1].id]
    assert cache.keys() == [refs[2].id, refs[0].id, refs[3].id]
    s = cache.stats()
    assert (s.hits, s.misses, s.loads, s.evictions, s.entries, s.bytes) == (1, 4, 4, 1, 3, 3 * size)
    assert s.load_seconds > 0 and cache.last_timings.nbytes == refs[3].size_bytes
    assert cache.invalidate(refs[0].id) and evicted[-1] == refs[0].id
    cache.close()


def test_concurrent_gets_share_one_load(store, tiny_config, tmp_path):
    (ref,) = upload_many(store, tiny_config, tmp_path, 1)
    gate, calls = threading.Event(), []

    def gated_load(r):
        calls.append(r.id)
        gate.wait(10)
        return store.loader.load(r)

    cache = HostCache(1 << 30, gated_load)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.get(ref))) for _ in range(8)]
    for t in threads:
        t.start()
    while cache.stats().joined < 7:  # every other caller is waiting on the first one's load
        threading.Event().wait(0.01)
    gate.set()
    for t in threads:
        t.join()
    assert calls == [ref.id]
    assert len(results) == 8 and all(r is results[0] for r in results)
    s = cache.stats()
    assert (s.misses, s.joined, s.loads) == (1, 7, 1)
    cache.close()


def test_prefetch_overlaps_and_get_joins_it(store, tiny_config, tmp_path):
    (ref,) = upload_many(store, tiny_config, tmp_path, 1)
    gate = threading.Event()
    cache = HostCache(1 << 30, lambda r: (gate.wait(10), store.loader.load(r))[1])
    fut = cache.prefetch(ref)
    assert not fut.done()
    again = cache.prefetch(ref)
    assert again is fut  # single flight for prefetches too
    gate.set()
    adapter = cache.get(ref)
    assert fut.result() is adapter
    done = cache.prefetch(ref)
    assert done.done() and done.result() is adapter
    s = cache.stats()
    assert s.loads == 1 and s.misses == 1 and s.hits == 1
    cache.close()


def test_failed_loads_reach_every_waiter_and_are_not_cached(store, tiny_config, tmp_path):
    (ref,) = upload_many(store, tiny_config, tmp_path, 1)
    saved = store.blobs.objects.get(ref.storage_key)
    store.blobs.objects.delete(ref.storage_key)
    cache = store.cache
    fut = cache.prefetch(ref)
    with pytest.raises(AdapterUnavailableError, match="missing"):
        fut.result()
    assert ref.id not in cache and cache.stats().load_failures == 1
    store.blobs.objects.put(ref.storage_key, saved)
    store.registry.mark_ready(ref.id)
    assert cache.get(ref).max_rank == 2  # retried, not a cached failure


def test_adapters_larger_than_the_budget_are_served_but_not_kept(store, tiny_config, tmp_path):
    (ref,) = upload_many(store, tiny_config, tmp_path, 1)
    cache = HostCache(10, store.loader.load)
    assert cache.get(ref).max_rank == 2
    s = cache.stats()
    assert (s.oversize, s.entries, s.bytes) == (1, 0, 0)
    cache.close()


def test_random_operations_match_a_reference_lru(store, tiny_config, tmp_path):
    refs = upload_many(store, tiny_config, tmp_path, 12, ranks=(1, 2, 4, 8))
    sizes = {r.id: store.get(r).nbytes for r in refs}
    budget = int(sum(sizes.values()) * random.uniform(0.2, 0.6))
    cache = HostCache(budget, store.loader.load)
    model: OrderedDict[str, int] = OrderedDict()
    hits = misses = evictions = 0
    for _ in range(300):
        r = random.choice(refs)
        if r.id in model:
            hits += 1
            model.move_to_end(r.id)
        elif sizes[r.id] > budget:
            misses += 1  # served, not kept
        else:
            misses += 1
            model[r.id] = sizes[r.id]
            while sum(model.values()) > budget:
                model.popitem(last=False)
                evictions += 1
        cache.get(r)
        assert cache.keys() == list(model)
    s = cache.stats()
    assert (s.hits, s.misses, s.evictions, s.bytes) == (hits, misses, evictions, sum(model.values()))
    assert s.bytes <= budget
    cache.close()


def test_closing_fails_waiting_prefetches_instead_of_hanging(store, tiny_config, tmp_path):
    refs = upload_many(store, tiny_config, tmp_path, 3)
    gate = threading.Event()
    cache = HostCache(1 << 30, lambda r: (gate.wait(10), store.loader.load(r))[1], prefetch_workers=1)
    futures = [cache.prefetch(r) for r in refs]  # one runs, two wait in the queue
    closer = threading.Thread(target=cache.close)
    closer.start()
    gate.set()
    closer.join(10)
    assert futures[0].result().max_rank == 2
    for fut in futures[1:]:
        with pytest.raises(Exception, match="closed"):
            fut.result(timeout=10)


def test_pinned_memory_is_refused_without_cuda(make_store, tiny_config, tmp_path):
    import torch

    if torch.cuda.is_available():  # page-locked host copies, ready for fast copies to the GPU
        store = make_store(pin_memory=True)
        (ref,) = upload_many(store, tiny_config, tmp_path, 1)
        assert all(m.a.is_pinned() and m.b.is_pinned() for m in store.get(ref).modules)
        return
    with pytest.raises(Exception, match="pin_memory=True needs a CUDA device"):
        make_store(pin_memory=True)


def test_prefetch_threads_run_their_torch_work_alone(store, tiny_config, tmp_path):
    """Prefetch loads take one thread (kernels/cpu_threads.py: a team of their own would slow every step
    of a CPU engine beside them); the caller's team size is not touched."""
    (ref,) = upload_many(store, tiny_config, tmp_path, 1)
    seen = []

    def observed_load(r):
        seen.append(torch.get_num_threads())
        return store.loader.load(r)

    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cache = HostCache(1 << 30, observed_load)
        adapter = cache.prefetch(ref).result(timeout=30)
        assert seen == [1] and torch.get_num_threads() == 2
        assert adapter.nbytes == store.get(ref).nbytes
        cache.close()
    finally:
        torch.set_num_threads(n)
