"""The report pages' filter (adapter, date range, granularity), read from the query string.

Dates are whole UTC days, both ends included, as a person reads "from 1 May to 7 May"; the reports take
[start, end), so `end` is the day after the last one. Bad input is never a server error: the page
shows what was wrong and falls back to the default range.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, date, datetime, timedelta
from urllib.parse import urlencode

from starlette.datastructures import QueryParams

DEFAULT_DAYS = 7
GRANULARITIES = ("day", "hour")
MAX_ADAPTER_FILTER = 64  # an adapter name's longest form (adapter_store.names)


@dataclass(frozen=True)
class ReportFilter:
    start: date  # first day, included
    end: date  # last day, included
    granularity: str = "day"
    adapter: str = ""  # "" every adapter; "base" the base model; else an adapter's name

    @property
    def t0(self) -> datetime:
        return datetime(self.start.year, self.start.month, self.start.day, tzinfo=UTC)

    @property
    def t1(self) -> datetime:
        return datetime(self.end.year, self.end.month, self.end.day, tzinfo=UTC) + timedelta(days=1)

    def query(self, **changes: str) -> str:
        f = replace(self, **changes) if changes else self
        params = {"start": f.start.isoformat(), "end": f.end.isoformat(), "granularity": f.granularity}
        if f.adapter:
            params["adapter"] = f.adapter
        return urlencode(params)


def default_filter(today: date | None = None) -> ReportFilter:
    today = today or datetime.now(UTC).date()
    return ReportFilter(start=today - timedelta(days=DEFAULT_DAYS - 1), end=today)


def parse_filter(params: QueryParams, today: date | None = None) -> tuple[ReportFilter, list[str]]:
    """The filter the query string asks for, and the problems found (each falls back to the default)."""
    f = default_filter(today)
    problems: list[str] = []
    start, end = f.start, f.end
    for name in ("start", "end"):
        raw = params.get(name)
        if not raw:
            continue
        try:
            value = date.fromisoformat(raw)
        except ValueError:
            problems.append(f"The {name} date {raw[:40]!r} is not a date (YYYY-MM-DD); showing the default range.")
            continue
        start, end = (value, end) if name == "start" else (start, value)
    if end < start:
        problems.append("The end date is before the start date; showing the default range.")
        start, end = f.start, f.end
    granularity = params.get("granularity") or "day"
    if granularity not in GRANULARITIES:
        problems.append("Granularity must be day or hour; showing days.")
        granularity = "day"
    adapter = (params.get("adapter") or "").strip()[:MAX_ADAPTER_FILTER]
    return ReportFilter(start, end, granularity, adapter), problems


def bucket_starts(f: ReportFilter) -> list[datetime]:
    """Every bucket of the range in order (the charts' x axis; the reports leave out empty buckets)."""
    step = timedelta(hours=1 if f.granularity == "hour" else 24)
    out, t = [], f.t0
    while t < f.t1:
        out.append(t)
        t += step
    return out


def bucket_label(t: datetime, granularity: str) -> str:
    return t.strftime("%Y-%m-%d") if granularity == "day" else t.strftime("%m-%d %H:00")
