"""LocalLimiter: the limiter contract (limiter.py) in process memory, for one server on its own or as the
fallback while Redis is unreachable."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from loraplex.errors import RequestError

from .buckets import Bucket, level_now, seconds_until
from .limiter import CONCURRENCY_RETRY_S, DEFAULT_LEASE_S, MIN_RETRY_S, Limiter, check_acquire, check_release
from .limits import MAX_CONCURRENT, REQUESTS_PER_MINUTE, TOKENS_PER_MINUTE, Decision, TenantLimits, Ticket


class LocalLimiter(Limiter):
    backend = "local"

    def __init__(self, lease_s: float = DEFAULT_LEASE_S, concurrency_retry_s: float = CONCURRENCY_RETRY_S,
                 clock: Callable[[], float] = time.monotonic):
        if not lease_s > 0 or not concurrency_retry_s > 0:
            raise ValueError("lease_s and concurrency_retry_s must be > 0")
        self._lease_s = lease_s
        self._concurrency_retry_s = concurrency_retry_s
        self._clock = clock  # monotonic: a wall-clock step must not refill or drain buckets
        # One lock for all tenants: every critical section is a few dict operations.
        self._lock = threading.Lock()
        self._requests: dict[str, Bucket] = {}
        self._tokens: dict[str, Bucket] = {}
        self._leases: dict[str, dict[str, float]] = {}  # tenant -> request_id -> lease deadline

    def acquire(self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int) -> Decision:
        early = check_acquire(tenant_id, request_id, limits, tokens)
        if early is not None:
            return early
        with self._lock:
            now = self._clock()
            leases = self._live_leases(tenant_id, now)
            if request_id in leases:
                raise RequestError(f"request {request_id!r} of tenant {tenant_id!r} is already admitted")
            # (reason, wait) of each limit that refuses, in tie-break order (see Limiter).
            refusals: list[tuple[str, float]] = []
            if limits.max_concurrent is not None and len(leases) >= limits.max_concurrent:
                refusals.append((MAX_CONCURRENT, self._concurrency_retry_s))
            rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
            requests_level = tokens_level = 0.0
            if rpm is not None:
                requests_level = level_now(self._requests.get(tenant_id), rpm, now)
                if requests_level < 1:
                    refusals.append((REQUESTS_PER_MINUTE, seconds_until(requests_level, 1, rpm)))
            if tpm is not None:
                tokens_level = level_now(self._tokens.get(tenant_id), tpm, now)
                if tokens_level < tokens:
                    refusals.append((TOKENS_PER_MINUTE, seconds_until(tokens_level, tokens, tpm)))
            if refusals:
                # max() keeps the first of equal waits, which is the tie-break order.
                reason, wait = max(refusals, key=lambda r: r[1])
                return Decision.refuse(reason, max(wait, MIN_RETRY_S))
            if rpm is not None:
                self._requests[tenant_id] = Bucket(rpm, requests_level - 1, now)
            if tpm is not None:
                self._tokens[tenant_id] = Bucket(tpm, tokens_level - tokens, now)
            leases[request_id] = now + self._lease_s
        return Decision.admit(Ticket(tenant_id, request_id, tokens, "local"))

    def release(self, ticket: Ticket, tokens_used: int) -> bool:
        refund = check_release(ticket, tokens_used)
        with self._lock:
            now = self._clock()
            leases = self._live_leases(ticket.tenant_id, now)
            if leases.pop(ticket.request_id, None) is None:
                return False
            if not leases:
                del self._leases[ticket.tenant_id]  # keeps the map bounded by tenants with requests running
            bucket = self._tokens.get(ticket.tenant_id)
            if refund and bucket is not None:
                level = level_now(bucket, bucket.capacity, now)
                self._tokens[ticket.tenant_id] = Bucket(bucket.capacity, min(level + refund, bucket.capacity), now)
        return True

    def _live_leases(self, tenant_id: str, now: float) -> dict[str, float]:
        """The tenant's leases with the expired ones dropped (a lost release must not hold a slot forever)."""
        leases = self._leases.setdefault(tenant_id, {})
        for request_id in [r for r, deadline in leases.items() if deadline <= now]:
            del leases[request_id]
        return leases
