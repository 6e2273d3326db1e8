"""Write one batch of UsageRecords: raw usage_events rows and the hourly rollups, in ONE transaction.

Either the events and their rollups are both committed or neither is, so the reports (rollups) always
equal what the raw events add up to. Counters are upserted in SQL (INSERT .. ON CONFLICT DO UPDATE
SET c = c + excluded.c). Histograms (hourly and daily) are blobs merged in Python (read, add, write
back, with the percentiles read from the merged blob), so writers must not interleave on a row:
- PostgreSQL: a transaction-scoped advisory lock serialises metering writers across processes;
- SQLite: the first statement is the usage_events INSERT, which takes the database's write lock, so
  the later read of the histograms happens under that lock and sees the latest data.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import Connection, Engine, insert, select, text, tuple_
from sqlalchemy.dialects import postgresql, sqlite

from loraplex.adapter_store.models import LatencyDaily, LatencyHourly, UsageEvent, UsageHourly

from . import histogram
from .records import UsageRecord
from .rollup import COUNTERS, METRICS, PCTS, Histograms, RollupKey, rollup

# Any constant shared by every loraplex process ("lpxmeter"); distinct from the migration lock.
_PG_METERING_LOCK = 0x6C70786D65746572
# Keys per SELECT .. WHERE (tenant, hour, adapter) IN (...): 3 bound parameters each.
_KEYS_PER_QUERY = 500
VALUE_COLUMNS = [f"{m}_hist" for m in METRICS] + [f"{m}_p{p}" for m in METRICS for p in PCTS]


def write_batch(engine: Engine, records: Sequence[UsageRecord], now: datetime | None = None) -> int:
    """Insert the records and add them to the rollups; all or nothing. Returns len(records).

    Raises SQLAlchemy's errors as they come (the recorder decides what is transient)."""
    if not records:
        return 0
    batch = rollup(records, now or datetime.now(UTC))
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_METERING_LOCK})
        conn.execute(insert(UsageEvent), batch.events)  # first write (SQLite: takes the write lock)
        _upsert_counters(conn, batch.counters)
        _merge_histograms(conn, LatencyHourly, LatencyHourly.epoch_hour, batch.hourly)
        _merge_histograms(conn, LatencyDaily, LatencyDaily.epoch_day, batch.daily)
    return len(records)


def _insert(conn: Connection):
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


def _upsert_counters(conn: Connection, rows: list[dict]) -> None:
    stmt = _insert(conn)(UsageHourly)
    stmt = stmt.on_conflict_do_update(
        index_elements=[UsageHourly.tenant_id, UsageHourly.epoch_hour, UsageHourly.adapter_key],
        set_={name: getattr(UsageHourly, name) + stmt.excluded[name] for name in COUNTERS})
    conn.execute(stmt, rows)


def _merge_histograms(conn: Connection, table: type[LatencyHourly] | type[LatencyDaily], time_column,
                      batch: Histograms) -> None:
    """Add the batch's histograms to the stored ones and recompute their percentiles (read, merge, write
    back; see the module docstring)."""
    if not batch:
        return
    keys = sorted(batch)
    stored: dict[RollupKey, tuple[bytes, bytes, bytes]] = {}
    key_cols = tuple_(table.tenant_id, time_column, table.adapter_key)
    for i in range(0, len(keys), _KEYS_PER_QUERY):
        query = select(table.tenant_id, time_column, table.adapter_key, table.ttft_hist, table.itl_hist,
                       table.e2e_hist).where(key_cols.in_(keys[i:i + _KEYS_PER_QUERY]))
        for t, when, a, *blobs in conn.execute(query):
            stored[(t, when, a)] = tuple(blobs)
    rows = []
    for key in keys:
        old = stored.get(key, (b"", b"", b""))
        new = batch[key]
        blobs = {}
        for metric, blob in zip(METRICS, old):
            add = new.get(metric)
            if add is not None:
                blob = histogram.merge(blob, add.buckets, add.counts)
            blobs[f"{metric}_hist"] = blob
            blobs.update(zip([f"{metric}_p{p}" for p in PCTS], histogram.percentiles(blob, PCTS)))
        rows.append({"tenant_id": key[0], time_column.key: key[1], "adapter_key": key[2], **blobs})
    stmt = _insert(conn)(table)
    stmt = stmt.on_conflict_do_update(index_elements=[table.tenant_id, time_column, table.adapter_key],
                                      set_={name: stmt.excluded[name] for name in VALUE_COLUMNS})
    conn.execute(stmt, rows)
