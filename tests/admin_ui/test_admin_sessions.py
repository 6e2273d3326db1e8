"""Units of the dashboard without a server: the session store's expiry, the guard's helpers, the report
filter and the views built from report rows."""

from __future__ import annotations

from datetime import UTC, date, datetime

from starlette.datastructures import QueryParams

from loraplex.admin_ui.filters import ReportFilter, bucket_starts, parse_filter
from loraplex.admin_ui.guard import safe_next, tokens_match
from loraplex.admin_ui.latency_view import slowest_first
from loraplex.admin_ui.sessions import SessionStore
from loraplex.admin_ui.usage_view import usage_view
from loraplex.api.auth import Principal
from loraplex.metering.report_types import LatencyPercentileRow, UsageRow

ADMIN = Principal(key_id="k1", tenant_id="t1", role="admin")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_sessions_expire_when_idle_and_at_their_max_age():
    clock = Clock()
    store = SessionStore(idle_ttl_s=60, max_age_s=300, clock=clock)
    token, session = store.create(ADMIN, "acme", "lpx_abcdefgh")
    assert store.get(token) is session and len(session.csrf_token) >= 40
    clock.now += 59
    assert store.get(token) is session  # each request refreshes the idle timer
    clock.now += 59
    assert store.get(token) is session
    clock.now += 61
    assert store.get(token) is None  # idle too long
    token, _ = store.create(ADMIN, "acme", "lpx_abcdefgh")
    for _ in range(6):
        clock.now += 50
        assert store.get(token) is not None
    clock.now += 1
    assert store.get(token) is None  # active, but past the max age
    assert len(store) == 0


def test_tokens_are_random_and_dropped_on_sign_out_or_revocation():
    store = SessionStore()
    a, sa = store.create(ADMIN, "acme", "p")
    b, sb = store.create(ADMIN, "acme", "p")
    c, _ = store.create(Principal("k2", "t1", "admin"), "acme", "p")
    assert a != b and sa.csrf_token != sb.csrf_token
    assert store.get("not-a-token") is None and store.get(None) is None and store.get("") is None
    store.drop(a)
    assert store.get(a) is None and store.get(b) is sb
    store.drop_key("k1")  # every session opened with the revoked key
    assert store.get(b) is None and store.get(c) is not None
    assert not any(a in k or b in k for k in store._sessions)  # only hashes are kept


def test_the_store_is_bounded():
    store = SessionStore(max_sessions=3)
    tokens = [store.create(ADMIN, "acme", "p")[0] for _ in range(5)]
    assert len(store) == 3 and store.get(tokens[0]) is None and store.get(tokens[-1]) is not None


def test_guard_helpers():
    assert safe_next("/admin/usage?start=2026-01-01") == "/admin/usage?start=2026-01-01"
    for bad in ("https://evil.example/", "//evil.example/admin/", "/v1/keys", "/admin\\..\\x", "", None):
        assert safe_next(bad) is None
    assert tokens_match("abc", "abc") and not tokens_match("abd", "abc") and not tokens_match("", "")
    assert not tokens_match(None, "abc")


def test_filter_defaults_and_refusals():
    today = date(2026, 5, 10)
    f, problems = parse_filter(QueryParams(""), today)
    assert (f.start, f.end, f.granularity, f.adapter, problems) == (date(2026, 5, 4), today, "day", "", [])
    f, problems = parse_filter(QueryParams("start=2026-05-01&end=2026-05-02&granularity=hour&adapter=bot"), today)
    assert (f.t0, f.t1) == (datetime(2026, 5, 1, tzinfo=UTC), datetime(2026, 5, 3, tzinfo=UTC))
    assert len(bucket_starts(f)) == 48 and f.adapter == "bot" and not problems
    f, problems = parse_filter(QueryParams("start=yesterday&granularity=week"), today)
    assert f.start == date(2026, 5, 4) and f.granularity == "day" and len(problems) == 2
    f, problems = parse_filter(QueryParams("start=2026-05-09&end=2026-05-01"), today)
    assert f.start == date(2026, 5, 4) and "before the start" in problems[0]
    assert "adapter=bot" in ReportFilter(date(2026, 5, 1), date(2026, 5, 2), "day", "bot").query()


def _usage(day: int, adapter: str, version: int | None, requests: int) -> UsageRow:
    return UsageRow(datetime(2026, 5, day, tzinfo=UTC), "t1", adapter, version, f"id-{adapter}-{version}",
                    requests, requests, 0, 0, 0, 10 * requests, 20 * requests)


def test_usage_view_fills_every_bucket_and_filters_by_name():
    f = ReportFilter(date(2026, 5, 1), date(2026, 5, 4))
    rows = [_usage(1, "bot", 1, 2), _usage(1, "base", None, 1), _usage(3, "bot", 2, 4)]
    view = usage_view(rows, f)
    assert view.charts["requests"]["series"][0]["values"] == [3, 0, 4, 0]
    assert view.total.requests == 7 and view.adapters == ["base", "bot"]
    assert [(n, v, c.requests) for n, v, c in view.by_adapter] == [("bot", 2, 4), ("bot", 1, 2), ("base", None, 1)]
    bot = usage_view(rows, ReportFilter(f.start, f.end, "day", "bot"))
    assert bot.total.prompt_tokens == 60 and [label for label, _ in bot.buckets] == ["2026-05-01", "2026-05-03"]
    assert len(bot.rows) == 2


def test_slowest_first_puts_missing_measurements_last():
    def row(name: str, ttft95: float | None, itl95: float | None = None) -> LatencyPercentileRow:
        return LatencyPercentileRow(datetime(2026, 5, 1, tzinfo=UTC), "t1", name, 1, name, 1, (50, 95, 99),
                                    (None, ttft95, None), (None, itl95, None), (None, None, None), None)

    rows = [row("fast", 10.0), row("none", None), row("slow", 90.0), row("tie", 10.0, 5.0)]
    assert [r.adapter for r in slowest_first(rows)] == ["slow", "tie", "fast", "none"]
