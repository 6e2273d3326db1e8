"""Latency rows (p50/p95/p99 from the metering histograms) -> what the latency page shows: TTFT and
inter-token charts over every bucket of the range, a table per bucket, and the adapters slowest first.
Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraplex.metering.report_types import LatencyPercentileRow

from .filters import ReportFilter, bucket_label, bucket_starts

PCTS = (50, 95, 99)


@dataclass
class LatencyView:
    buckets: list[tuple[str, LatencyPercentileRow]]  # label, row: buckets with requests
    overall: LatencyPercentileRow | None  # the whole range, every selected adapter merged
    adapters: list[LatencyPercentileRow]  # one row per adapter version over the range, slowest first
    charts: dict = field(default_factory=dict)


def slowest_first(rows: list[LatencyPercentileRow]) -> list[LatencyPercentileRow]:
    """By TTFT p95, then inter-token p95, highest first; adapters without a measurement last."""
    def key(r: LatencyPercentileRow) -> tuple:
        ttft, itl = r.ttft[1], r.itl[1]
        return (ttft is None, -(ttft or 0.0), itl is None, -(itl or 0.0), r.adapter, r.adapter_version or 0)

    return sorted(rows, key=key)


def latency_view(series: list[LatencyPercentileRow], overall: list[LatencyPercentileRow],
                 per_adapter: list[LatencyPercentileRow], f: ReportFilter) -> LatencyView:
    by_start = {r.bucket_start: r for r in series}
    axis = bucket_starts(f)
    labels = [bucket_label(t, f.granularity) for t in axis]

    def chart(metric: str, title: str) -> dict:
        return {"kind": "lines", "x": labels, "unit": "ms", "title": title,
                "series": [{"name": f"p{p}", "values": [getattr(by_start[t], metric)[i] if t in by_start else None
                                                        for t in axis]}
                           for i, p in enumerate(PCTS)]}

    return LatencyView(
        buckets=[(bucket_label(r.bucket_start, f.granularity), r) for r in series],
        overall=overall[0] if overall else None,
        adapters=slowest_first(per_adapter),
        charts={"ttft": chart("ttft", "Time to first token (ms)"),
                "itl": chart("itl", "Inter-token latency (ms)")})
