"""Usage and latency reports against the raw events they summarise, on a SQLite file and on PostgreSQL.

Counts and token sums must EQUAL those recomputed from usage_events; percentiles must be within 1% of
the exact nearest-rank percentiles of the raw values (histogram.py states the bound); data is random
and fresh each run (the seed is printed).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from loraplex.adapter_store import TenantCreate
from loraplex.adapter_store.models import LatencyDaily, LatencyHourly
from loraplex.errors import RequestError
from loraplex.metering import (
    LatencyRow,
    UsageRecord,
    UsageRecorder,
    UsageRow,
    latency_percentiles,
    latency_report,
    rows_from_csv,
    rows_to_csv,
    usage_report,
)
from loraplex.metering.histogram import decode, exact_percentile
from metering_data import (
    aligned_hours,
    expected_usage,
    group_key,
    hour_of,
    new_rng,
    random_records,
    raw_events,
    row_key,
)

USAGE_FIELDS = ("requests", "ok", "cancelled", "refused", "errors", "prompt_tokens", "completion_tokens")
BOUND = 0.01  # relative, as documented in loraplex.metering.histogram
HOURS = 80  # a little over three days: several day buckets, the first and last partial


@pytest.fixture
def recorded(registry, fleet):
    """Random usage recorded through the real recorder; returns (records, report start, report end)."""
    rng = new_rng()
    start = datetime(2026, 3, 1, 5, tzinfo=UTC) + timedelta(days=rng.randrange(0, 300))
    records = random_records(rng, fleet, 1500, start, HOURS)
    recorder = UsageRecorder(registry, flush_interval_s=0.05, max_batch=400)
    for rec in records:
        recorder.record(rec)
    assert recorder.close(timeout=120)  # a limit against hangs only
    assert recorder.stats().written == len(records)
    # Not on hour boundaries: the report widens [start, end) to whole hours.
    return records, start + timedelta(minutes=17), start + timedelta(hours=HOURS - 3, minutes=41)


def fleet_rows(rows, fleet):
    ids = {t.id for t in fleet.tenants}
    return [r for r in rows if r.tenant_id in ids]


@pytest.mark.parametrize("granularity", ["hour", "day"])
@pytest.mark.parametrize("by_adapter", [True, False])
def test_usage_report_equals_the_raw_events(registry, fleet, recorded, granularity, by_adapter):
    _, start, end = recorded
    events = raw_events(registry, [t.id for t in fleet.tenants])
    expected = expected_usage(events, aligned_hours(start, end, granularity), granularity, by_adapter)
    assert sum(c["requests"] for c in expected.values()) > 500  # the range holds most of the data

    everyone = fleet_rows(usage_report(registry, None, start, end, granularity, by_adapter), fleet)
    assert {row_key(r): {f: getattr(r, f) for f in USAGE_FIELDS} for r in everyone} == expected
    assert len({row_key(r) for r in everyone}) == len(everyone)

    t0 = fleet.tenants[0]
    mine = usage_report(registry, t0.id, start, end, granularity, by_adapter)
    assert mine == [r for r in everyone if r.tenant_id == t0.id]

    labels = {a.id: (a.name, a.version) for a in fleet.adapters[t0.id] if a is not None}
    for r in mine:
        if not by_adapter:
            assert (r.adapter, r.adapter_id, r.adapter_version) == ("all", None, None)
        elif r.adapter_id is None:
            assert (r.adapter, r.adapter_version) == ("base", None)
        else:
            assert (r.adapter, r.adapter_version) == labels[r.adapter_id]
    assert [r.bucket_start for r in mine] == sorted(r.bucket_start for r in mine)
    unit = timedelta(hours=1 if granularity == "hour" else 24)
    assert all((r.bucket_start - datetime(1970, 1, 1, tzinfo=UTC)) % unit == timedelta(0) for r in mine)


@pytest.mark.parametrize("granularity", ["hour", "day"])
@pytest.mark.parametrize("by_adapter", [True, False])
def test_latency_percentiles_are_within_the_bound_of_the_exact_ones(registry, fleet, recorded, granularity,
                                                                     by_adapter):
    records, start, end = recorded
    itl_of = {r.request_id: r.itl_ms for r in records}  # usage_events keeps only an ITL summary
    values: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    target: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    requests: dict[tuple, int] = defaultdict(int)
    hours = aligned_hours(start, end, granularity)
    for e in raw_events(registry, [t.id for t in fleet.tenants]):
        key = group_key(e, hours, granularity, by_adapter)
        if key is None:
            continue
        requests[key] += 1
        if e["ttft_ms"] is not None:
            values[key]["ttft"].append(e["ttft_ms"])
            if e["ttft_target_ms"] is not None:
                target[key][0] += 1
                target[key][1] += e["ttft_ms"] <= e["ttft_target_ms"]
        if e["e2e_ms"] is not None and e["status"] == "ok":
            values[key]["e2e"].append(e["e2e_ms"])
        values[key]["itl"].extend(itl_of[e["request_id"]])

    rows = fleet_rows(latency_report(registry, None, start, end, granularity, by_adapter), fleet)
    assert {row_key(r): r.requests for r in rows} == dict(requests)
    checked = 0
    for r in rows:
        key = row_key(r)
        for metric in ("ttft", "itl", "e2e"):
            raw = values[key][metric]
            for p in (50, 90, 99):
                got = getattr(r, f"{metric}_p{p}")
                exact = exact_percentile(raw, p)
                if exact is None:
                    assert got is None, (key, metric, p)
                    continue
                assert abs(got - exact) <= BOUND * exact, (key, metric, p, got, exact)
                checked += 1
        n, within = target[key]
        assert r.ttft_within_target_share == (within / n if n else None)
    assert checked > 100


@pytest.mark.parametrize("granularity", ["hour", "day"])
@pytest.mark.parametrize("by_adapter", [True, False])
def test_any_percentiles_agree_with_the_report(registry, fleet, recorded, granularity, by_adapter):
    """latency_percentiles (the dashboard's p50/p95/p99) reads the same histograms: its p50 and p99 equal
    the report's, and p95 lies between them; the rows and counts are the report's."""
    _, start, end = recorded
    t0 = fleet.tenants[0]
    report = latency_report(registry, t0.id, start, end, granularity, by_adapter)
    rows = latency_percentiles(registry, t0.id, start, end, granularity, by_adapter, (50, 95, 99))
    assert [(r.bucket_start, r.adapter_id, r.adapter, r.requests, r.ttft_within_target_share) for r in rows] == \
        [(r.bucket_start, r.adapter_id, r.adapter, r.requests, r.ttft_within_target_share) for r in report]
    for row, want in zip(rows, report):
        for metric in ("ttft", "itl", "e2e"):
            p50, p95, p99 = getattr(row, metric)
            assert (p50, p99) == (getattr(want, f"{metric}_p50"), getattr(want, f"{metric}_p99"))
            if p50 is not None:
                assert p50 <= p95 <= p99


def test_percentiles_over_the_whole_range(registry, fleet, recorded):
    """per_bucket=False: one row per adapter; counts add up, p95 within the bound of the exact one."""
    records, start, end = recorded
    t0 = fleet.tenants[0]
    per_day = latency_percentiles(registry, t0.id, start, end, "day", True)
    whole = latency_percentiles(registry, t0.id, start, end, "day", True, (95,), per_bucket=False)
    assert len({r.adapter_id for r in whole}) == len(whole)
    assert {r.adapter_id: r.requests for r in whole} == {
        a: sum(r.requests for r in per_day if r.adapter_id == a) for a in {r.adapter_id for r in per_day}}
    hours = aligned_hours(start, end, "day")
    ttft: dict[str | None, list[float]] = defaultdict(list)
    for e in raw_events(registry, [t0.id]):
        if group_key(e, hours, "day", True) is not None and e["ttft_ms"] is not None:
            ttft[e["adapter_id"]].append(e["ttft_ms"])
    for r in whole:
        exact = exact_percentile(ttft[r.adapter_id], 95)
        assert (r.ttft[0] is None) if exact is None else abs(r.ttft[0] - exact) <= BOUND * exact
    with pytest.raises(RequestError, match="between 1 and 100"):
        latency_percentiles(registry, t0.id, start, end, "day", True, (0,))
    # Only some adapter versions: the same figures as their own rows; merged, their requests add up.
    some = {r.adapter_id or "" for r in whole[:2]}
    assert latency_percentiles(registry, t0.id, start, end, "day", True, (95,), False, some) == \
        [r for r in whole if (r.adapter_id or "") in some]
    merged = latency_percentiles(registry, t0.id, start, end, "day", False, (95,), False, some)
    assert [r.requests for r in merged] == [sum(r.requests for r in whole if (r.adapter_id or "") in some)]
    assert latency_percentiles(registry, t0.id, start, end, "day", True, adapter_ids=()) == []


@pytest.mark.parametrize("granularity", ["hour", "day"])
def test_stored_and_merged_percentiles_agree(registry, fleet, recorded, granularity):
    """Tenant 2 uses only the base model: by adapter (stored percentiles) and not (merged histograms)
    must give the same numbers."""
    _, start, end = recorded
    t2 = fleet.tenants[2]
    by = latency_report(registry, t2.id, start, end, granularity, True)
    merged = latency_report(registry, t2.id, start, end, granularity, False)
    assert by and [replace(r, adapter="all") for r in by] == merged


def test_hourly_rows_add_up_to_the_daily_rows(registry, fleet, recorded):
    _, start, end = recorded
    t0 = fleet.tenants[0]
    # Over whole days: a daily report covers its days whole, an hourly one only the hours asked for.
    start, end = (datetime.fromtimestamp(h * 3600, UTC) for h in aligned_hours(start, end, "day"))
    sums: dict[tuple, list[int]] = defaultdict(lambda: [0] * len(USAGE_FIELDS))
    for r in usage_report(registry, t0.id, start, end, "hour", True):
        h = hour_of(r.bucket_start)
        for i, f in enumerate(USAGE_FIELDS):
            sums[(r.adapter_id, h - h % 24)][i] += getattr(r, f)
    daily = usage_report(registry, t0.id, start, end, "day", True)
    assert {(r.adapter_id, hour_of(r.bucket_start)): [getattr(r, f) for f in USAGE_FIELDS] for r in daily} == sums
    assert len({r.bucket_start for r in daily}) >= 3


def test_daily_histograms_are_the_sum_of_the_hourly_ones(registry, fleet, recorded):
    ids = [t.id for t in fleet.tenants]
    with registry.engine.connect() as conn:
        hourly = conn.execute(select(LatencyHourly).where(LatencyHourly.tenant_id.in_(ids))).all()
        daily = conn.execute(select(LatencyDaily).where(LatencyDaily.tenant_id.in_(ids))).all()
    summed: dict[tuple, Counter] = defaultdict(Counter)
    for row in hourly:
        for metric in ("ttft", "itl", "e2e"):
            buckets, counts = decode(getattr(row, f"{metric}_hist"))
            summed[(row.tenant_id, row.epoch_hour // 24, row.adapter_key, metric)].update(
                dict(zip(buckets.tolist(), counts.tolist())))
    stored = {}
    for row in daily:
        for metric in ("ttft", "itl", "e2e"):
            buckets, counts = decode(getattr(row, f"{metric}_hist"))
            if len(buckets):
                stored[(row.tenant_id, row.epoch_day, row.adapter_key, metric)] = Counter(
                    dict(zip(buckets.tolist(), counts.tolist())))
    assert stored == {k: v for k, v in summed.items() if v}
    assert sum(sum(c.values()) for k, c in stored.items() if k[3] == "itl") == sum(len(r.itl_ms) for r in recorded[0])


def test_tenants_never_see_each_other(registry, fleet, recorded):
    _, start, end = recorded
    t0, t1, t2 = fleet.tenants
    for tenant in fleet.tenants:
        for report in (usage_report, latency_report):
            for by_adapter in (True, False):
                rows = report(registry, tenant.id, start, end, "day", by_adapter)
                assert rows and {r.tenant_id for r in rows} == {tenant.id}
                own = {a.id for a in fleet.adapters[tenant.id] if a is not None}
                assert {r.adapter_id for r in rows if r.adapter_id} <= own
    # t1 has an adapter named like t0's: its rows name only its own version.
    t1_support = next(a for a in fleet.adapters[t1.id] if a is not None)
    named = [r for r in usage_report(registry, t1.id, start, end, "day", True) if r.adapter == "support"]
    assert named and {r.adapter_id for r in named} == {t1_support.id}
    stranger = registry.create_tenant(TenantCreate(name=f"m-nobody-{t2.id[:8]}"))
    assert usage_report(registry, stranger.id, start, end, "hour", True) == []
    assert latency_report(registry, stranger.id, start, end, "hour", True) == []


def test_deleted_adapters_keep_their_names(registry, fleet):
    t0 = fleet.tenants[0]
    gone = fleet.adapters[t0.id][3]
    assert registry.get_adapter(gone.id).status == "deleted"
    when = datetime(2026, 2, 3, 4, 5, tzinfo=UTC)
    with UsageRecorder(registry) as recorder:
        recorder.record(UsageRecord(tenant_id=t0.id, request_id="late", status="ok", adapter_id=gone.id,
                                    prompt_tokens=3, completion_tokens=2, ttft_ms=5.0, itl_ms=(1.0,),
                                    created_at=when))
    (row,) = usage_report(registry, t0.id, when, when + timedelta(hours=1), "hour", True)
    assert (row.adapter, row.adapter_version, row.adapter_id, row.requests) == ("old-bot", 1, gone.id, 1)


def test_range_is_widened_to_whole_buckets(registry, fleet):
    t2 = fleet.tenants[2]
    h = datetime(2026, 5, 6, 7, tzinfo=UTC)
    times = [h + timedelta(minutes=5), h + timedelta(hours=2, minutes=50), h + timedelta(hours=3, minutes=1)]
    with UsageRecorder(registry) as recorder:
        for i, t in enumerate(times):
            recorder.record(UsageRecord(tenant_id=t2.id, request_id=f"edge-{i}", status="ok", created_at=t))
    # [07:20, 09:05) reads [07:00, 10:00): the 07:05 and 09:50 requests, not the 10:01 one.
    rows = usage_report(registry, t2.id, h + timedelta(minutes=20), h + timedelta(hours=2, minutes=5), "hour", True)
    assert [(r.bucket_start, r.requests) for r in rows] == [(h, 1), (h + timedelta(hours=2), 1)]
    # Days are whole UTC days: a range inside one day reads all of it. Naive datetimes are UTC.
    day = h - timedelta(hours=7)
    for start, end in ((h + timedelta(minutes=20), h + timedelta(minutes=40)),
                       (h.replace(tzinfo=None), (h + timedelta(hours=4)).replace(tzinfo=None))):
        for report in (usage_report, latency_report):
            rows = report(registry, t2.id, start, end, "day", True)
            assert [(r.bucket_start, r.requests) for r in rows] == [(day, 3)]


def test_csv_round_trips(registry, fleet, recorded):
    _, start, end = recorded
    for report, row_type in ((usage_report, UsageRow), (latency_report, LatencyRow)):
        rows = report(registry, None, start, end, "hour", True)
        text = rows_to_csv(rows)
        header = text.splitlines()[0].split(",")
        assert header[:3] == ["bucket_start", "tenant_id", "adapter"] and len(text.splitlines()) == len(rows) + 1
        assert rows_from_csv(text, row_type) == rows
        assert rows_to_csv([], row_type) == ",".join(header) + "\n"
    assert rows_to_csv([]) == ""


@pytest.mark.parametrize("report", [usage_report, latency_report])
def test_bad_input_is_refused_with_a_clear_message(registry, report):
    t = datetime(2026, 1, 1, tzinfo=UTC)
    cases = [
        ((t, t, "hour"), "end .* must be after start"),
        ((t, t - timedelta(hours=1), "day"), "end .* must be after start"),
        ((t, t + timedelta(days=1), "week"), "granularity must be one of hour, day, got 'week'"),
        ((t, t + timedelta(days=32), "hour"), "at most 31 days .* granularity=hour; use granularity=day"),
        ((t, t + timedelta(days=367), "day"), "at most 366 days"),
        (("2026-01-01", t, "day"), "start must be a datetime"),
    ]
    for (start, end, granularity), message in cases:
        with pytest.raises(RequestError, match=message):
            report(registry, None, start, end, granularity, True)
    assert report(registry, None, t, t + timedelta(days=31), "hour", True) == []
