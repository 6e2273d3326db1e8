"""The rows that usage and latency reports return (frozen dataclasses: safe to share, easy to serialise)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

Granularity = Literal["hour", "day"]
GRANULARITIES: tuple[str, ...] = ("hour", "day")
BASE_LABEL = "base"  # the adapter column for requests on the base model (adapter_id None)
ALL_LABEL = "all"  # the adapter column when a report is not split by adapter
UNKNOWN_LABEL = "unknown"  # an adapter id with no adapters row (cannot happen while rows are never deleted)


@dataclass(frozen=True)
class UsageRow:
    bucket_start: datetime  # UTC start of the hour or day (a day is 00:00 to 24:00 UTC)
    tenant_id: str
    adapter: str  # the adapter's name; "base": the base model; "all": not split by adapter
    adapter_version: int | None  # None for "base" and "all"
    adapter_id: str | None  # the version's uuid; None for "base" and "all"
    requests: int  # every outcome: ok + cancelled + refused + errors
    ok: int
    cancelled: int
    refused: int
    errors: int
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class LatencyRow:
    """Percentiles in milliseconds, nearest-rank, read from log buckets: within 1% of the exact value
    (see loraplex.metering.histogram); None when the bucket has no such measurement.

    ttft: requests that got a first token (any status); itl: every inter-token gap (token-weighted);
    e2e: requests with status "ok". ttft_within_target_share: among requests with a TTFT and a TTFT
    target, the share with ttft <= target (refusals are not in it: see the usage report's refused)."""

    bucket_start: datetime
    tenant_id: str
    adapter: str
    adapter_version: int | None
    adapter_id: str | None
    requests: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p90: float | None
    itl_p99: float | None
    e2e_p50: float | None
    e2e_p90: float | None
    e2e_p99: float | None
    ttft_within_target_share: float | None


@dataclass(frozen=True)
class LatencyPercentileRow:
    """latency_percentiles' row: any percentiles (e.g. the dashboard's p50/p95/p99), read from the merged
    histograms. ttft, itl and e2e hold one value per requested percentile (milliseconds, None: no such
    measurement); the other fields mean what LatencyRow's do."""

    bucket_start: datetime  # with per_bucket=False: the start of the (widened) range
    tenant_id: str
    adapter: str
    adapter_version: int | None
    adapter_id: str | None
    requests: int
    pcts: tuple[int, ...]
    ttft: tuple[float | None, ...]
    itl: tuple[float | None, ...]
    e2e: tuple[float | None, ...]
    ttft_within_target_share: float | None
