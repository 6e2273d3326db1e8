"""LoraplexSystem fed as the server feeds adapters (systems.AdapterFeed): loads run off the engine thread,
requests wait outside the engine until their adapter is decoded, and nothing is lost or changed by it."""

from __future__ import annotations

import random
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from e2e.systems import AdapterFeed, LoraplexSystem  # noqa: E402
from e2e.workload import BenchRequest, write_random_adapter  # noqa: E402
from factories import make_tiny_model  # noqa: E402
from loraplex.config import EngineConfig  # noqa: E402
from loraplex.engine import EngineCore, SamplingParams  # noqa: E402
from loraplex.models.config import load_model_config  # noqa: E402
from loraplex.unified_pager import load_packed_folder  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("feed-llama"), "llama", seed=5)
    cfg = load_model_config(model)
    root = tmp_path_factory.mktemp("feed-adapters")
    folders = {f"a{i}": write_random_adapter(root / f"a{i}", cfg, 4 + 4 * (i % 2), seed=i) for i in range(4)}
    return model, folders


def _engine(model: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), dtype="float32", device="cpu", pool_bytes=8 << 20,
                                   max_lora_rank=16, kernels="torch"))


def _requests(vocab: int, arrivals: list[float]) -> list[BenchRequest]:
    rng = random.Random()  # fresh prompts each run: the check is that both ways agree
    names = ["a0", "a1", "a2", "a3", None]
    return [BenchRequest(f"r{i}", t, tuple(rng.randrange(3, vocab) for _ in range(rng.randint(3, 12))),
                         names[i % len(names)], rng.randint(1, 5), 1.0) for i, t in enumerate(arrivals)]


class SlowFeed:
    """Loads each adapter folder on a worker thread after a delay, counting which thread installs."""

    def __init__(self, engine: EngineCore, folders: dict[str, Path], delay_s: float, fail: str | None = None):
        self.engine, self.folders, self.delay_s, self.fail = engine, folders, delay_s, fail
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.install_threads: set[int] = set()
        self.load_threads: set[int] = set()

    def prefetch(self, name: str) -> Future:
        def load():
            self.load_threads.add(threading.get_ident())
            time.sleep(self.delay_s)
            if name == self.fail:
                raise OSError(f"cannot read adapter {name}")
            e = self.engine
            return load_packed_folder(name, self.folders[name], e.model_config, e.config.max_lora_rank,
                                      e.pager.geometry.row_layout)
        return self.pool.submit(load)

    def install(self, name: str, decoded) -> str:
        self.install_threads.add(threading.get_ident())
        self.engine.add_adapter(f"fed/{name}", decoded)
        return f"fed/{name}"

    def feed(self) -> AdapterFeed:
        return AdapterFeed(self.prefetch, self.install)


@pytest.mark.parametrize("arrivals", [[0.0] * 10, [0.0, 0.0, 0.05, 0.05, 0.1, 0.3, 0.3, 0.31, 0.5, 0.6]])
def test_fed_adapters_serve_every_request_as_preloaded_ones(setup, arrivals):
    model, folders = setup
    preloaded = _engine(model)
    for name, path in folders.items():
        preloaded.load_adapter(name, path)
    fed_engine = _engine(model)
    slow = SlowFeed(fed_engine, folders, delay_s=0.05)
    reqs = _requests(preloaded.model_config.vocab_size, arrivals)
    want = LoraplexSystem("preloaded", preloaded).serve(reqs)
    got = LoraplexSystem("fed", fed_engine, adapter_feed=slow.feed()).serve(reqs)
    assert [r.token_ids for r in got.records] == [r.token_ids for r in want.records]
    assert all(len(r.token_ids) == q.output_tokens == len(r.token_times) for r, q in zip(got.records, reqs))
    # Loads ran on the feed's thread, installs on the serving (engine) thread; a request's first token comes
    # after its adapter's load delay.
    assert slow.load_threads and threading.get_ident() not in slow.load_threads
    assert slow.install_threads == {threading.get_ident()}
    for r, q in zip(got.records, reqs):
        if q.adapter is not None:
            assert r.token_times[0] >= q.arrival_s + slow.delay_s
    # Steps name the engine's adapter names of the requests that produced tokens in them.
    assert {a for step in got.extra["steps_adapters"] for a in step} == {f"fed/{n}" for n in folders}


def test_a_failed_load_reaches_the_caller(setup):
    model, folders = setup
    engine = _engine(model)
    slow = SlowFeed(engine, folders, delay_s=0.01, fail="a2")
    reqs = _requests(engine.model_config.vocab_size, [0.0] * 5)
    with pytest.raises(OSError, match="cannot read adapter a2"):
        LoraplexSystem("fed", engine, adapter_feed=slow.feed()).serve(reqs)


def test_runs_loading_on_another_thread_are_not_stepped_in_turn(setup):
    # Their loads would go on while the other run steps, for free: refused, nothing started.
    from e2e.systems import serve_interleaved

    model, folders = setup
    engines = [_engine(model), _engine(model)]
    slow = SlowFeed(engines[0], folders, delay_s=0.01)
    reqs = _requests(engines[0].model_config.vocab_size, [0.0] * 3)
    with pytest.raises(ValueError, match="another thread"):
        serve_interleaved([(LoraplexSystem("fed", engines[0], adapter_feed=slow.feed()), reqs),
                           (LoraplexSystem("plain", engines[1], False), reqs)])
    assert not slow.load_threads and not engines[0].has_unfinished()


def test_scaling_runs_serve_the_same_with_loads_on_either_thread(setup, tmp_path, monkeypatch):
    # scaling.run_one loads on the engine thread (the CPU default) or on the host cache's prefetch thread
    # (the server's way, the GPU default): the same requests give the same tokens either way. Both runs share one
    # engine, as a sweep's runs do: the second starts with nothing resident and counts only its own loads.
    from e2e import scaling
    from e2e.workload import ensure_adapters

    model, _ = setup
    cfg = load_model_config(model)
    names = [f"s{i}-r{4 * (1 + i % 2)}" for i in range(5)]
    folders = ensure_adapters(tmp_path / "adapters", cfg, names, seed=3)
    rng = random.Random()
    reqs = [BenchRequest(f"q{i}", 0.0, tuple(rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(3, 10))),
                         names[i // 2 % len(names)], rng.randint(1, 4), 1.0) for i in range(12)]
    conf = EngineConfig(model=str(model), dtype="float32", device="cpu", pool_bytes=8 << 20, max_lora_rank=16,
                        kernels="torch")
    size = max(p.stat().st_size for p in (f / "adapter_model.safetensors" for f in folders.values()))
    load_threads: list[int] = []
    real_load = scaling.FolderStore._load

    def load(self, ref):
        load_threads.append(threading.get_ident())
        return real_load(self, ref)

    monkeypatch.setattr(scaling.FolderStore, "_load", load)
    runs = {}
    engine = EngineCore(conf)
    for mode in (False, True):
        load_threads.clear()
        runs[mode] = scaling.run_one(engine, reqs, folders, 3 * size, prefetch_loads=mode)
        on_caller = {t == threading.get_ident() for t in load_threads}
        assert on_caller == {not mode}, f"prefetch_loads={mode}: loads ran on the caller's thread: {on_caller}"
    tokens = {mode: [r.token_ids for r in run.records] for mode, (run, _) in runs.items()}
    assert tokens[False] == tokens[True]
    assert all(len(t) == q.output_tokens for t, q in zip(tokens[True], reqs))
    for _, point in runs.values():
        hc = point.host_cache
        assert hc["hits"] + hc["joined"] + hc["misses"] == len(reqs) and hc["misses"] >= len(names)
        assert hc["evictions"] > 0  # the cache holds three of the five
        assert point.pool_loads >= len(names)  # this run's own: every adapter placed again
    assert engine.pager.stats().adapter_loads == sum(point.pool_loads for _, point in runs.values())


def test_warmup_runs_the_adapter_path_outside_the_clock(setup):
    """The warm-up of a system with adapters serves two of its loaded adapters and a request without one, so
    the LoRA kernels' variants are built (Triton compiles them on a GPU) before the first timed run; a fed
    system's warm-up loads nothing (its host-cache counts belong to the run)."""
    model, folders = setup
    engine = _engine(model)
    for name in ("a0", "a1", "a2"):
        engine.load_adapter(name, folders[name])
    LoraplexSystem("loraplex", engine, True).warmup()
    assert not engine.has_unfinished()
    resident = {n for n in ("a0", "a1", "a2") if engine.pager.is_resident(engine.adapters.resolve(n))}
    assert resident == {"a0", "a1"}  # placed in the pool by the warm-up's steps
    base = _engine(model)
    base.load_adapter("a0", folders["a0"])
    LoraplexSystem("no-adapters", base, False).warmup()
    assert not base.pager.is_resident(base.adapters.resolve("a0"))


def test_clear_adapters_leaves_the_pool_as_a_new_engines(setup):
    """A scaling sweep reuses one engine: clear_adapters forgets every adapter (host copy and pool pages), so a
    run names none of the last run's; it refuses an engine with requests in flight, which hold their adapters."""
    from e2e.scaling import clear_adapters

    model, folders = setup
    engine = _engine(model)
    fresh = engine.pager.stats()
    for name in ("a0", "a1", "a2"):
        engine.load_adapter(name, folders[name])
    LoraplexSystem("loraplex", engine, True).warmup()  # places two of them in the pool
    assert engine.pager.stats().resident_adapters == 2
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), adapter="a0")
    with pytest.raises(ValueError, match="idle engine"):
        clear_adapters(engine)
    assert engine.adapters.names() == ["a0", "a1", "a2"]  # refused: nothing forgotten
    while engine.has_unfinished():
        engine.step()
    clear_adapters(engine)
    left = engine.pager.stats()
    assert engine.adapters.names() == []
    assert (left.free_pages, left.adapter_pages, left.kv_pages, left.resident_adapters) == \
        (fresh.free_pages, 0, 0, 0)


def test_a_sweeps_loads_all_take_pack_plans_learnt_outside_the_clock(setup, tmp_path):
    """learn_plans meets each rank of the run's adapters once, before the run: inside it every host-cache load is
    packed by a plan (no miss), as a server's loads are once it has met each shape."""
    from e2e import scaling
    from e2e.workload import ensure_adapters
    from loraplex.kernels.cpu_build import load_extension
    from native_kernels import require_built

    require_built("cpu_pack", load_extension("cpu_pack") is not None, "packer")  # plans pack through it
    model, _ = setup
    cfg = load_model_config(model)
    names = [f"p{i}-r{4 * (1 + i % 2)}" for i in range(4)]  # two ranks: two plans
    folders = ensure_adapters(tmp_path / "adapters", cfg, names, seed=5)
    reqs = [BenchRequest(f"q{i}", 0.0, (3, 4, 5, 6), names[i % len(names)], 2, 1.0) for i in range(8)]
    engine = EngineCore(EngineConfig(model=str(model), dtype="float32", device="cpu", pool_bytes=8 << 20,
                                     max_lora_rank=16, kernels="torch"))
    plans = scaling.pack_plans(engine)
    scaling.learn_plans(plans, engine, folders)
    assert (len(plans), plans.misses) == (2, 2)  # one full load of each rank, each teaching its plan
    _, point = scaling.run_one(engine, reqs, folders, 1 << 30, plans=plans)
    assert point.host_cache["misses"] == len(names)  # every adapter loaded once in the run...
    assert (len(plans), plans.misses, plans.hits) == (2, 2, len(names))  # ...each by its plan
