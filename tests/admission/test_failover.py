"""FailoverLimiter through a real Redis outage: a private redis-server killed (or frozen) and restarted."""

import logging
import time

from loraplex.admission import FailoverLimiter, LocalLimiter, RedisLimiter, TenantLimits


def wait_for(condition, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_without_redis_it_is_local():
    limiter = FailoverLimiter(None, LocalLimiter())
    status = limiter.status()
    assert (status.backend, status.redis_configured, status.redis_ok) == ("local", False, False)
    assert status.last_error is None
    decision = limiter.acquire("t", "a", TenantLimits(max_concurrent=1), 5)
    assert decision.ticket.backend == "local"
    assert limiter.acquire("t", "b", TenantLimits(max_concurrent=1), 5).reason == "max_concurrent"
    assert limiter.release(decision.ticket, 5)


def test_outage_falls_back_to_local_and_returns(redis_process, caplog):
    limiter = FailoverLimiter(RedisLimiter(redis_process.url, timeout_s=0.5), LocalLimiter(), probe_interval_s=0.2)
    limits = TenantLimits(requests_per_minute=1000, max_concurrent=2)
    assert limiter.status().backend == "redis" and limiter.status().redis_ok
    before = limiter.acquire("t", "before", limits, 10)
    assert before.ticket.backend == "redis"
    client = redis_process.client()
    assert client.zrange("loraplex:limits:{t}:leases", 0, -1) == [b"before"]
    client.close()

    redis_process.kill()
    caplog.set_level(logging.DEBUG, logger="loraplex.admission")
    during = [limiter.acquire("t", f"during-{i}", limits, 10) for i in range(2)]
    assert all(d.allowed and d.ticket.backend == "local" for d in during)
    # Local limits hold meanwhile: two running locally, the third is refused.
    assert limiter.acquire("t", "during-2", limits, 10).reason == "max_concurrent"
    status = limiter.status()
    assert (status.backend, status.redis_configured, status.redis_ok) == ("local", True, False)
    assert status.last_error
    assert not limiter.release(before.ticket, 10)  # Redis is away: dropped quietly, its lease will expire
    assert limiter.release(during[0].ticket, 10)
    for i in range(20):  # serving goes on locally (one slot left beside during-1)
        decision = limiter.acquire("t", f"more-{i}", limits, 10)
        assert decision.allowed and decision.ticket.backend == "local"
        assert limiter.release(decision.ticket, 10)
    outage_warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "unreachable" in r.getMessage()]
    assert len(outage_warnings) == 1  # logged once per outage, not per request or probe

    redis_process.start()
    assert wait_for(lambda: limiter.status().backend == "redis")
    status = limiter.status()
    assert status.redis_ok and status.since > 0
    after = limiter.acquire("t", "after", limits, 10)
    assert after.ticket.backend == "redis"
    assert limiter.release(during[1].ticket, 10)  # a local ticket still goes to the local limiter
    assert limiter.release(after.ticket, 10)


def test_probes_at_most_once_per_interval(redis_process, clock):
    limiter = FailoverLimiter(RedisLimiter(redis_process.url, timeout_s=0.5), LocalLimiter(),
                              probe_interval_s=5.0, clock=clock)
    redis_process.kill()
    assert limiter.acquire("t", "a", TenantLimits(), 1).ticket.backend == "local"
    redis_process.start()
    # Redis is back, but no probe is due: requests stay local without touching Redis.
    assert all(limiter.acquire("t", f"b{i}", TenantLimits(), 1).ticket.backend == "local" for i in range(50))
    assert limiter.status().backend == "local"
    clock.advance(5.0)
    assert limiter.acquire("t", "c", TenantLimits(), 1).ticket.backend == "redis"


def test_frozen_redis_times_out_and_pending_releases_replay(redis_process):
    limiter = FailoverLimiter(RedisLimiter(redis_process.url, timeout_s=0.3), LocalLimiter(), probe_interval_s=0.2)
    limits = TenantLimits(max_concurrent=1)
    held = limiter.acquire("t", "held", limits, 0)
    assert held.ticket.backend == "redis"

    redis_process.pause()  # connections stay open, nothing answers: timeouts, not refused connections
    try:
        during = limiter.acquire("t", "during", limits, 0)
        assert during.ticket.backend == "local"
        assert "Timeout" in limiter.status().last_error
        assert not limiter.release(held.ticket, 0)  # kept, to be replayed
        assert limiter.release(during.ticket, 0)
    finally:
        redis_process.resume()

    # Redis kept its state; the replayed release frees "held"'s slot at once (no waiting for lease_s).
    assert wait_for(lambda: limiter.status().backend == "redis")
    client = redis_process.client()
    assert client.zcard("loraplex:limits:{t}:leases") == 0
    client.close()
    assert limiter.acquire("t", "next", limits, 0).ticket.backend == "redis"


def test_redis_down_at_start(redis_process):
    redis_process.kill()
    limiter = FailoverLimiter(RedisLimiter(redis_process.url, timeout_s=0.5), LocalLimiter(), probe_interval_s=0.2)
    status = limiter.status()
    assert (status.backend, status.redis_ok) == ("local", False)
    assert limiter.acquire("t", "a", TenantLimits(), 1).ticket.backend == "local"
    redis_process.start()
    assert wait_for(lambda: limiter.status().backend == "redis")
