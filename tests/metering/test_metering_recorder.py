"""UsageRecorder on real databases: everything recorded is written by close(); events recorded while the
database is unreachable (PostgreSQL refusing connections, SQLite locked by another writer) are kept and
written when it is back; the queue bound drops and counts; a refused row never blocks the others.
No mocks, no timed assertions (waits poll for a state, with a generous limit only against hangs)."""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import create_engine, event, func, select, text
from sqlalchemy.engine import make_url

from loraplex.adapter_store import Registry, TenantCreate, migrate
from loraplex.adapter_store.models import UsageEvent, UsageHourly
from loraplex.metering import UsageRecord, UsageRecorder, usage_report
from loraplex.metering.histogram import decode
from loraplex.metering.recorder import RecorderStats

HANG_LIMIT_S = 120  # only against a hang; nothing below depends on how fast anything is


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + HANG_LIMIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def records(tenant_id: str, n: int, tag: str = "r") -> list[UsageRecord]:
    t0 = datetime(2026, 4, 1, tzinfo=UTC)
    return [UsageRecord(tenant_id=tenant_id, request_id=f"{tag}-{i}", status="ok", prompt_tokens=i,
                        completion_tokens=2, ttft_ms=10.0 + i % 7, e2e_ms=50.0, itl_ms=(1.0, 2.0),
                        created_at=t0 + timedelta(minutes=i)) for i in range(n)]


def stored(engine, tenant_id: str) -> tuple[int, int, int]:
    """(usage_events rows, their prompt tokens, requests in the rollups) of a tenant."""
    with engine.connect() as conn:
        n, tokens = conn.execute(select(func.count(), func.coalesce(func.sum(UsageEvent.prompt_tokens), 0))
                                 .where(UsageEvent.tenant_id == tenant_id)).one()
        rolled = conn.execute(select(func.coalesce(func.sum(UsageHourly.requests), 0))
                              .where(UsageHourly.tenant_id == tenant_id)).scalar_one()
    return int(n), int(tokens), int(rolled)


def new_tenant(registry: Registry) -> str:
    return registry.create_tenant(TenantCreate(name=f"r-{uuid.uuid4().hex[:10]}")).id


def test_everything_recorded_is_written_by_close(registry):
    tenant = new_tenant(registry)
    recorder = UsageRecorder(registry, flush_interval_s=0.05, max_batch=300)
    batches = [records(tenant, 700, tag=f"thread{k}") for k in range(4)]
    threads = [threading.Thread(target=lambda b=b: [recorder.record(r) for r in b]) for b in batches]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert recorder.close(timeout=HANG_LIMIT_S)
    assert recorder.stats() == RecorderStats(pending=0, written=2800, failed_flushes=0, dropped=0, rejected=0)
    assert stored(registry.engine, tenant) == (2800, 4 * sum(range(700)), 2800)
    # After close, events are dropped and counted, never raised.
    recorder.record(records(tenant, 1, tag="late")[0])
    assert recorder.stats().dropped == 1


def test_flush_writes_what_is_pending_and_stamps_the_time(registry):
    tenant = new_tenant(registry)
    with UsageRecorder(registry, flush_interval_s=3600) as recorder:  # only flush() writes
        before = datetime.now(UTC)
        recorder.record(UsageRecord(tenant_id=tenant, request_id="now", status="refused", reason="429"))
        assert recorder.flush(timeout=HANG_LIMIT_S)
        assert stored(registry.engine, tenant)[0] == 1
        (row,) = usage_report(registry, tenant, before - timedelta(hours=1), datetime.now(UTC) + timedelta(hours=1),
                              "hour", True)
        assert (row.requests, row.refused) == (1, 1)


def test_a_refused_row_does_not_block_the_others(registry):
    tenant = new_tenant(registry)
    good = records(tenant, 20)
    orphan = UsageRecord(tenant_id=str(uuid.uuid4()), request_id="no-such-tenant", status="ok")
    with UsageRecorder(registry, flush_interval_s=0.05) as recorder:
        for rec in good[:10] + [orphan] + good[10:]:
            recorder.record(rec)
        assert recorder.flush(timeout=HANG_LIMIT_S)
        stats = recorder.stats()
    assert (stats.written, stats.rejected, stats.pending) == (20, 1, 0)
    assert stored(registry.engine, tenant) == (20, sum(range(20)), 20)


def test_events_recorded_while_postgresql_refuses_connections_are_written_when_it_returns(pg_databases, pg_admin):
    url = pg_databases.create()
    migrate.upgrade(url)
    name = make_url(url).database
    registry = Registry.open(url)
    tenant = new_tenant(registry)
    before, during = records(tenant, 10, "before"), records(tenant, 25, "during")
    recorder = UsageRecorder(registry, flush_interval_s=0.05, max_backoff_s=0.2)
    admin, _ = pg_admin()
    try:
        for rec in before:
            recorder.record(rec)
        assert recorder.flush(timeout=HANG_LIMIT_S)

        # The outage: the database refuses new connections and its open ones are cut.
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        for rec in during:
            recorder.record(rec)
        wait_for(lambda: recorder.stats().failed_flushes >= 2, "failed attempts while PostgreSQL is away")
        assert recorder.stats().pending == 25 and recorder.stats().written == 10

        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        assert recorder.close(timeout=HANG_LIMIT_S)
        stats = recorder.stats()
        assert (stats.pending, stats.written, stats.dropped, stats.rejected) == (0, 35, 0, 0)
        assert stored(registry.engine, tenant) == (35, sum(range(10)) + sum(range(25)), 35)
    finally:
        admin.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        admin.close()
        recorder.close(timeout=1)
        registry.close()


def sqlite_engine_failing_fast(url: str):
    """An engine on the registry's SQLite file that gives up on a lock after 50 ms (the registry's waits
    30 s), with foreign keys on like the registry's."""
    engine = create_engine(url, connect_args={"timeout": 0.05})

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn, _record):
        dbapi_conn.execute("PRAGMA foreign_keys=ON")

    return engine


def test_events_recorded_while_sqlite_is_locked_are_written_when_the_lock_goes(sqlite_url):
    registry = Registry.open(sqlite_url)
    tenant = new_tenant(registry)
    engine = sqlite_engine_failing_fast(sqlite_url)
    blocker = sqlite3.connect(make_url(sqlite_url).database, isolation_level=None)
    recorder = UsageRecorder(engine, flush_interval_s=0.05, max_backoff_s=0.2, max_pending=30)
    try:
        blocker.execute("BEGIN IMMEDIATE")  # another writer holds the write lock (a long migration, say)
        for rec in records(tenant, 40):
            recorder.record(rec)
        wait_for(lambda: recorder.stats().failed_flushes >= 2, "failed attempts while SQLite is locked")
        stats = recorder.stats()
        # The queue holds max_pending events; the rest were dropped and counted.
        assert (stats.pending, stats.written, stats.dropped) == (30, 0, 10)

        blocker.execute("ROLLBACK")
        assert recorder.flush(timeout=HANG_LIMIT_S)
        assert recorder.stats().written == 30
        assert stored(registry.engine, tenant) == (30, sum(range(30)), 30)
    finally:
        blocker.close()
        recorder.close(timeout=1)
        engine.dispose()
        registry.close()


def test_close_gives_up_after_its_timeout_when_the_database_stays_away(sqlite_url):
    registry = Registry.open(sqlite_url)
    tenant = new_tenant(registry)
    engine = sqlite_engine_failing_fast(sqlite_url)
    blocker = sqlite3.connect(make_url(sqlite_url).database, isolation_level=None)
    recorder = UsageRecorder(engine, flush_interval_s=0.05, max_backoff_s=0.1)
    try:
        blocker.execute("BEGIN IMMEDIATE")
        for rec in records(tenant, 5):
            recorder.record(rec)
        assert recorder.close(timeout=0.5) is False  # returns (does not hang) and says it could not write
        assert recorder.stats().pending == 5 and recorder.stats().written == 0
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
        engine.dispose()
        registry.close()


def test_bad_records_fail_where_they_are_made():
    from loraplex.errors import RequestError

    with pytest.raises(RequestError, match="usage status 'fine'"):
        UsageRecord(tenant_id="t", request_id="r", status="fine")
    with pytest.raises(RequestError, match="prompt_tokens"):
        UsageRecord(tenant_id="t", request_id="r", status="ok", prompt_tokens=-1)
    with pytest.raises(RequestError, match="ttft_ms"):
        UsageRecord(tenant_id="t", request_id="r", status="ok", ttft_ms=float("nan"))
    with pytest.raises(RequestError, match="itl_ms must be a tuple"):
        UsageRecord(tenant_id="t", request_id="r", status="ok", itl_ms=[1.0])


def test_recorder_accepts_an_engine_or_a_registry(sqlite_url):
    registry = Registry.open(sqlite_url)
    try:
        for source in (registry, registry.engine):
            with UsageRecorder(source) as recorder:
                assert recorder.stats().pending == 0
        with pytest.raises(TypeError, match="Registry or a SQLAlchemy Engine"):
            UsageRecorder(object())
    finally:
        registry.close()


def test_two_writers_on_one_database_lose_no_histogram_update(db_url):
    """Two recorders with their own engines (as two server processes would have), same tenant, adapter and
    hours: the histogram read-add-write of one never overwrites the other's."""
    registry = Registry.open(db_url)
    tenant = new_tenant(registry)
    other = Registry.open(db_url)
    try:
        one_hour = datetime(2026, 4, 1, 9, tzinfo=UTC)
        recs = [replace(r, created_at=one_hour) for r in records(tenant, 400)]  # one row for all of them
        r1 = UsageRecorder(registry, flush_interval_s=0.001, max_batch=3)
        r2 = UsageRecorder(other, flush_interval_s=0.001, max_batch=3)
        for i, rec in enumerate(recs):
            (r1 if i % 2 else r2).record(rec)
            if i % 40 == 0:
                time.sleep(0.002)  # let both threads write while more arrive
        assert r1.close(timeout=HANG_LIMIT_S) and r2.close(timeout=HANG_LIMIT_S)
        with registry.engine.connect() as conn:
            blobs = conn.execute(text("SELECT ttft_hist FROM latency_hourly WHERE tenant_id = :t"),
                                 {"t": tenant}).scalars().all()
        assert sum(int(decode(b)[1].sum()) for b in blobs) == 400  # every TTFT in the histograms
    finally:
        other.close()
        registry.close()
