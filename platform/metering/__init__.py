"""Metering: usage events written in batches off the request path, hourly rollups, usage and latency reports.

    recorder = UsageRecorder(registry)                 # at server start; one background writer thread
    recorder.record(UsageRecord(tenant_id=..., request_id=..., status="ok", ...))   # per request, O(1)
    recorder.close(timeout=10)                         # at shutdown: everything recorded is written
    rows = usage_report(registry, tenant_id, start, end, "day", by_adapter=True)
    text = rows_to_csv(rows)

Files: records.py (the record), recorder.py (queue + thread), writer.py (one batch = one transaction:
raw usage_events + rollups), rollup.py (a batch's counters and histograms), histogram.py (the log
bucket scheme and its 1% bound), reports.py (the two reports, and latency_percentiles for any
percentiles, e.g. the dashboard's p95), report_range.py (range checks and alignment), report_types.py
(row types), report_csv.py, grouping.py and percentiles.py (vectorised grouping and histogram merging),
fetch.py (bulk reads), source.py (Registry or Engine). README.md has the invariants.
"""

from .records import UsageRecord
from .recorder import RecorderStats, UsageRecorder
from .report_csv import rows_from_csv, rows_to_csv
from .report_types import LatencyPercentileRow, LatencyRow, UsageRow
from .reports import latency_percentiles, latency_report, usage_report

__all__ = ["LatencyPercentileRow", "LatencyRow", "RecorderStats", "UsageRecord", "UsageRecorder", "UsageRow",
           "latency_percentiles", "latency_report", "rows_from_csv", "rows_to_csv", "usage_report"]
