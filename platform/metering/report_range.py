"""A report's time range, checked: [start, end) widened to whole buckets (UTC hours or UTC days).

The rollups hold whole hours (and whole days), so start is aligned down and end up to the bucket:
granularity "hour" reads 10:20–12:05 as 10:00–13:00; granularity "day" reads it as the whole day,
00:00–24:00, so that every day bucket holds its whole day (a bucket never covers part of its label).
Buckets are labelled by their UTC start. Naive datetimes are taken as UTC.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime

from loraplex.errors import RequestError

from .report_types import GRANULARITIES

# The widest range per granularity: bounds a report's size (hourly buckets × adapters).
MAX_HOURS = {"hour": 31 * 24, "day": 366 * 24}


@dataclass(frozen=True)
class ReportRange:
    granularity: str
    start_hour: int  # epoch hours, inclusive (a multiple of bucket_hours)
    end_hour: int  # epoch hours, exclusive (a multiple of bucket_hours)

    @property
    def bucket_hours(self) -> int:
        return 1 if self.granularity == "hour" else 24


def report_range(start: datetime, end: datetime, granularity: str) -> ReportRange:
    if granularity not in GRANULARITIES:
        raise RequestError(f"granularity must be one of {', '.join(GRANULARITIES)}, got {granularity!r}")
    for name, value in (("start", start), ("end", end)):
        if not isinstance(value, datetime):
            raise RequestError(f"{name} must be a datetime, got {type(value).__name__}")
    start, end = _utc(start), _utc(end)
    if end <= start:
        raise RequestError(f"end ({end.isoformat()}) must be after start ({start.isoformat()})")
    size = 3600 * (1 if granularity == "hour" else 24)
    start_hour = math.floor(start.timestamp() / size) * size // 3600
    end_hour = math.ceil(end.timestamp() / size) * size // 3600
    limit = MAX_HOURS[granularity]
    if end_hour - start_hour > limit:
        hint = "; use granularity=day for longer ranges" if granularity == "hour" else ""
        raise RequestError(f"the range spans {end_hour - start_hour} hours; at most {limit // 24} days are allowed "
                           f"with granularity={granularity}{hint}")
    return ReportRange(granularity=granularity, start_hour=start_hour, end_hour=end_hour)


def hour_start(epoch_hour: int) -> datetime:
    return datetime.fromtimestamp(epoch_hour * 3600, UTC)


def _utc(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
