"""LocalLimiter on a hand-moved clock: exact budgets and retry_after values."""

import threading

import pytest

from loraplex.admission import LocalLimiter, TenantLimits
from loraplex.errors import RequestError


def test_requests_per_minute_bucket(clock):
    limiter = LocalLimiter(clock=clock)
    limits = TenantLimits(requests_per_minute=3)
    assert all(limiter.acquire("t", f"r{i}", limits, 0).allowed for i in range(3))  # a full minute's burst
    refused = limiter.acquire("t", "r3", limits, 0)
    assert (refused.allowed, refused.reason) == (False, "requests_per_minute")
    assert refused.retry_after_s == pytest.approx(20.0)  # one request refills in 60/3 s
    clock.advance(19.5)
    assert limiter.acquire("t", "r3", limits, 0).retry_after_s == pytest.approx(0.5)
    clock.advance(0.5)
    assert limiter.acquire("t", "r3", limits, 0).allowed
    assert not limiter.acquire("t", "r4", limits, 0).allowed


def test_tokens_per_minute_reserve_and_refund(clock):
    limiter = LocalLimiter(clock=clock)
    limits = TenantLimits(tokens_per_minute=1000)
    first = limiter.acquire("t", "a", limits, 600)
    assert first.allowed and first.ticket.tokens_reserved == 600
    refused = limiter.acquire("t", "b", limits, 600)
    assert refused.reason == "tokens_per_minute"
    assert refused.retry_after_s == pytest.approx(12.0)  # 200 missing at 1000/60 per s
    assert limiter.release(first.ticket, tokens_used=100)  # 500 unused come back: level 900
    assert limiter.acquire("t", "b", limits, 600).allowed
    assert limiter.acquire("t", "c", limits, 300).allowed
    assert limiter.acquire("t", "d", limits, 1).reason == "tokens_per_minute"


def test_refund_never_exceeds_capacity(clock):
    limiter = LocalLimiter(clock=clock)
    limits = TenantLimits(tokens_per_minute=1000)
    ticket = limiter.acquire("t", "a", limits, 500).ticket
    clock.advance(60)  # refilled to full meanwhile
    assert limiter.release(ticket, tokens_used=0)
    assert limiter.acquire("t", "b", limits, 1000).allowed
    assert limiter.acquire("t", "c", limits, 1).retry_after_s == pytest.approx(0.06)


def test_release_acts_once(clock):
    limiter = LocalLimiter(clock=clock)
    limits = TenantLimits(tokens_per_minute=100, max_concurrent=1)
    ticket = limiter.acquire("t", "a", limits, 100).ticket
    assert limiter.release(ticket, tokens_used=0)
    assert not limiter.release(ticket, tokens_used=0)  # no second refund
    assert limiter.acquire("t", "b", limits, 100).allowed
    assert limiter.acquire("t", "c", limits, 1).reason in ("tokens_per_minute", "max_concurrent")


def test_request_larger_than_tokens_per_minute(clock):
    limiter = LocalLimiter(clock=clock)
    limits = TenantLimits(requests_per_minute=1, tokens_per_minute=1000)
    refused = limiter.acquire("t", "big", limits, 1001)
    assert (refused.reason, refused.retry_after_s) == ("request_too_large", float("inf"))
    assert limiter.acquire("t", "ok", limits, 1000).allowed  # the refusal took nothing


def test_max_concurrent(clock):
    limiter = LocalLimiter(clock=clock, concurrency_retry_s=0.5)
    limits = TenantLimits(max_concurrent=2)
    a, b = (limiter.acquire("t", r, limits, 0) for r in "ab")
    assert a.allowed and b.allowed
    refused = limiter.acquire("t", "c", limits, 0)
    assert (refused.reason, refused.retry_after_s) == ("max_concurrent", 0.5)
    assert limiter.acquire("other", "c", limits, 0).allowed  # tenants are independent
    limiter.release(a.ticket, 0)
    assert limiter.acquire("t", "c", limits, 0).allowed


def test_refusal_takes_nothing(clock):
    limiter = LocalLimiter(clock=clock)
    limits = TenantLimits(requests_per_minute=2, tokens_per_minute=100)
    assert limiter.acquire("t", "a", limits, 60).allowed
    assert limiter.acquire("t", "b", limits, 60).reason == "tokens_per_minute"
    assert limiter.acquire("t", "c", limits, 40).allowed  # the refused request took no request slot
    assert limiter.acquire("t", "d", limits, 0).reason == "requests_per_minute"


def test_reason_is_the_longest_wait(clock):
    limiter = LocalLimiter(clock=clock, concurrency_retry_s=1.0)
    limits = TenantLimits(requests_per_minute=1, tokens_per_minute=600, max_concurrent=1)
    assert limiter.acquire("t", "a", limits, 600).allowed
    refused = limiter.acquire("t", "b", limits, 300)
    # Concurrency (1 s), requests (60 s) and tokens (30 s) all refuse: the request can come back in 60 s.
    assert (refused.reason, refused.retry_after_s) == ("requests_per_minute", pytest.approx(60.0))


def test_duplicate_request_id(clock):
    limiter = LocalLimiter(clock=clock)
    assert limiter.acquire("t", "a", TenantLimits(), 1).allowed
    with pytest.raises(RequestError, match="already admitted"):
        limiter.acquire("t", "a", TenantLimits(), 1)
    assert limiter.acquire("other", "a", TenantLimits(), 1).allowed  # request ids are per tenant


def test_leases_expire(clock):
    limiter = LocalLimiter(clock=clock, lease_s=30)
    limits = TenantLimits(max_concurrent=1)
    lost = limiter.acquire("t", "a", limits, 0).ticket  # its holder never releases it
    clock.advance(29.9)
    assert limiter.acquire("t", "b", limits, 0).reason == "max_concurrent"
    clock.advance(0.1)
    assert limiter.acquire("t", "b", limits, 0).allowed
    assert not limiter.release(lost, 0)


def test_lowered_limit_applies_at_once(clock):
    limiter = LocalLimiter(clock=clock)
    assert limiter.acquire("t", "a", TenantLimits(tokens_per_minute=1000), 0).allowed  # full: 1000
    assert limiter.acquire("t", "b", TenantLimits(tokens_per_minute=100), 100).allowed
    assert limiter.acquire("t", "c", TenantLimits(tokens_per_minute=100), 1).reason == "tokens_per_minute"


def test_threads_never_exceed_the_budget(clock):
    limiter = LocalLimiter(clock=clock)  # the clock stands still: no refill at all
    limits = TenantLimits(requests_per_minute=50, tokens_per_minute=5_000, max_concurrent=1000)
    admitted: list[str] = []
    lock = threading.Lock()

    def worker(w: int) -> None:
        for i in range(40):
            decision = limiter.acquire("t", f"{w}-{i}", limits, 150)
            if decision.allowed:
                with lock:
                    admitted.append(decision.ticket.request_id)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(admitted) == 5_000 // 150  # tokens bind before requests: 33 of 320 attempts
