"""Throughput against the number of distinct adapters (offline, one trace), beside the floor's prediction.

For each N in (1, 10, 100, 1000) the trace is regenerated with N adapters and the same seed: arrivals and
lengths are identical (the trace generator draws them before the adapter picks); only which adapter each
request names changes (power-law popularity). Adapters reach the engine the way the server feeds them:
adapter folder -> host cache (byte-budgeted LRU, adapter_store.HostCache) -> EngineAdapterBridge -> engine
-> page pool (evicting idle adapters, LRU). The host-cache budget and the pool size are stated in the
result so that "more adapters than fit" shows.

Every run of a sweep is served by one engine, warmed up once (EngineCore.warmup): before each run its adapters
are all forgotten (clear_adapters: no host copy, no pool page, no KV page left) and a new host cache is made, so
each run starts as on a new engine, without loading the model and warming up again (4-6 s a run). On an AMD EPYC
Zen 4 (thirty-third session, /tmp script, the quick preset's 1- and 1000-adapter runs, three of each way
alternating in one process) a new engine per run took 8.5-11.2 s a run with its set-up against 4.9-5.3 s, for
walls of 4.46-5.08 s against 4.54-5.01 s: a 1 -> 1000 loss of 0.078 against 0.074. The sweep's pack plans live
as long as its engine, as a server's loader's do (learn_plans).

Loads are fed through systems.AdapterFeed in one of two ways: on the engine thread as each request arrives (the
default on the CPU), or as the server feeds them (prefetch_loads, the default on a GPU): started on the host
cache's prefetch thread when the request arrives, the request joining the engine once its adapter is decoded.
On a 2-core CPU the engine's two threads and the prefetch thread then share the cores, and the offline burst ran
slower that way (Intel Xeon, fourteenth session, 6 runs each alternating in one process, median walls: 100
adapters 5.49 s on the engine thread against 5.86 prefetched, 1000 adapters 5.78 against 6.11): a load on the
engine thread copies with both cores and stalls no parallel region. Either way the loads' cost is inside the
measured time.

With repeats > 1 the sweep runs again in mirrored order (1, 10, 100, 1000, 1000, 100, 10, 1, ...): a
CPU whose speed drifts over minutes (the AMD dev machine's matmul rate moved between 40 and 60 GFLOP/s)
then gives every N the same mean position in time, so a linear drift cancels out of the comparison.
Each point reports the median of its runs' walls (and every wall): on a shared machine one run in a few
can be disturbed by a third or more (the AMD EPYC of the ninth session: 4.48 against 3.18 s for the same
1-adapter run), and the median of four leaves it out where a mean of two took it in half.

Floor-predicted time of run N = time of run 1 + (extra bytes) / read bandwidth + (extra LoRA FLOPs) /
matmul rate, where the bytes are those of the distinct adapters each step reads, plus each host-cache load
and each pool load (one pass over the adapter's bytes each), and the FLOPs are every token's shrink and
expand at its adapter's rank. Loss = 1 - throughput_N / throughput_1, measured and predicted.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from loraplex.adapter_store.engine_bridge import EngineAdapterBridge
from loraplex.adapter_store.host_cache import HostCache
from loraplex.adapter_store.loader import LoadTimings
from loraplex.adapter_store.schemas import AdapterPublic
from loraplex.config import EngineConfig
from loraplex.engine import EngineCore
from loraplex.lora.types import TARGET_MODULES, LoraAdapter
from loraplex.unified_pager import PackPlans, RowLayout, load_packed_folder

import traces as T

from .ceiling import Ceilings
from .metrics import summarize
from .systems import AdapterFeed, LoraplexSystem, RunResult
from .workload import BenchRequest, adapter_elements, adapter_rank, all_at_once, ensure_adapters, requests_from_trace, \
    used_adapters

TENANT = "bench"


@dataclass(frozen=True)
class _StoreConfig:
    dtype: str
    max_lora_rank: int


class FolderStore:
    """The part of AdapterStore the engine bridge uses, over adapter folders instead of the registry and
    object store: resolve a name, get/prefetch through the real HostCache (decoded and packed as the
    store's loader does)."""

    def __init__(self, engine: EngineCore, folders: dict[str, Path], host_cache_bytes: int,
                 plans: PackPlans | None = None):
        self.config = _StoreConfig(engine.config.dtype, engine.config.max_lora_rank)
        self._model = engine.model_config
        # The pack plans, as the store's loader has them: learnt once per process (pack_plans), not per run.
        self._plans = plans or pack_plans(engine)
        now = datetime.now(timezone.utc)
        self.refs = {name: AdapterPublic(
            id=str(uuid.uuid5(uuid.NAMESPACE_URL, str(path))), tenant_id=TENANT, name=name, version=1,
            base_model_fingerprint="", rank=adapter_rank(name), alpha=0.0,
            target_modules=TARGET_MODULES, dtype=engine.config.dtype, size_bytes=0, sha256="",
            storage_key=str(path), status="ready", status_detail=None, created_at=now, last_used_at=None)
            for name, path in folders.items()}
        self.cache = HostCache(host_cache_bytes, self._load, prefetch_workers=1)

    def _load(self, ref: AdapterPublic) -> tuple[LoraAdapter, LoadTimings]:
        t0 = time.perf_counter()
        packed = load_packed_folder(ref.name, ref.storage_key, self._model, self.config.max_lora_rank,
                                    self._plans.layout, plans=self._plans)
        return packed, LoadTimings(0.0, 0.0, time.perf_counter() - t0, packed.nbytes, 0.0)

    def resolve(self, tenant_id: str, name: str) -> AdapterPublic:
        return self.refs[name]

    def get(self, ref: AdapterPublic) -> LoraAdapter:
        return self.cache.get(ref)

    def prefetch(self, ref: AdapterPublic):
        return self.cache.prefetch(ref)


def pack_plans(engine: EngineCore) -> PackPlans:
    """Pack plans for the engine's model, rank limit and dtype (unified_pager.pack_plan)."""
    layout = RowLayout.for_model(engine.model_config, engine.config.torch_dtype)
    return PackPlans(engine.model_config, engine.config.max_lora_rank, layout)


def learn_plans(plans: PackPlans, engine: EngineCore, folders: dict[str, Path]) -> None:
    """Load (and drop) one adapter of each rank among `folders`, so that the timed runs' loads all take the plans
    as a server's do once it has met each shape: a run with new plans packed its first adapter of each rank by
    the full path, 12-20 ms where the others took 2-4 (AMD EPYC Zen 4, thirty-third session, /tmp script timing
    every load inside the quick preset's scaling runs)."""
    by_rank: dict[int, str] = {}
    for name in folders:
        by_rank.setdefault(adapter_rank(name), name)
    for name in by_rank.values():
        load_packed_folder(name, folders[name], engine.model_config, engine.config.max_lora_rank, plans.layout,
                           plans=plans)


@dataclass(frozen=True)
class ScalingPoint:
    adapters: int  # distinct adapters in the trace's popularity law
    distinct_used: int  # of them, those some request names
    throughput_rps: float
    throughput_tok_s: float
    wall_s: float  # mean over the repeats
    relative_throughput: float  # against the 1-adapter run
    host_cache: dict  # HostCache stats: hits, joined (waited on a load in flight), misses, evictions, loads, ...
    pool_loads: int
    pool_evictions: int
    pool_pages: int
    adapter_pages_at_end: int
    step_adapter_bytes: int  # summed over steps: bytes of the distinct adapters each step read
    load_bytes: int  # host-cache loads + pool loads, one pass each
    lora_flops: float
    pool_load_bytes: int = 0  # of load_bytes, the pool loads' (host to device on a GPU)
    measured_loss: float | None = None
    predicted_loss: float | None = None
    loss_ratio: float | None = None  # measured / predicted (the bound: <= 1.3)
    walls: list[float] = dataclasses.field(default_factory=list)  # every repeat's wall, in the order run
    # The host cache's loads (file read, decoded and packed; inside the timed run), measured, and the floor's
    # price for their bytes (host_load_floor_seconds). On the AMD EPYC Zen 3 of the thirty-second session (quick
    # run) the 1000-adapter run's 25 loads took 0.176 s against 0.009 at the floor: 0.17 of the 0.27 s by which
    # that run's extra time exceeded the floor's (the 100-adapter run: 0.10 of 0.18 s).
    host_load_s: float = 0.0
    host_load_floor_s: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def _adapter_bytes(engine: EngineCore, name: str) -> int:
    return adapter_elements(engine.model_config, adapter_rank(name)) * engine.config.torch_dtype.itemsize


def _loaded(adapter: LoraAdapter) -> Future:
    done: Future = Future()
    done.set_result(adapter)
    return done


def clear_adapters(engine: EngineCore) -> None:
    """Forget every adapter the engine holds, host copies and pool pages, so that a run on it starts as on a new
    engine: nothing resident from another N. The engine must be idle (a request holds its adapter)."""
    if engine.has_unfinished():
        raise ValueError("clear_adapters needs an idle engine")
    for name in engine.adapters.names():
        engine.unload_adapter(name)
    left = engine.pager.stats()
    if left.resident_adapters or left.adapter_pages or left.kv_pages:
        raise AssertionError(f"the pool still holds {left.resident_adapters} adapters ({left.adapter_pages} pages) "
                             f"and {left.kv_pages} KV pages after its adapters were unloaded")


def run_one(engine: EngineCore, requests: Sequence[BenchRequest], folders: dict[str, Path],
            host_cache_bytes: int, prefetch_loads: bool = False,
            plans: PackPlans | None = None) -> tuple[RunResult, ScalingPoint]:
    """One run on `engine` (idle; warmed up once by the first run's system): its adapters cleared first, a new host
    cache (with `plans`, the sweep's pack plans; new ones by default), the pool's counts taken as this run's
    differences."""
    clear_adapters(engine)
    # The previous run's host cache, its adapters and requests are held by reference cycles until the garbage
    # collector runs: collected here, not at some allocation inside this run's clock (Intel Xeon, 2026-12-04:
    # left to chance, one adapter count's four walls spread by up to 0.9 s while the freed memory went back to
    # the system; collected first, by 0.11-0.14 s).
    gc.collect()
    before = engine.pager.stats()
    store = FolderStore(engine, folders, host_cache_bytes, plans)
    bridge = EngineAdapterBridge(engine, store)
    # The feed's prefetch runs where the request arrives, on the engine thread: there store.get loads it now.
    start = (lambda name: bridge.prefetch(store.refs[name])) if prefetch_loads else (
        lambda name: _loaded(store.get(store.refs[name])))
    feed = AdapterFeed(prefetch=start, install=lambda name, decoded: bridge.install(store.refs[name], decoded))
    system = LoraplexSystem("loraplex", engine, True, feed)
    system.warmup()
    run = system.serve(requests)
    m = summarize(run)
    cfg = engine.model_config
    hc = store.cache.stats()
    pool = engine.pager.stats()
    pool_loads = pool.adapter_loads - before.adapter_loads
    step_bytes = sum(_adapter_bytes(engine, a) for step in run.extra["steps_adapters"] for a in step)
    ranks = {r.id: adapter_rank(r.adapter) for r in requests if r.adapter}
    # One pass over an adapter's bytes per host-cache load and per pool load (mean adapter size).
    mean_bytes = (sum(_adapter_bytes(engine, n) for n in folders) / len(folders)) if folders else 0
    load_bytes = int((hc.loads + pool_loads) * mean_bytes)
    pool_load_bytes = int(pool_loads * mean_bytes)
    lora_flops = sum(2.0 * (len(r.prompt) + r.output_tokens) * adapter_elements(cfg, ranks[r.id])
                     for r in requests if r.adapter)
    point = ScalingPoint(
        adapters=0, distinct_used=len(folders), throughput_rps=m.throughput_rps, throughput_tok_s=m.throughput_tok_s,
        wall_s=run.wall_s, relative_throughput=1.0,
        host_cache={k: v for k, v in asdict(hc).items() if k not in ("entries", "bytes")},
        pool_loads=pool_loads, pool_evictions=pool.adapter_evictions - before.adapter_evictions,
        pool_pages=pool.total_pages,
        adapter_pages_at_end=pool.adapter_pages, step_adapter_bytes=step_bytes, load_bytes=load_bytes,
        lora_flops=lora_flops, pool_load_bytes=pool_load_bytes, host_load_s=hc.load_seconds)
    store.cache.close()
    return run, point


def scaling_workloads(engine_config: EngineConfig, spec: T.TraceSpec, counts: Sequence[int], num_requests: int,
                      adapter_root: Path, seed: int = 0) -> dict[int, tuple[list[BenchRequest], dict[str, Path]]]:
    """N -> (the first `num_requests` requests of `spec`'s trace regenerated with N adapters, all at once; the folders
    of the adapters they name, written under adapter_root where missing): the same in every repeat."""
    from loraplex.models.config import load_model_config
    from loraplex.models.default_model import resolve_model_path

    model_cfg = load_model_config(resolve_model_path(engine_config.model, engine_config.cache_dir))
    workloads = {}
    for n in counts:
        trace = T.generate(dataclasses.replace(spec, num_adapters=n))[:num_requests]
        reqs = all_at_once(requests_from_trace(trace, model_cfg.vocab_size, seed,
                                               max_len=model_cfg.max_model_len))
        workloads[n] = (reqs, ensure_adapters(adapter_root, model_cfg, used_adapters(reqs), seed))
    return workloads


def mirrored(counts: Sequence[int], repeats: int) -> list[int]:
    """The sweep's order: counts, then reversed, and so on, `repeats` times (the module's docstring says why)."""
    return [n for r in range(repeats) for n in (counts if r % 2 == 0 else list(reversed(counts)))]


def run_scaling(engine_config: EngineConfig, spec: T.TraceSpec, counts: Sequence[int], num_requests: int,
                adapter_root: Path, ceilings: Ceilings, host_cache_bytes: int, seed: int = 0,
                log=print, repeats: int = 1, prefetch_loads: bool = False) -> list[ScalingPoint]:
    """The first `num_requests` requests of `spec`'s trace regenerated with each adapter count, the sweep
    run `repeats` times in alternating order (see the module's docstring for prefetch_loads)."""
    workloads = scaling_workloads(engine_config, spec, counts, num_requests, adapter_root, seed)
    gc.collect()  # the earlier parts' engines, held by reference cycles: freed before this one's pool
    engine = EngineCore(engine_config)
    plans = pack_plans(engine)
    learn_plans(plans, engine, {name: path for _, folders in workloads.values() for name, path in folders.items()})
    runs: dict[int, list[ScalingPoint]] = {n: [] for n in counts}
    for n in mirrored(counts, repeats):
        reqs, folders = workloads[n]
        log(f"  {n} adapters ({len(folders)} used by {len(reqs)} requests)...")
        _, point = run_one(engine, reqs, folders, host_cache_bytes, prefetch_loads, plans)
        point = dataclasses.replace(point, adapters=n)
        hc = point.host_cache
        log(f"    {point.wall_s:.1f} s, host cache {hc['hits']} hits / {hc['joined']} joined / {hc['misses']} "
            f"misses / {hc['evictions']} evictions, pool {point.pool_loads} loads / "
            f"{point.pool_evictions} evictions")
        runs[n].append(point)
    return with_predictions([_median_point(runs[n]) for n in counts], ceilings)


def _median_point(runs: list[ScalingPoint]) -> ScalingPoint:
    """One point from repeats of the same N (the same requests): median wall and throughput, every wall kept,
    and the median of the host cache's load seconds; the cache and pool counts are the first run's (each run
    starts from an empty cache and pool)."""
    wall = statistics.median(r.wall_s for r in runs)
    first = runs[0]
    return dataclasses.replace(first, wall_s=wall, throughput_rps=first.throughput_rps * first.wall_s / wall,
                               throughput_tok_s=first.throughput_tok_s * first.wall_s / wall,
                               walls=[r.wall_s for r in runs],
                               host_load_s=statistics.median(r.host_load_s for r in runs))


def extra_seconds(p: ScalingPoint, ref: ScalingPoint, ceilings: Ceilings) -> float:
    """The floor's extra time of p over ref: extra bytes over the bandwidth of the memory they cross, extra
    LoRA FLOPs over the matmul rate. On the CPU every byte is priced at the measured read bandwidth. On a GPU
    the adapters' step reads are priced at the device's bandwidth, host-cache loads (file to host memory) at the
    host's and pool loads at the host-to-device copy rate: pricing loads at HBM bandwidth (as before
    2026-12-04) predicted a 0.1% loss where the loads themselves cross PCIe."""
    step = (p.step_adapter_bytes - ref.step_adapter_bytes) / (ceilings.read_gbps * 1e9)
    flops = (p.lora_flops - ref.lora_flops) / (ceilings.matmul_gflops * 1e9)
    if ceilings.h2d_gbps is None or ceilings.host_read_gbps is None:
        return step + (p.load_bytes - ref.load_bytes) / (ceilings.read_gbps * 1e9) + flops
    host = host_load_floor_seconds(p, ceilings) - host_load_floor_seconds(ref, ceilings)
    pool = p.pool_load_bytes - ref.pool_load_bytes
    return step + host + pool / (ceilings.h2d_gbps * 1e9) + flops


def host_load_floor_seconds(p: ScalingPoint, ceilings: Ceilings) -> float:
    """The floor's price for p's host-cache loads: one pass over their bytes at the host's read bandwidth (the
    measured read bandwidth on the CPU), as extra_seconds prices them."""
    return (p.load_bytes - p.pool_load_bytes) / ((ceilings.host_read_gbps or ceilings.read_gbps) * 1e9)


def with_predictions(points: list[ScalingPoint], ceilings: Ceilings) -> list[ScalingPoint]:
    """Relative throughput and the floor's predicted loss against the first point (1 adapter)."""
    if not points:
        return points
    ref = points[0]
    out = []
    for p in points:
        extra_s = extra_seconds(p, ref, ceilings)
        predicted_rel = ref.wall_s / (ref.wall_s + extra_s)
        measured_rel = p.throughput_rps / ref.throughput_rps
        measured_loss, predicted_loss = 1.0 - measured_rel, 1.0 - predicted_rel
        ratio = measured_loss / predicted_loss if predicted_loss > 1e-9 else None
        out.append(dataclasses.replace(p, relative_throughput=measured_rel, measured_loss=measured_loss,
                                       predicted_loss=predicted_loss, loss_ratio=ratio,
                                       host_load_floor_s=host_load_floor_seconds(p, ceilings)))
    return out
