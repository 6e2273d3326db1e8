"""Usage and latency reports, read from the hourly rollups only (never from usage_events), so they cost
the same at any number of recorded events: a month of one tenant is ~720 rows per adapter.

Both take (registry_or_engine, tenant_id, start, end, granularity, by_adapter):
- tenant_id None: every tenant (the operator's view); rows always carry their tenant_id, and a
  tenant's rows only ever come from its own rollups;
- [start, end) widened to whole buckets: UTC hours, or UTC days with granularity "day"; at most 31
  days hourly and 366 days daily (report_range.py); bad values raise loraplex.errors.RequestError;
- by_adapter: one row per adapter version (named, "base" for the base model), or one row per bucket
  with adapter "all".
Rows come sorted by bucket, then tenant, then adapter (base first, then by name and version); buckets
without any request are left out.

How: one SELECT of usage_hourly counters per (tenant, adapter, bucket), summed by SQL for days (latency:
LEFT JOIN the latency_hourly or latency_daily row of the same key: its stored percentiles, or, when
adapters merge, its histograms), then numpy: grouping.py merges adapters when not by adapter,
percentiles.py merges histograms and reads percentiles; rows are built in report order. A month of all
tenants hourly is ~4*10^4 rows.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import fields
from datetime import datetime

import numpy as np
from sqlalchemy import (
    BigInteger,
    Connection,
    LargeBinary,
    Select,
    and_,
    bindparam,
    cast,
    false,
    func,
    literal,
    select,
)

from loraplex.adapter_store.models import Adapter, LatencyDaily, LatencyHourly, UsageHourly
from loraplex.errors import RequestError

from .fetch import fetch_all
from .grouping import Groups, group_rows
from .percentiles import group_percentiles
from .report_csv import rows_from_csv, rows_to_csv
from .report_range import ReportRange, hour_start, report_range
from .report_types import (
    ALL_LABEL,
    BASE_LABEL,
    UNKNOWN_LABEL,
    Granularity,
    LatencyPercentileRow,
    LatencyRow,
    UsageRow,
)
from .rollup import METRICS, PCTS
from .source import RegistryOrEngine, engine_of

__all__ = ["usage_report", "latency_report", "latency_percentiles", "rows_to_csv", "rows_from_csv", "UsageRow",
           "LatencyRow", "LatencyPercentileRow"]

_USAGE_SUMS = ("requests", "ok", "cancelled", "refused", "errors", "prompt_tokens", "completion_tokens")
# LatencyHourly/LatencyDaily percentile columns, in LatencyRow order
_PCT_COLUMNS = [f"{m}_p{p}" for m in METRICS for p in PCTS]
_IDS_PER_QUERY = 500
# Rows are built positionally (a month of all tenants is ~4*10^4 rows): pin the field order they rely on.
assert [f.name for f in fields(UsageRow)][5:] == list(_USAGE_SUMS)
assert [f.name for f in fields(LatencyRow)][5:] == ["requests", *_PCT_COLUMNS, "ttft_within_target_share"]


def usage_report(registry_or_engine: RegistryOrEngine, tenant_id: str | None, start: datetime, end: datetime,
                 granularity: Granularity = "day", by_adapter: bool = True) -> list[UsageRow]:
    rng = report_range(start, end, granularity)
    with engine_of(registry_or_engine).connect() as conn:
        rows = fetch_all(conn, _bucket_sums(rng, tenant_id, _USAGE_SUMS))
        if not rows:
            return []
        tenants, adapter_keys, buckets, *counters = zip(*rows)
        groups = group_rows(tenants, adapter_keys, buckets, by_adapter)
        labels = _adapter_labels(conn, groups, by_adapter)
    order = _report_order(groups, labels)
    sums = zip(*[_summed(groups, column)[order].tolist() for column in counters])
    starts = _BucketStarts(rng.bucket_hours)
    return [UsageRow(starts[bucket], tenant, *label, *values)
            for bucket, tenant, label, values in zip(groups.bucket[order].tolist(), groups.tenant[order].tolist(),
                                                     [labels[i] for i in order.tolist()], sums)]


def latency_report(registry_or_engine: RegistryOrEngine, tenant_id: str | None, start: datetime, end: datetime,
                   granularity: Granularity = "day", by_adapter: bool = True) -> list[LatencyRow]:
    rng = report_range(start, end, granularity)
    sums = _bucket_sums(rng, tenant_id, ("requests", "ttft_targeted", "ttft_within")).subquery()
    lat, when = (LatencyHourly, LatencyHourly.epoch_hour) if granularity == "hour" else \
        (LatencyDaily, LatencyDaily.epoch_day)
    same_key = and_(lat.tenant_id == sums.c.tenant_id, when == sums.c.bucket, lat.adapter_key == sums.c.adapter_key)
    if by_adapter:  # one rollup row per report row: its stored percentiles
        values = [getattr(lat, name) for name in _PCT_COLUMNS]
    else:  # adapters merge: their histograms
        values = [func.coalesce(getattr(lat, f"{m}_hist"), literal(b"", LargeBinary)) for m in METRICS]
    query = select(*sums.c, *values).select_from(sums.outerjoin(lat, same_key))
    with engine_of(registry_or_engine).connect() as conn:
        rows = fetch_all(conn, query)
        if not rows:
            return []
        tenants, adapter_keys, buckets, requests, targeted, within, *data = zip(*rows)
        groups = group_rows(tenants, adapter_keys, buckets, by_adapter)
        labels = _adapter_labels(conn, groups, by_adapter)
    order = _report_order(groups, labels)
    if by_adapter:
        row_of_group = np.empty(len(groups), dtype=np.int64)
        row_of_group[groups.row_group] = np.arange(len(rows))
        stored = list(zip(*data))
        percentiles = [stored[i] for i in row_of_group[order].tolist()]
    else:
        percentiles = _nan_to_none(_merged_percentiles(groups, data)[order])
    n_targeted = _summed(groups, targeted)
    share = np.divide(_summed(groups, within), n_targeted, out=np.full(len(groups), np.nan), where=n_targeted > 0)
    starts = _BucketStarts(rng.bucket_hours)
    return [LatencyRow(starts[bucket], tenant, *label, n, *pcts, s)
            for bucket, tenant, label, n, pcts, s in zip(
                groups.bucket[order].tolist(), groups.tenant[order].tolist(), [labels[i] for i in order.tolist()],
                _summed(groups, requests)[order].tolist(), percentiles, _nan_to_none(share[order]))]


def latency_percentiles(registry_or_engine: RegistryOrEngine, tenant_id: str | None, start: datetime,
                        end: datetime, granularity: Granularity = "day", by_adapter: bool = True,
                        pcts: Sequence[int] = (50, 95, 99), per_bucket: bool = True,
                        adapter_ids: Collection[str] | None = None) -> list[LatencyPercentileRow]:
    """latency_report's rows with any percentiles (the rollups store only p50/p90/p99 beside their
    histograms; the dashboard shows p95): always read from the merged histograms, so within the same 1%
    bound. per_bucket=False merges the whole range into one row per (tenant, adapter): the figures of an
    adapter over the range (read from the daily rollups with granularity "day"). adapter_ids: only these
    adapter versions ("" for the base model), e.g. every version of one name merged (by_adapter=False)."""
    pcts = tuple(int(p) for p in pcts)
    if not pcts or any(not 1 <= p <= 100 for p in pcts):
        raise RequestError(f"percentiles must be between 1 and 100, got {pcts}")
    rng = report_range(start, end, granularity)
    sums = _bucket_sums(rng, tenant_id, ("requests", "ttft_targeted", "ttft_within"), adapter_ids).subquery()
    lat, when = (LatencyHourly, LatencyHourly.epoch_hour) if granularity == "hour" else \
        (LatencyDaily, LatencyDaily.epoch_day)
    same_key = and_(lat.tenant_id == sums.c.tenant_id, when == sums.c.bucket, lat.adapter_key == sums.c.adapter_key)
    blobs = [func.coalesce(getattr(lat, f"{m}_hist"), literal(b"", LargeBinary)) for m in METRICS]
    with engine_of(registry_or_engine).connect() as conn:
        rows = fetch_all(conn, select(*sums.c, *blobs).select_from(sums.outerjoin(lat, same_key)))
        if not rows:
            return []
        tenants, adapter_keys, buckets, requests, targeted, within, *data = zip(*rows)
        if not per_bucket:  # one bucket for the whole range
            buckets = (rng.start_hour // rng.bucket_hours,) * len(rows)
        groups = group_rows(tenants, adapter_keys, buckets, by_adapter)
        labels = _adapter_labels(conn, groups, by_adapter)
    order = _report_order(groups, labels)
    values = _nan_to_none(_merged_percentiles(groups, data, pcts)[order])
    n = len(pcts)
    n_targeted = _summed(groups, targeted)
    share = np.divide(_summed(groups, within), n_targeted, out=np.full(len(groups), np.nan), where=n_targeted > 0)
    starts = _BucketStarts(rng.bucket_hours)
    return [LatencyPercentileRow(starts[bucket], tenant, *label, count, pcts, tuple(v[:n]), tuple(v[n:2 * n]),
                                 tuple(v[2 * n:]), s)
            for bucket, tenant, label, count, v, s in zip(
                groups.bucket[order].tolist(), groups.tenant[order].tolist(), [labels[i] for i in order.tolist()],
                _summed(groups, requests)[order].tolist(), values, _nan_to_none(share[order]))]


# -- helpers ---------------------------------------------------------------------------------------------

def _bucket_sums(rng: ReportRange, tenant_id: str | None, columns: tuple[str, ...],
                 adapter_keys: Collection[str] | None = None) -> Select:
    """SELECT tenant_id, adapter_key, bucket, *columns: usage_hourly counters per (tenant, adapter, bucket),
    where bucket is the epoch hour (rows as stored) or the epoch day (SQL sums the day's hours)."""
    u = UsageHourly
    where = [u.epoch_hour >= rng.start_hour, u.epoch_hour < rng.end_hour]
    if tenant_id is not None:
        where.append(u.tenant_id == tenant_id)
    if adapter_keys is not None:  # plain bound parameters: fetch_all cannot run expanding ones
        keys = sorted(adapter_keys)
        where.append(u.adapter_key.in_([bindparam(f"adapter_key_{i}", k) for i, k in enumerate(keys)])
                     if keys else false())
    if rng.granularity == "hour":
        return select(u.tenant_id, u.adapter_key, u.epoch_hour.label("bucket"),
                      *[getattr(u, c) for c in columns]).where(*where)
    day = (u.epoch_hour // 24).label("bucket")  # integer division on both backends (hours are >= 0)
    # CAST: PostgreSQL's SUM(bigint) is a numeric, which would come back as Decimal.
    return (select(u.tenant_id, u.adapter_key, day, *[cast(func.sum(getattr(u, c)), BigInteger).label(c)
                                                      for c in columns])
            .where(*where).group_by(u.tenant_id, u.adapter_key, day))


def _merged_percentiles(groups: Groups, blobs: list[tuple[bytes, ...]], pcts: Sequence[int] = PCTS) -> np.ndarray:
    """[groups, 3 * len(pcts)]: per group, the percentiles (default p50/p90/p99) of ttft, itl, e2e from its
    rows' merged histograms (NaN: none)."""
    # Rows in group order (percentiles.py merges each group's records).
    by_group = np.argsort(groups.row_group, kind="stable")
    row_group, by_group_list = groups.row_group[by_group], by_group.tolist()
    return np.hstack([group_percentiles([metric_blobs[i] for i in by_group_list], row_group, len(groups), pcts)[1]
                      for metric_blobs in blobs])


def _summed(groups: Groups, column: Iterable[int]) -> np.ndarray:
    """Per group, the sum of an integer column (exact: float64 holds integers up to 2**53)."""
    return np.bincount(groups.row_group, weights=column, minlength=len(groups)).astype(np.int64)


def _adapter_labels(conn: Connection, groups: Groups, by_adapter: bool) -> list[tuple]:
    """Per group, (adapter, adapter_version, adapter_id): "all", "base", or the version's name and number
    from the adapters table (deleted versions included: their rows stay, with status "deleted")."""
    if not by_adapter:
        return [(ALL_LABEL, None, None)] * len(groups)
    keys = groups.adapter_key.tolist()
    found: dict[str, tuple] = {"": (BASE_LABEL, None, None)}
    ids = sorted(set(keys) - {""})
    for i in range(0, len(ids), _IDS_PER_QUERY):
        query = select(Adapter.id, Adapter.name, Adapter.version).where(Adapter.id.in_(ids[i:i + _IDS_PER_QUERY]))
        for aid, name, version in conn.execute(query):
            found[aid] = (name, version, aid)
    return [found.get(k) or (UNKNOWN_LABEL, None, k) for k in keys]


def _report_order(groups: Groups, labels: list[tuple]) -> np.ndarray:
    """Group indices sorted by bucket, tenant, then adapter: base first, then by name, version and id."""
    distinct = sorted(set(labels), key=lambda lab: (lab[2] is not None, lab[0], lab[1] or 0, lab[2] or ""))
    rank = {lab: i for i, lab in enumerate(distinct)}
    adapter_rank = np.fromiter((rank[lab] for lab in labels), dtype=np.int64, count=len(labels))
    return np.lexsort((adapter_rank, groups.tenant_rank, groups.bucket))


def _nan_to_none(values: np.ndarray) -> list:
    """float64 array -> (nested) lists with None where NaN (no data)."""
    table = values.astype(object)
    table[np.isnan(values)] = None
    return table.tolist()


class _BucketStarts(dict):
    """bucket (epoch hour or day) -> the UTC datetime it starts at, made once per distinct bucket."""

    def __init__(self, bucket_hours: int):
        super().__init__()
        self._bucket_hours = bucket_hours

    def __missing__(self, bucket: int) -> datetime:
        value = self[bucket] = hour_start(bucket * self._bucket_hours)
        return value
