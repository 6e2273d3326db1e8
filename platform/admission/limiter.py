"""The limiter interface, and the argument checks every backend shares."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

from loraplex.errors import RequestError

from .limits import REQUEST_TOO_LARGE, Decision, TenantLimits, Ticket

# How long a refused-for-concurrency caller should wait: a slot frees whenever a running request ends,
# which no budget arithmetic can predict, so the hint is a short fixed time.
CONCURRENCY_RETRY_S = 1.0

# A lease not released within this time is dropped (its holder is taken to have crashed). Longer than any
# request should run; a request that runs longer stops counting against max_concurrent.
DEFAULT_LEASE_S = 600.0

# A refusal's retry_after_s is at least this, so that floating-point remainders never give 0.
MIN_RETRY_S = 0.001


class Limiter(ABC):
    """Per-tenant admission limits: requests/min, tokens/min, concurrent requests.

    Contract (identical for every backend, so that the failover between them changes nothing but scope):
    - acquire() is all-or-nothing: admitted, it takes one request and `tokens` from the buckets and a
      lease under request_id; refused, it takes nothing. Among several limits that refuse, the reason is
      the one with the longest wait (ties: max_concurrent, requests_per_minute, tokens_per_minute), and
      retry_after_s is that wait.
    - release() ends the lease and refunds tokens_reserved - tokens_used (never more than the bucket's
      capacity). It acts once: a second release, or a release after the lease expired, returns False and
      refunds nothing (so a double release can never mint tokens).
    - Leases are kept even for tenants without max_concurrent, so that setting one takes effect on the
      requests already running, and so that a request_id can hold one lease only.
    - Both methods are thread-safe and never block on other tenants' work beyond a short critical section.
    """

    backend: str

    @abstractmethod
    def acquire(self, tenant_id: str, request_id: str, limits: TenantLimits, tokens: int) -> Decision:
        """Admit or refuse one request that will use at most `tokens` (prompt + max_tokens).

        Raises RequestError for malformed arguments or a request_id that already holds a lease.
        """

    @abstractmethod
    def release(self, ticket: Ticket, tokens_used: int) -> bool:
        """The request ended (any outcome): free its lease, refund its unused tokens. True if it held one."""


def check_acquire(tenant_id: str, request_id: str, limits: TenantLimits, tokens: int) -> Decision | None:
    """Validate acquire()'s arguments; a refusal that needs no state (too large for the tenant), or None."""
    for name, value in (("tenant_id", tenant_id), ("request_id", request_id)):
        if not isinstance(value, str) or not value:
            raise RequestError(f"limiter {name} must be a non-empty string, got {value!r}")
    if not isinstance(limits, TenantLimits):
        raise RequestError(f"limiter limits must be a TenantLimits, got {type(limits).__name__}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise RequestError(f"limiter tokens must be an integer >= 0, got {tokens!r}")
    if limits.tokens_per_minute is not None and tokens > limits.tokens_per_minute:
        return Decision.refuse(REQUEST_TOO_LARGE, math.inf)
    return None


def check_release(ticket: Ticket, tokens_used: int) -> int:
    """Validate release()'s arguments; the number of tokens to refund."""
    if not isinstance(ticket, Ticket):
        raise RequestError(f"limiter release needs a Ticket, got {type(ticket).__name__}")
    if isinstance(tokens_used, bool) or not isinstance(tokens_used, int) or tokens_used < 0:
        raise RequestError(f"limiter tokens_used must be an integer >= 0, got {tokens_used!r}")
    # Only the unused part comes back: a request never uses more than it reserved (prompt + max_tokens);
    # if a caller counts more, the reservation was the bound the tenant was charged for.
    return max(0, ticket.tokens_reserved - tokens_used)
