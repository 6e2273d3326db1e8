"""Adapter store benchmark: registry scale on SQLite and PostgreSQL, cold-load latency from the object store.

1. Registry at 10,000 adapters (tiny model, small ranks), on SQLite and PostgreSQL:
   - registration through the full upload path (stage, validate, blob write + read-back, row), adapters/s;
   - bulk registration of rows (Registry.add_adapters, batches of 1,000), rows/s;
   - listing latency with 10,000 registered: every page of 100 (keyset pagination), p50/p99; resolve p50/p99.
2. Cold load of rank 8/16/64 adapters on all 7 projections of the default model (SmolLM2-135M), from the
   local folder store and from S3 (moto's server on 127.0.0.1), split into fetch, verify (sha256), decode
   (safetensors + the serving checks + cast), pack (into the pool's row layout, on the loading thread) and
   pool placement (UnifiedPager.load_adapter: one page-granular copy of the packed rows), p50/p99, and
   MB/s of the cold load (object store -> host cache). Targets (issue 4): rank 16 from the local folder
   under 50 ms p50; host cache -> pool under 5 ms p50. For comparison, "place_unpacked" places the same
   adapter without its packed rows (the path of adapters read from a folder: pack, then copy).
   "Cold" means not in the host cache; the blob file is in the OS page cache (a local read, not a disk read).

Writes JSON (--out) and prints a table. Usage:
    python benchmarks/adapter_store_bench.py [--reps 20] [--upload-n 300] \
        [--out benchmarks/results/adapter_store_bench.json]
PostgreSQL: LORAPLEX_BENCH_PG (default postgresql+psycopg://postgres@127.0.0.1:5432/test) names a server where a
throw-away database is created and dropped; it is skipped (and says so) if unreachable.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from adapter_files import write_peft_adapter  # noqa: E402  (the tests' fast PEFT-format writer)

from loraplex.adapter_store import AdapterCreate, AdapterStore, StoreConfig, UploadFile  # noqa: E402
from loraplex.config import default_cache_dir  # noqa: E402
from loraplex.lora.types import TARGET_MODULES  # noqa: E402
from loraplex.models.config import load_model_config  # noqa: E402
from loraplex.models.default_model import resolve_model_path  # noqa: E402
from loraplex.unified_pager import PoolGeometry, UnifiedPager  # noqa: E402

N_REGISTERED = 10_000
PAGE = 100


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def summary_ms(values: list[float]) -> dict:
    return {"p50_ms": 1e3 * statistics.median(values), "p99_ms": 1e3 * pct(values, 99), "n": len(values)}


# -- 1. registry scale --------------------------------------------------------------------------------

def pg_database() -> tuple[str, callable] | None:
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(os.environ.get("LORAPLEX_BENCH_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    name = f"loraplex_bench_{uuid.uuid4().hex[:10]}"
    try:
        conn = psycopg.connect(host=admin.host, port=admin.port or 5432, user=admin.username,
                               password=admin.password, dbname=admin.database, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as e:
        print(f"PostgreSQL unreachable, skipped: {e}", file=sys.stderr)
        return None
    conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()

    return admin.set(database=name).render_as_string(hide_password=False), drop


def bench_registry(backend: str, database_url: str | None, model_dir: Path, work: Path, upload_n: int) -> dict:
    model = load_model_config(model_dir)
    store = AdapterStore.open(StoreConfig(data_dir=work / f"reg-{backend}", database_url=database_url,
                                          max_lora_rank=16), model)
    try:
        tenant = store.registry.ensure_tenant("bench").id
        uploads = []
        for i in range(upload_n):
            folder = write_peft_adapter(work / f"up-{backend}-{i}", model, r=random.choice([1, 2, 4]), readme=False)
            uploads.append([UploadFile(p.name, p.read_bytes()) for p in sorted(folder.iterdir())])
        # Full path, one client at a time, then 8 concurrent clients.
        half = upload_n // 2
        t0 = time.perf_counter()
        refs = [store.upload(tenant, f"up-{i:05d}", uploads[i]) for i in range(half)]
        serial_rate = half / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(8) as pool:
            refs += list(pool.map(lambda i: store.upload(tenant, f"up-{i:05d}", uploads[i]), range(half, upload_n)))
        concurrent_rate = (upload_n - half) / (time.perf_counter() - t0)

        # Bulk rows up to 10,000, sharing the uploaded blobs by content address.
        rows = N_REGISTERED - len(refs)
        t0 = time.perf_counter()
        for start in range(0, rows, 1000):
            batch = []
            for i in range(start, min(rows, start + 1000)):
                s = refs[i % len(refs)]
                batch.append(AdapterCreate(tenant_id=tenant, name=f"bulk-{i:05d}",
                                           base_model_fingerprint=s.base_model_fingerprint,
                                           rank=s.rank, alpha=s.alpha, target_modules=s.target_modules, dtype=s.dtype,
                                           size_bytes=s.size_bytes, sha256=s.sha256, storage_key=s.storage_key))
            store.registry.add_adapters(batch)
        bulk_rate = rows / (time.perf_counter() - t0)
        assert store.registry.count_adapters(tenant) == N_REGISTERED

        page_times, cursor, pages = [], None, 0
        while True:
            t = time.perf_counter()
            page = store.list_adapters(tenant, limit=PAGE, cursor=cursor)
            page_times.append(time.perf_counter() - t)
            pages += 1
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        names = [f"bulk-{i:05d}" for i in random.sample(range(rows), 200)]
        resolve_times = []
        for n in names:
            t = time.perf_counter()
            store.resolve(tenant, n)
            resolve_times.append(time.perf_counter() - t)
        return {
            "backend": backend,
            "upload_adapters_per_s_serial": serial_rate,
            "upload_adapters_per_s_8_clients": concurrent_rate,
            "bulk_rows_per_s": bulk_rate,
            "registered": N_REGISTERED,
            "list_page_size": PAGE,
            "list_pages": pages,
            "list_page": summary_ms(page_times),
            "list_first_page_ms": 1e3 * page_times[0],
            "list_last_page_ms": 1e3 * page_times[-1],
            "resolve": summary_ms(resolve_times),
        }
    finally:
        store.close()


# -- 2. cold loads ------------------------------------------------------------------------------------

def moto_s3() -> tuple[dict, callable]:
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                 aws_secret_access_key="bench").create_bucket(Bucket="bench")
    return dict(object_store_url="s3://bench/adapters", s3_endpoint_url=endpoint, s3_region="us-east-1",
                s3_access_key_id="bench", s3_secret_access_key="bench"), server.stop


def bench_cold_loads(model_dir: Path, work: Path, ranks: list[int], reps: int, s3: dict) -> list[dict]:
    model = load_model_config(model_dir)
    dtype = torch.float32
    # A pool as the engine would build it, with room for the largest adapter many times over.
    geometry = PoolGeometry.for_model(model, 1 << 30, dtype)
    pager = UnifiedPager(geometry, "cpu")
    results = []
    for where, extra in (("local", {}), ("s3", s3)):
        store = AdapterStore.open(StoreConfig(data_dir=work / f"cold-{where}", max_lora_rank=64, **extra), model)
        tenant = store.registry.ensure_tenant("bench").id
        try:
            for rank in ranks:
                folder = write_peft_adapter(work / f"default-r{rank}", model, r=rank, targets=TARGET_MODULES,
                                            alpha=2 * rank, readme=False)
                ref = store.upload_path(tenant, f"r{rank}", folder)
                stages = {"fetch": [], "verify": [], "decode": [], "pack": [], "to_host": [], "place": [],
                          "total": [], "place_unpacked": []}
                for rep in range(reps + 1):
                    store.cache.invalidate(ref.id)  # cold: not in the host cache
                    adapter, timings = store.loader.load(ref)
                    t = time.perf_counter()
                    key = ("bench", rank, rep)
                    assert pager.load_adapter(key, adapter) is not None
                    place = time.perf_counter() - t
                    pager.unload_adapter(key)
                    # A new modules tuple drops the packed rows: placed like an adapter read from a folder.
                    unpacked = dataclasses.replace(adapter, modules=tuple([*adapter.modules]))
                    assert unpacked.packed is None
                    t = time.perf_counter()
                    assert pager.load_adapter(key, unpacked) is not None
                    place_unpacked = time.perf_counter() - t
                    pager.unload_adapter(key)
                    if rep == 0:
                        continue  # warm-up (first touch of the file, first allocation of the pool pages)
                    stages["fetch"].append(timings.fetch_s)
                    stages["verify"].append(timings.verify_s)
                    stages["decode"].append(timings.decode_s)
                    stages["pack"].append(timings.pack_s)
                    stages["to_host"].append(timings.total_s)  # object store -> host cache (the cold load)
                    stages["place"].append(place)
                    stages["total"].append(timings.total_s + place)
                    stages["place_unpacked"].append(place_unpacked)
                mb = ref.size_bytes / 1e6
                results.append({
                    "source": where, "rank": rank, "blob_mb": mb, "host_mb": adapter.nbytes / 1e6,
                    **{f"{k}": summary_ms(v) for k, v in stages.items()},
                    "mb_per_s_p50": mb / statistics.median(stages["to_host"]),
                })
        finally:
            store.close()
    return results


def print_tables(result: dict) -> None:
    print("\nRegistry at 10,000 adapters (tiny model)")
    print(f"{'backend':<11}{'upload/s':>10}{'upload/s x8':>13}{'bulk rows/s':>13}{'page p50':>10}{'page p99':>10}"
          f"{'first':>8}{'last':>8}{'resolve p50':>13}")
    for r in result["registry"]:
        print(f"{r['backend']:<11}{r['upload_adapters_per_s_serial']:>10.0f}{r['upload_adapters_per_s_8_clients']:>13.0f}"
              f"{r['bulk_rows_per_s']:>13.0f}{r['list_page']['p50_ms']:>9.2f}ms{r['list_page']['p99_ms']:>8.2f}ms"
              f"{r['list_first_page_ms']:>6.1f}ms{r['list_last_page_ms']:>6.1f}ms{r['resolve']['p50_ms']:>11.2f}ms")
    print("\nCold load, default model, all 7 projections, fp32 (ms, p50 / p99)")
    print("(cold load = fetch + verify + decode + pack, into the host cache; then pool placement, host cache -> "
          "pool; unpacked = placement of the same adapter without packed rows)")
    print(f"{'source':<7}{'rank':>5}{'MB':>7}{'fetch':>16}{'verify':>16}{'decode':>16}{'pack':>16}{'cold load':>16}"
          f"{'pool place':>16}{'total':>16}{'unpacked':>16}{'MB/s':>8}")
    for r in result["cold_load"]:
        cells = "".join(f"{r[k]['p50_ms']:>8.1f}/{r[k]['p99_ms']:<7.1f}"
                        for k in ("fetch", "verify", "decode", "pack", "to_host", "place", "total", "place_unpacked"))
        print(f"{r['source']:<7}{r['rank']:>5}{r['blob_mb']:>7.1f} {cells}{r['mb_per_s_p50']:>7.0f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20, help="cold loads per (source, rank)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--upload-n", type=int, default=300, help="adapters registered through the full upload path")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (decode casts and checks)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "adapter_store_bench.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from factories import make_tiny_model

    result: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                "torch": torch.__version__, "torch_threads": args.threads}}
    with tempfile.TemporaryDirectory(prefix="adapter-store-bench-") as tmp:
        work = Path(tmp)
        tiny_dir = make_tiny_model(work / "tiny", "llama")
        result["registry"] = [bench_registry("sqlite", None, tiny_dir, work, args.upload_n)]
        pg = pg_database()
        if pg is not None:
            url, drop = pg
            try:
                result["registry"].append(bench_registry("postgresql", url, tiny_dir, work, args.upload_n))
            finally:
                drop()
        default_dir = resolve_model_path("default", default_cache_dir())
        s3, stop = moto_s3()
        try:
            result["cold_load"] = bench_cold_loads(default_dir, work, args.ranks, args.reps, s3)
        finally:
            stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print_tables(result)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
