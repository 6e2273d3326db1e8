"""RedisLimiter: the limiter contract (limiter.py) with its state in Redis, shared by every replica that
uses the same Redis and key prefix. One acquire or release = one atomic Lua script (redis_scripts.py)."""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from loraplex.errors import RequestError

from . import redis_scripts
from .limiter import CONCURRENCY_RETRY_S, DEFAULT_LEASE_S, MIN_RETRY_S, Limiter, check_acquire, check_release
from .limits import Decision, TenantLimits, Ticket

# The errors that mean "Redis is unreachable", as opposed to a bug or a refused command. FailoverLimiter
# falls back on exactly these.
UNREACHABLE_ERRORS: tuple[type[Exception], ...] = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class RedisLimiter(Limiter):
    backend = "redis"

    def __init__(self, url: str, key_prefix: str = "loraplex:limits:", lease_s: float = DEFAULT_LEASE_S,
                 concurrency_retry_s: float = CONCURRENCY_RETRY_S, timeout_s: float = 1.0):
        if not lease_s > 0 or not concurrency_retry_s > 0 or not timeout_s > 0:
            raise ValueError("lease_s, concurrency_retry_s and timeout_s must be > 0")
        self.url = url
        self.key_prefix = key_prefix
        self._lease_ms = lease_s * 1000
        self._concurrency_retry_ms = concurrency_retry_s * 1000
        # No client-side retries: a retried acquire whose first attempt did run would take the budget twice
        # (or find its own lease and fail), and redis-py's default backoff would stall a request for seconds
        # during an outage. Short timeouts: admission sits on the request path.
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0))
        # register_script runs EVALSHA and reloads the script on NOSCRIPT (e.g. after a Redis restart).
        self._acquire = self._client.register_script(redis_scripts.ACQUIRE)
        self._release = self._client.register_script(redis_scripts.RELEASE)

    def acquire(self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int) -> Decision:
        early = check_acquire(tenant_id, request_id, limits, tokens)
        if early is not None:
            return early
        keys = self._keys(tenant_id)
        reply = self._acquire(keys=[keys["requests"], keys["tokens"], keys["leases"]], args=[
            request_id, tokens, limits.requests_per_minute or 0, limits.tokens_per_minute or 0,
            limits.max_concurrent or 0, self._lease_ms, self._concurrency_retry_ms])
        status = int(reply[0])
        if status == 1:
            return Decision.admit(Ticket(tenant_id, request_id, tokens, "redis"))
        if status == -1:
            raise RequestError(f"request {request_id!r} of tenant {tenant_id!r} is already admitted")
        reason = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        return Decision.refuse(reason, max(float(reply[2]) / 1000, MIN_RETRY_S))

    def release(self, ticket: Ticket, tokens_used: int) -> bool:
        refund = check_release(ticket, tokens_used)
        keys = self._keys(ticket.tenant_id)
        return int(self._release(keys=[keys["tokens"], keys["leases"]], args=[ticket.request_id, refund])) == 1

    def ping(self) -> None:
        """Raise one of UNREACHABLE_ERRORS unless Redis answers.

        Tried twice: after a Redis restart the pool's idle connection is dead, and the first command on it
        fails even though Redis is back (the failure discards it; the second attempt reconnects).
        """
        try:
            self._client.ping()
        except UNREACHABLE_ERRORS:
            self._client.ping()

    def close(self) -> None:
        self._client.close()

    def _keys(self, tenant_id: str) -> dict[str, str]:
        base = f"{self.key_prefix}{{{tenant_id}}}:"
        return {"requests": base + "rpm", "tokens": base + "tpm", "leases": base + "leases"}
