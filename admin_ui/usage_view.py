"""Usage report rows -> what the usage page shows: chart series over every bucket of the range, a table
of the buckets that had requests, totals, and a per-adapter breakdown. Pure: no I/O."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from loraplex.metering.report_types import UsageRow

from .filters import ReportFilter, bucket_label, bucket_starts

COUNTS = ("requests", "ok", "cancelled", "refused", "errors", "prompt_tokens", "completion_tokens")


@dataclass
class Counts:
    requests: int = 0
    ok: int = 0
    cancelled: int = 0
    refused: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, row: UsageRow) -> None:
        for name in COUNTS:
            setattr(self, name, getattr(self, name) + getattr(row, name))


@dataclass
class UsageView:
    rows: list[UsageRow]  # the report rows the filter keeps (what the CSV holds)
    buckets: list[tuple[str, Counts]]  # label, counts: buckets with requests
    total: Counts
    by_adapter: list[tuple[str, int | None, Counts]]  # name, version, counts; most requests first
    adapters: list[str]  # every adapter name in the range (the filter's suggestions)
    charts: dict = field(default_factory=dict)


def matches(row: UsageRow, adapter: str) -> bool:
    return not adapter or row.adapter == adapter


def usage_view(rows: list[UsageRow], f: ReportFilter) -> UsageView:
    kept = [r for r in rows if matches(r, f.adapter)]
    per_bucket: dict[datetime, Counts] = defaultdict(Counts)
    per_adapter: dict[tuple[str, int | None], Counts] = defaultdict(Counts)
    total = Counts()
    for r in kept:
        per_bucket[r.bucket_start].add(r)
        per_adapter[(r.adapter, r.adapter_version)].add(r)
        total.add(r)
    axis = bucket_starts(f)
    labels = [bucket_label(t, f.granularity) for t in axis]
    zero = Counts()
    series = [per_bucket.get(t, zero) for t in axis]
    unit = "hour" if f.granularity == "hour" else "day"
    charts = {
        "requests": {"kind": "bars", "x": labels, "unit": "requests", "title": f"Requests per {unit}",
                     "series": [{"name": "Requests", "values": [c.requests for c in series]}]},
        "tokens": {"kind": "bars", "x": labels, "unit": "tokens", "title": f"Tokens per {unit}",
                   "series": [{"name": "Tokens in (prompt)", "values": [c.prompt_tokens for c in series]},
                              {"name": "Tokens out (completion)", "values": [c.completion_tokens for c in series]}]},
    }
    return UsageView(
        rows=kept,
        buckets=[(bucket_label(t, f.granularity), per_bucket[t]) for t in sorted(per_bucket)],
        total=total,
        by_adapter=sorted(((n, v, c) for (n, v), c in per_adapter.items()),
                          key=lambda item: (-item[2].requests, item[0], item[1] or 0)),
        adapters=sorted({r.adapter for r in rows}),
        charts=charts)


def requests_by_adapter_id(rows: list[UsageRow]) -> dict[str | None, int]:
    """Requests per adapter version id (None: the base model) — the adapters table's last-24-h column."""
    out: dict[str | None, int] = defaultdict(int)
    for r in rows:
        out[r.adapter_id] += r.requests
    return out
