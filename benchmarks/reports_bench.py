"""Reports benchmark: usage and latency reports over 1,000,000 recorded events, on SQLite and PostgreSQL.

1. Records --events usage events (default 1,000,000) through the real path: UsageRecord ->
   UsageRecorder.record -> the writer thread's batches (raw usage_events + hourly rollups, one
   transaction each). 10 tenants x (5 adapters + the base model), adapters Zipf-popular, times uniform
   over 30 days and fed in time order (as a live server produces them), 1-300 completion tokens (every
   inter-token gap recorded: ~150 per request), latencies lognormal. The producer waits while more than
   100,000 events are pending, so nothing is dropped (checked).
2. Times usage_report and latency_report over the whole 30 days: granularity hour and day, by adapter,
   one tenant and all tenants (plus by_adapter=False for all tenants); p50 (and min/max) of --reps runs
   after one warm-up, wall clock, in this process (the server would call them the same way). Target
   (issue 5): every report under 1 s. The worst case is hourly for all tenants: one row per
   (adapter, hour), 43,198 rows here.
3. For scale: the same daily usage numbers computed straight from the 1,000,000 raw rows with one SQL
   GROUP BY (what a report would cost without the rollups).

Writes JSON (--out) and prints a table. Usage:
    .venv/bin/python benchmarks/reports_bench.py [--events 1000000] [--reps 5] [--backends sqlite postgresql]
PostgreSQL: LORAPLEX_BENCH_PG (default postgresql+psycopg://postgres@127.0.0.1:5432/test) names a server where a
throw-away database is created and dropped; skipped (and said) if unreachable.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
from sqlalchemy import func, select

from loraplex.adapter_store import AdapterCreate, Registry, TenantCreate, migrate
from loraplex.adapter_store.models import LatencyDaily, LatencyHourly, UsageEvent, UsageHourly
from loraplex.metering import UsageRecord, UsageRecorder, latency_report, usage_report

TENANTS = 10
ADAPTERS_PER_TENANT = 5
DAYS = 30
START = datetime(2026, 6, 1, tzinfo=UTC)
STATUSES = np.array(["ok", "cancelled", "refused", "error"])
STATUS_P = [0.92, 0.03, 0.04, 0.01]
MAX_PENDING_WHILE_PRODUCING = 100_000


def pg_database() -> tuple[str, Callable[[], None]] | None:
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


def make_fleet(registry: Registry) -> list[tuple[str, list[str | None]]]:
    """[(tenant id, [None (base), adapter ids...])]."""
    fleet = []
    for t in range(TENANTS):
        tenant = registry.create_tenant(TenantCreate(name=f"bench-{t:02d}", ttft_target_ms=250))
        items = []
        for a in range(ADAPTERS_PER_TENANT):
            digest = uuid.uuid4().hex * 2
            items.append(AdapterCreate(tenant_id=tenant.id, name=f"adapter-{a}", base_model_fingerprint="f" * 64,
                                       rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"), dtype="float16",
                                       size_bytes=1 << 20, sha256=digest, storage_key=f"sha256/{digest[:2]}/{digest}"))
        fleet.append((tenant.id, [None] + [a.id for a in registry.add_adapters(items)]))
    return fleet


def record_events(registry: Registry, fleet, n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    seconds = np.sort(rng.uniform(0, DAYS * 86400, size=n))
    tenant_idx = rng.integers(0, TENANTS, size=n)
    zipf = 1.0 / np.arange(1, ADAPTERS_PER_TENANT + 2)  # base model and adapters, Zipf-popular
    adapter_idx = rng.choice(ADAPTERS_PER_TENANT + 1, size=n, p=zipf / zipf.sum())
    statuses = rng.choice(STATUSES, size=n, p=STATUS_P)
    prompt = rng.integers(16, 2048, size=n)
    completion = rng.integers(1, 301, size=n)
    ttft = rng.lognormal(np.log(120), 0.6, size=n)
    queue = rng.exponential(15, size=n)
    # Inter-token gaps: a per-(adapter) base, a load factor by hour of day, per-token spread.
    itl_base = {(t, a): rng.uniform(18, 40) for t in range(TENANTS) for a in range(ADAPTERS_PER_TENANT + 1)}

    recorder = UsageRecorder(registry, flush_interval_s=0.5, max_batch=5000)
    t0 = time.perf_counter()
    itl_values = 0
    for i in range(n):
        if i % 10_000 == 0:
            while recorder.stats().pending > MAX_PENDING_WHILE_PRODUCING:
                time.sleep(0.01)
        t, a = int(tenant_idx[i]), int(adapter_idx[i])
        tenant_id, adapters = fleet[t]
        status = str(statuses[i])
        created = START + timedelta(seconds=float(seconds[i]))
        if status == "refused":
            rec = UsageRecord(tenant_id=tenant_id, request_id=f"r{i}", status=status, reason="429 slo",
                              adapter_id=adapters[a], prompt_tokens=int(prompt[i]), e2e_ms=0.4,
                              ttft_target_ms=250.0, created_at=created)
        else:
            k = int(completion[i]) if status == "ok" else int(completion[i]) // 3
            load = 1.0 + 0.5 * np.sin(2 * np.pi * (created.hour / 24))
            gaps = rng.lognormal(np.log(itl_base[(t, a)] * load), 0.35, size=max(0, k - 1))
            itl_values += len(gaps)
            rec = UsageRecord(tenant_id=tenant_id, request_id=f"r{i}", status=status, adapter_id=adapters[a],
                              prompt_tokens=int(prompt[i]), completion_tokens=k, queue_ms=float(queue[i]),
                              ttft_ms=float(ttft[i]) if k else None,
                              e2e_ms=float(ttft[i] + gaps.sum()), itl_ms=tuple(gaps.tolist()),
                              ttft_target_ms=250.0, created_at=created)
        recorder.record(rec)
    assert recorder.close(timeout=3600), "recorder could not write everything"
    seconds_taken = time.perf_counter() - t0
    stats = recorder.stats()
    assert stats.dropped == 0 and stats.rejected == 0 and stats.written == n, stats
    return {"events": n, "itl_values": itl_values, "seconds": seconds_taken, "events_per_s": n / seconds_taken}


def table_rows(registry: Registry) -> dict:
    with registry.engine.connect() as conn:
        return {name: conn.execute(select(func.count()).select_from(t)).scalar_one()
                for name, t in (("usage_events", UsageEvent), ("usage_hourly", UsageHourly),
                                ("latency_hourly", LatencyHourly), ("latency_daily", LatencyDaily))}


def time_reports(registry: Registry, fleet, reps: int) -> list[dict]:
    end = START + timedelta(days=DAYS)
    one = fleet[0][0]
    cases = []
    for report in (usage_report, latency_report):
        for granularity in ("hour", "day"):
            for tenant, label in ((one, "one"), (None, "all")):
                cases.append((report, granularity, tenant, label, True))
        cases.append((report, "day", None, "all", False))
    out = []
    for report, granularity, tenant, label, by_adapter in cases:
        rows = report(registry, tenant, START, end, granularity, by_adapter)  # warm-up
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            report(registry, tenant, START, end, granularity, by_adapter)
            times.append(time.perf_counter() - t)
        out.append({"report": report.__name__, "granularity": granularity, "tenants": label,
                    "by_adapter": by_adapter, "rows": len(rows), "p50_ms": 1e3 * statistics.median(times),
                    "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times)})
    return out


def time_raw_group_by(registry: Registry) -> float:
    """Daily usage by tenant and adapter straight from usage_events (no rollups), for comparison."""
    e = UsageEvent
    day = func.date(e.created_at) if registry.engine.dialect.name == "sqlite" else func.date_trunc("day", e.created_at)
    query = select(e.tenant_id, e.adapter_id, day, func.count(), func.sum(e.prompt_tokens),
                   func.sum(e.completion_tokens)).group_by(e.tenant_id, e.adapter_id, day)
    t = time.perf_counter()
    with registry.engine.connect() as conn:
        conn.execute(query).all()
    return 1e3 * (time.perf_counter() - t)


def bench(backend: str, url: str, n: int, reps: int, seed: int) -> dict:
    migrate.upgrade(url)
    registry = Registry.open(url)
    try:
        fleet = make_fleet(registry)
        print(f"[{backend}] recording {n:,} events ...", flush=True)
        recording = record_events(registry, fleet, n, seed)
        print(f"[{backend}] {recording['events_per_s']:,.0f} events/s; timing reports ...", flush=True)
        load_before = os.getloadavg()[0]
        reports = time_reports(registry, fleet, reps)
        return {"backend": backend, "recording": recording, "tables": table_rows(registry), "reports": reports,
                "raw_group_by_day_ms": time_raw_group_by(registry),
                # The machine is shared: the 1-minute load average around the report timings.
                "load_average_1m": [load_before, os.getloadavg()[0]]}
    finally:
        registry.close()


def print_tables(result: dict) -> None:
    for b in result["backends"]:
        rec, tables = b["recording"], b["tables"]
        print(f"\n{b['backend']}: {rec['events']:,} events ({rec['itl_values']:,} inter-token gaps) recorded in "
              f"{rec['seconds']:.0f} s ({rec['events_per_s']:,.0f} events/s); rollup rows: "
              f"usage_hourly {tables['usage_hourly']:,}, latency_hourly {tables['latency_hourly']:,}, "
              f"latency_daily {tables['latency_daily']:,}; load average {b['load_average_1m'][0]:.1f}"
              f"/{b['load_average_1m'][1]:.1f} (2 cores)")
        print(f"{'report':<16}{'granularity':>12}{'tenants':>9}{'by adapter':>11}{'rows':>8}{'p50 ms':>9}"
              f"{'min':>8}{'max':>8}")
        for r in b["reports"]:
            print(f"{r['report']:<16}{r['granularity']:>12}{r['tenants']:>9}{str(r['by_adapter']):>11}{r['rows']:>8}"
                  f"{r['p50_ms']:>9.0f}{r['min_ms']:>8.0f}{r['max_ms']:>8.0f}")
        print(f"(for scale: daily usage GROUP BY over the raw usage_events: {b['raw_group_by_day_ms']:.0f} ms)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backends", nargs="+", default=["sqlite", "postgresql"], choices=["sqlite", "postgresql"])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "reports_bench.json"))
    args = ap.parse_args()
    result: dict = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                    "events": args.events, "days": DAYS, "tenants": TENANTS,
                    "adapters_per_tenant": ADAPTERS_PER_TENANT, "reps": args.reps, "backends": []}
    with tempfile.TemporaryDirectory(prefix="reports-bench-") as tmp:
        if "sqlite" in args.backends:
            result["backends"].append(bench("sqlite", f"sqlite:///{tmp}/registry.db", args.events, args.reps,
                                            args.seed))
        if "postgresql" in args.backends:
            pg = pg_database()
            if pg is not None:
                url, drop = pg
                try:
                    result["backends"].append(bench("postgresql", url, args.events, args.reps, args.seed))
                finally:
                    drop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print_tables(result)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
