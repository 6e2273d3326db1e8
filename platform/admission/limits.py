"""The values that cross the limiter seam: a tenant's limits, the ticket of an admitted request, a decision."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from loraplex.errors import ConfigError

Backend = Literal["redis", "local"]

# Refusal reasons (Decision.reason). Each names the limit that refused, so that the HTTP layer can say
# which one in its error message and metering can count refusals by cause.
REQUESTS_PER_MINUTE = "requests_per_minute"
TOKENS_PER_MINUTE = "tokens_per_minute"
MAX_CONCURRENT = "max_concurrent"
# The request alone reserves more tokens than the tenant's whole tokens_per_minute: waiting cannot help,
# so its retry_after_s is math.inf (the HTTP layer should answer without a Retry-After).
REQUEST_TOO_LARGE = "request_too_large"


def _check_limit(name: str, value: object) -> None:
    # bool is an int subclass: True would silently mean "1 per minute".
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"tenant limit {name} must be a positive integer or None (unlimited), got {value!r}")


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits, set by the operator. None = unlimited.

    requests_per_minute and tokens_per_minute are token buckets whose capacity is the per-minute
    amount, refilled continuously (capacity / 60 per second); max_concurrent counts admitted requests
    not yet released (leases, see the package docstring).
    """

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        _check_limit("requests_per_minute", self.requests_per_minute)
        _check_limit("tokens_per_minute", self.tokens_per_minute)
        _check_limit("max_concurrent", self.max_concurrent)


UNLIMITED = TenantLimits()


@dataclass(frozen=True)
class Ticket:
    """An admitted request: what release() needs, and which backend holds its lease and reservation."""

    tenant_id: str
    request_id: str
    tokens_reserved: int  # prompt + max_tokens, taken from the tokens bucket at admission
    backend: Backend


@dataclass(frozen=True)
class Decision:
    """acquire()'s answer. allowed ⇔ ticket is set; a refusal has a reason and retry_after_s > 0."""

    allowed: bool
    retry_after_s: float = 0.0  # seconds until enough budget is back (math.inf: never)
    reason: str | None = None
    ticket: Ticket | None = None

    def __post_init__(self) -> None:
        # Checked here so that a backend bug shows up at the seam, not as a 500 in the HTTP layer.
        if self.allowed != (self.ticket is not None):
            raise ValueError("a Decision has a ticket exactly when it is allowed")
        if self.allowed and (self.reason is not None or self.retry_after_s != 0.0):
            raise ValueError("an allowed Decision has no reason and no retry_after_s")
        if not self.allowed and (self.reason is None or not self.retry_after_s > 0 or math.isnan(self.retry_after_s)):
            raise ValueError("a refused Decision needs a reason and a retry_after_s > 0")

    @classmethod
    def admit(cls, ticket: Ticket) -> Decision:
        return cls(allowed=True, ticket=ticket)

    @classmethod
    def refuse(cls, reason: str, retry_after_s: float) -> Decision:
        return cls(allowed=False, retry_after_s=retry_after_s, reason=reason)
