"""One batch of UsageRecords → the rows a write adds: raw usage_events rows, hourly counters, and the
batch's own latency histograms per (tenant, hour, adapter key) and per (tenant, day, adapter key).
Pure: no database here.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from .histogram import BUCKET_BITS, buckets_of, nearest_rank
from .records import UsageRecord

# (tenant_id, epoch_hour or epoch_day, adapter_key): one row of usage_hourly / latency_hourly / latency_daily.
RollupKey = tuple[str, int, str]
METRICS = ("ttft", "itl", "e2e")
PCTS = (50, 90, 99)  # the percentiles stored beside each histogram (LatencyHourly.ttft_p50, ...) and reported
COUNTERS = ("requests", "ok", "cancelled", "refused", "errors", "prompt_tokens", "completion_tokens",
            "ttft_count", "ttft_targeted", "ttft_within")
_STATUS_COUNTER = {"ok": "ok", "cancelled": "cancelled", "refused": "refused", "error": "errors"}
# usage_events column widths (longer values are cut, rather than failing the whole batch on PostgreSQL).
_REQUEST_ID_LEN = 128
_REASON_LEN = 255


@dataclass(frozen=True)
class SparseHist:
    """A batch's histogram of one metric: sorted unique buckets and their counts (int64 arrays)."""

    buckets: np.ndarray
    counts: np.ndarray


Histograms = dict[RollupKey, dict[str, SparseHist]]  # key -> metric -> the batch's values


@dataclass(frozen=True)
class BatchRollup:
    events: list[dict]  # usage_events rows, in record order
    counters: list[dict]  # usage_hourly rows, one per key, sorted by key (a stable lock order)
    hourly: Histograms  # keys (tenant, epoch_hour, adapter key)
    daily: Histograms  # keys (tenant, epoch_day, adapter key)


def utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def epoch_hour(value: datetime) -> int:
    """Whole hours since 1970-01-01T00:00Z of an aware time (floor, also before 1970)."""
    return math.floor(value.timestamp() / 3600)


def _itl_summary(gaps: tuple[float, ...]) -> tuple[list[float], dict]:
    """The finite gaps (sorted) and the usage_events summary columns (nearest-rank p50/p99)."""
    s = sorted(gaps)
    total = sum(s)
    if not math.isfinite(total):
        s = [g for g in s if math.isfinite(g)]
        total = sum(s)
    if not s:
        return s, dict(itl_mean_ms=None, itl_p50_ms=None, itl_p99_ms=None, itl_max_ms=None)
    n = len(s)
    return s, dict(itl_mean_ms=total / n, itl_p50_ms=s[nearest_rank(n, 50) - 1],
                   itl_p99_ms=s[nearest_rank(n, 99) - 1], itl_max_ms=s[-1])


def rollup(records: Sequence[UsageRecord], now: datetime) -> BatchRollup:
    events: list[dict] = []
    counters: dict[RollupKey, dict[str, int]] = {}
    hour_index: dict[RollupKey, int] = {}
    day_index: dict[RollupKey, int] = {}
    record_hour: list[int] = []  # per record: index of its hourly key
    record_day: list[int] = []  # ... and of its daily key
    # Every histogram value as flat lists: value, the record it came from, its metric (0 ttft, 1 itl, 2 e2e).
    values: list[float] = []
    owners: list[int] = []
    metrics: list[int] = []
    itl_owners: list[int] = []
    itl_lists: list[list[float]] = []
    for i, rec in enumerate(records):
        created = utc(rec.created_at) if rec.created_at is not None else now
        hour = epoch_hour(created)
        key = (rec.tenant_id, hour, rec.adapter_id or "")
        gaps, itl_columns = _itl_summary(rec.itl_ms)
        events.append(dict(
            tenant_id=rec.tenant_id, adapter_id=rec.adapter_id, api_key_id=rec.api_key_id,
            request_id=rec.request_id[:_REQUEST_ID_LEN], created_at=created, status=rec.status,
            reason=None if rec.reason is None else rec.reason[:_REASON_LEN],
            prompt_tokens=rec.prompt_tokens, completion_tokens=rec.completion_tokens, queue_ms=rec.queue_ms,
            ttft_ms=rec.ttft_ms, e2e_ms=rec.e2e_ms, ttft_target_ms=rec.ttft_target_ms, **itl_columns))

        c = counters.get(key)
        if c is None:
            c = counters[key] = dict.fromkeys(COUNTERS, 0)
        record_hour.append(hour_index.setdefault(key, len(hour_index)))
        record_day.append(day_index.setdefault((key[0], hour // 24, key[2]), len(day_index)))
        c["requests"] += 1
        c[_STATUS_COUNTER[rec.status]] += 1
        c["prompt_tokens"] += rec.prompt_tokens
        c["completion_tokens"] += rec.completion_tokens
        if rec.ttft_ms is not None:
            c["ttft_count"] += 1
            if rec.ttft_target_ms is not None:
                c["ttft_targeted"] += 1
                c["ttft_within"] += rec.ttft_ms <= rec.ttft_target_ms
            values.append(rec.ttft_ms)
            owners.append(i)
            metrics.append(0)
        if gaps:
            itl_owners.append(i)
            itl_lists.append(gaps)
        if rec.e2e_ms is not None and rec.status == "ok":
            values.append(rec.e2e_ms)
            owners.append(i)
            metrics.append(2)

    counter_rows = [dict(tenant_id=k[0], epoch_hour=k[1], adapter_key=k[2], **counters[k]) for k in sorted(counters)]
    # Bucket every value of the batch in one vectorised pass.
    lengths = np.fromiter(map(len, itl_lists), dtype=np.int64, count=len(itl_lists))
    n_itl = int(lengths.sum())
    all_values = np.concatenate([np.asarray(values, dtype=np.float64),
                                 np.fromiter(itertools.chain.from_iterable(itl_lists), dtype=np.float64, count=n_itl)])
    all_owners = np.concatenate([np.asarray(owners, dtype=np.int64),
                                 np.repeat(np.asarray(itl_owners, dtype=np.int64), lengths)])
    all_metrics = np.concatenate([np.asarray(metrics, dtype=np.int64), np.ones(n_itl, dtype=np.int64)])
    buckets = buckets_of(all_values)
    return BatchRollup(
        events=events, counters=counter_rows,
        hourly=_split(list(hour_index), np.asarray(record_hour, dtype=np.int64)[all_owners], all_metrics, buckets),
        daily=_split(list(day_index), np.asarray(record_day, dtype=np.int64)[all_owners], all_metrics, buckets))


def _split(keys: list[RollupKey], key_of_value: np.ndarray, metric_of_value: np.ndarray,
           buckets: np.ndarray) -> Histograms:
    """Count the values' buckets per (key, metric)."""
    out: Histograms = {}
    if not len(buckets):
        return out
    slots = key_of_value * 3 + metric_of_value
    packed, counts = np.unique((slots << BUCKET_BITS) | buckets, return_counts=True)
    slot_of = packed >> BUCKET_BITS
    bucket_of_pair = packed & ((1 << BUCKET_BITS) - 1)
    starts = np.flatnonzero(np.r_[True, slot_of[1:] != slot_of[:-1]])
    ends = np.r_[starts[1:], len(packed)]
    for s, e in zip(starts.tolist(), ends.tolist()):
        slot = int(slot_of[s])
        out.setdefault(keys[slot // 3], {})[METRICS[slot % 3]] = SparseHist(
            buckets=bucket_of_pair[s:e], counts=counts[s:e].astype(np.int64))
    return out
