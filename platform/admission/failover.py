"""FailoverLimiter: Redis-backed limits while Redis answers, in-process limits while it does not.

During an outage each replica enforces every tenant's limits on its own, so a fleet of N replicas may
admit up to N times a tenant's budget until Redis is back: serving on is chosen over refusing everyone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from .limiter import Limiter, check_release
from .limits import Backend, Decision, TenantLimits, Ticket
from .local import LocalLimiter
from .redis_limiter import UNREACHABLE_ERRORS, RedisLimiter

log = logging.getLogger("loraplex.admission")

# Releases of Redis tickets that could not reach Redis, replayed when it answers again so that their
# concurrency slots free at once instead of after lease_s. Bounded: past it the oldest are forgotten and
# their leases simply expire.
MAX_PENDING_RELEASES = 10_000


@dataclass(frozen=True)
class LimiterStatus:
    """What /ready and /metrics report about admission's backend."""

    backend: Backend  # the backend that admits new requests now
    redis_configured: bool
    redis_ok: bool  # Redis answered the last call or probe (False when not configured)
    last_error: str | None  # the last Redis failure, kept after recovery for diagnosis
    since: float  # Unix time at which `backend` took over


class FailoverLimiter(Limiter):
    def __init__(self, redis_limiter: RedisLimiter | None, local_limiter: LocalLimiter,
                 probe_interval_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        if not probe_interval_s > 0:
            raise ValueError("probe_interval_s must be > 0")
        self._redis = redis_limiter
        self._local = local_limiter
        self._probe_interval_s = probe_interval_s
        self._clock = clock
        self._lock = threading.Lock()  # guards the fields below; never held during a Redis call
        self._on_redis = redis_limiter is not None
        self._last_error: str | None = None
        self._since = time.time()
        self._next_probe = 0.0
        self._pending: deque[tuple[Ticket, int]] = deque(maxlen=MAX_PENDING_RELEASES)
        if redis_limiter is not None:
            # Learn at start-up whether Redis is there, so that /ready is right before the first request
            # and a server whose Redis is down still starts (on local limits).
            try:
                redis_limiter.ping()
            except UNREACHABLE_ERRORS as error:
                self._fall_back(error)

    @property
    def backend(self) -> Backend:  # type: ignore[override]  # a property here: it changes at run time
        with self._lock:
            return "redis" if self._on_redis else "local"

    def acquire(self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int) -> Decision:
        if self._redis is not None and self._redis_usable():
            try:
                return self._redis.acquire(tenant_id, request_id, limits, tokens)
            except UNREACHABLE_ERRORS as error:
                self._fall_back(error)
        return self._local.acquire(tenant_id, request_id, limits, tokens)

    def release(self, ticket: Ticket, tokens_used: int) -> bool:
        # The backend that admitted a request holds its lease and reservation: release goes there, even
        # after a switch (a local ticket released to Redis would free someone else's budget).
        if ticket.backend == "local":
            return self._local.release(ticket, tokens_used)
        check_release(ticket, tokens_used)
        with self._lock:
            on_redis = self._on_redis
        if self._redis is None:
            return False  # not a ticket of ours: there is no Redis to hold it
        if not on_redis:
            self._keep_for_replay(ticket, tokens_used)  # quietly: the outage was logged once already
            return False
        try:
            return self._redis.release(ticket, tokens_used)
        except UNREACHABLE_ERRORS as error:
            self._fall_back(error)
            self._keep_for_replay(ticket, tokens_used)
            return False

    def status(self) -> LimiterStatus:
        """The current backend; probes Redis first if it is down and a probe is due (at most one per interval).

        A probe can take up to twice RedisLimiter's timeout_s, so call this off the event loop's hot path.
        """
        if self._redis is not None:
            self._redis_usable()
        with self._lock:
            return LimiterStatus(backend="redis" if self._on_redis else "local",
                                 redis_configured=self._redis is not None, redis_ok=self._on_redis,
                                 last_error=self._last_error, since=self._since)

    def _redis_usable(self) -> bool:
        """True when on Redis. While down, one caller per probe interval pings it and switches back."""
        assert self._redis is not None
        with self._lock:
            if self._on_redis:
                return True
            now = self._clock()
            if now < self._next_probe:
                return False
            # Claim this probe before pinging, so that concurrent callers carry on locally instead.
            self._next_probe = now + self._probe_interval_s
        try:
            self._redis.ping()
        except UNREACHABLE_ERRORS as error:
            with self._lock:
                self._last_error = _describe(error)
            log.debug("Redis limiter still unreachable: %s", self._last_error)
            return False
        with self._lock:
            if not self._on_redis:
                self._on_redis = True
                self._since = time.time()
                log.warning("Redis limiter reachable again: admitting under shared Redis limits")
        self._replay_pending()
        return True

    def _fall_back(self, error: Exception) -> None:
        with self._lock:
            self._last_error = _describe(error)
            self._next_probe = self._clock() + self._probe_interval_s
            if not self._on_redis:
                return
            self._on_redis = False
            self._since = time.time()
        # Once per outage: every later failure is a probe's, logged at debug level.
        log.warning("Redis limiter unreachable (%s): admitting under in-process limits until it answers",
                    self._last_error)

    def _keep_for_replay(self, ticket: Ticket, tokens_used: int) -> None:
        with self._lock:
            self._pending.append((ticket, tokens_used))

    def _replay_pending(self) -> None:
        assert self._redis is not None
        while True:
            with self._lock:
                if not self._pending:
                    return
                ticket, tokens_used = self._pending.popleft()
            try:
                self._redis.release(ticket, tokens_used)
            except UNREACHABLE_ERRORS as error:
                self._keep_for_replay(ticket, tokens_used)
                self._fall_back(error)
                return


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"
