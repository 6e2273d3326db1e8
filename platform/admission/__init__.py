"""Admission: per-tenant rate and concurrency limits, checked before a request reaches the engine.

    limiter = FailoverLimiter(RedisLimiter(url) if url else None, LocalLimiter())   # at server start
    decision = limiter.acquire(tenant_id, request_id, limits, prompt_tokens + max_tokens)
    if not decision.allowed:   # 429, Retry-After: ceil(decision.retry_after_s); counted in metering
        ...                    # (reason request_too_large: retry_after_s is inf, waiting cannot help)
    ...serve...
    limiter.release(decision.ticket, prompt_tokens + completion_tokens)   # whatever the outcome
    limiter.status()           # LimiterStatus for /ready and /metrics

Semantics (the same for every backend; limiter.py states the contract):
- TenantLimits, set per tenant by the operator, None = unlimited: requests_per_minute and
  tokens_per_minute are token buckets of capacity = the per-minute amount, refilled continuously
  (amount/60 per second), so a tenant can burst its whole minute at once and then runs at the rate;
  max_concurrent counts admitted, unreleased requests.
- Tokens are reserved at admission (prompt + max_tokens, the most a request can use) and the unused part
  is refunded at release. A request reserving more than the tenant's tokens_per_minute is refused as
  request_too_large.
- A refusal takes nothing, names the limit (reason) and says when enough budget will be back
  (retry_after_s; for max_concurrent a short fixed hint, since slots free when requests end).
- Concurrency slots are leases that expire (lease_s, default 10 min): a replica that dies mid-request
  cannot hold a tenant's slots forever. A release acts once; after expiry it does nothing.

Backends: LocalLimiter (in-process, thread-safe); RedisLimiter (one atomic Lua script per call, Redis
server time, so that all replicas on one Redis share one budget); FailoverLimiter (Redis while it answers,
LocalLimiter while it does not, probing at most every probe_interval_s; each ticket is released to the
backend that admitted it). During an outage each replica enforces the limits alone.

Files: limits.py (TenantLimits, Ticket, Decision, reasons), limiter.py (the interface, argument checks),
buckets.py (bucket arithmetic), local.py, redis_scripts.py (the Lua), redis_limiter.py, failover.py.
"""

from .failover import FailoverLimiter, LimiterStatus
from .limiter import CONCURRENCY_RETRY_S, DEFAULT_LEASE_S, Limiter
from .limits import (MAX_CONCURRENT, REQUEST_TOO_LARGE, REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE, UNLIMITED, Backend,
                     Decision, TenantLimits, Ticket)
from .local import LocalLimiter
from .redis_limiter import UNREACHABLE_ERRORS, RedisLimiter

__all__ = ["CONCURRENCY_RETRY_S", "DEFAULT_LEASE_S", "MAX_CONCURRENT", "REQUESTS_PER_MINUTE", "REQUEST_TOO_LARGE",
           "TOKENS_PER_MINUTE", "UNLIMITED", "UNREACHABLE_ERRORS", "Backend", "Decision", "FailoverLimiter", "Limiter",
           "LimiterStatus", "LocalLimiter", "RedisLimiter", "TenantLimits", "Ticket"]
