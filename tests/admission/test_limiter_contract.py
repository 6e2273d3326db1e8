"""The Limiter contract, run on LocalLimiter and on RedisLimiter (real Redis) alike: same answers.

Real time runs here (Redis uses its own clock), so retry_after values are checked within bounds that the
few milliseconds a test takes cannot break.
"""

import time

import pytest

from loraplex.admission import TenantLimits
from loraplex.errors import RequestError


def test_requests_per_minute(make_limiter):
    limiter = make_limiter()
    limits = TenantLimits(requests_per_minute=3)
    assert all(limiter.acquire("t", f"r{i}", limits, 0).allowed for i in range(3))
    refused = limiter.acquire("t", "r3", limits, 0)
    assert refused.reason == "requests_per_minute"
    assert 15.0 < refused.retry_after_s <= 20.0


def test_tokens_reserved_then_refunded(make_limiter):
    limiter = make_limiter()
    limits = TenantLimits(tokens_per_minute=6000)  # refills 100 per second
    first = limiter.acquire("t", "a", limits, 5000)
    assert first.allowed and first.ticket.tokens_reserved == 5000
    refused = limiter.acquire("t", "b", limits, 5000)
    assert refused.reason == "tokens_per_minute"
    assert 30.0 < refused.retry_after_s <= 40.0  # ~4000 missing at 100/s
    assert limiter.release(first.ticket, tokens_used=1000)  # 4000 unused come back
    assert limiter.acquire("t", "b", limits, 5000).allowed
    assert not limiter.release(first.ticket, tokens_used=0)  # once only: no second refund
    assert limiter.acquire("t", "c", limits, 2000).reason == "tokens_per_minute"


def test_refund_capped_at_capacity(make_limiter):
    limiter = make_limiter()
    limits = TenantLimits(tokens_per_minute=1000)
    ticket = limiter.acquire("t", "a", limits, 0).ticket
    assert limiter.release(ticket, 0)  # nothing reserved, nothing to refund: still 1000
    assert limiter.acquire("t", "b", limits, 1000).allowed
    assert limiter.acquire("t", "c", limits, 100).reason == "tokens_per_minute"


def test_request_too_large(make_limiter):
    limiter = make_limiter()
    refused = limiter.acquire("t", "a", TenantLimits(tokens_per_minute=100), 101)
    assert (refused.reason, refused.retry_after_s) == ("request_too_large", float("inf"))


def test_max_concurrent(make_limiter):
    limiter = make_limiter(concurrency_retry_s=0.25)
    limits = TenantLimits(max_concurrent=2)
    a = limiter.acquire("t", "a", limits, 0)
    assert a.allowed and limiter.acquire("t", "b", limits, 0).allowed
    refused = limiter.acquire("t", "c", limits, 0)
    assert (refused.reason, refused.retry_after_s) == ("max_concurrent", 0.25)
    assert limiter.acquire("u", "c", limits, 0).allowed  # another tenant
    assert limiter.release(a.ticket, 0)
    assert limiter.acquire("t", "c", limits, 0).allowed


def test_refusal_takes_nothing_and_reason_is_longest_wait(make_limiter):
    limiter = make_limiter()
    limits = TenantLimits(requests_per_minute=2, tokens_per_minute=100)
    assert limiter.acquire("t", "a", limits, 60).allowed
    assert limiter.acquire("t", "b", limits, 60).reason == "tokens_per_minute"
    assert limiter.acquire("t", "c", limits, 40).allowed
    refused = limiter.acquire("t", "d", limits, 50)  # requests: ~30 s away; tokens: ~30 s away too
    assert refused.reason in ("requests_per_minute", "tokens_per_minute")
    assert 25.0 < refused.retry_after_s <= 30.0
    refused = limiter.acquire("t", "d", TenantLimits(requests_per_minute=2, tokens_per_minute=100, max_concurrent=1), 0)
    assert refused.reason == "requests_per_minute"  # 30 s beats concurrency's 1 s hint


def test_duplicate_request_id(make_limiter):
    limiter = make_limiter()
    assert limiter.acquire("t", "a", TenantLimits(), 1).allowed
    with pytest.raises(RequestError, match="already admitted"):
        limiter.acquire("t", "a", TenantLimits(max_concurrent=5), 1)


def test_lease_expiry(make_limiter):
    limiter = make_limiter(lease_s=0.3)
    limits = TenantLimits(max_concurrent=1)
    lost = limiter.acquire("t", "a", limits, 0).ticket  # never released, as by a crashed replica
    assert limiter.acquire("t", "b", limits, 0).reason == "max_concurrent"
    time.sleep(0.8)  # generous: 0.3 s lease
    assert limiter.acquire("t", "b", limits, 0).allowed
    assert not limiter.release(lost, 0)
