"""The seam's values: TenantLimits validation, Decision invariants, argument checks shared by backends."""

import math

import pytest

from loraplex.admission import UNLIMITED, Decision, LocalLimiter, TenantLimits, Ticket
from loraplex.errors import ConfigError, RequestError


def test_defaults_are_unlimited():
    assert TenantLimits() == UNLIMITED == TenantLimits(None, None, None)


@pytest.mark.parametrize("field", ["requests_per_minute", "tokens_per_minute", "max_concurrent"])
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "10"])
def test_limits_must_be_positive_integers(field, value):
    with pytest.raises(ConfigError, match=field):
        TenantLimits(**{field: value})


def test_limits_accept_positive_integers():
    limits = TenantLimits(requests_per_minute=1, tokens_per_minute=10_000_000, max_concurrent=3)
    assert (limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent) == (1, 10_000_000, 3)


def test_decision_invariants():
    ticket = Ticket("t", "r", 5, "local")
    assert Decision.admit(ticket).allowed
    assert Decision.refuse("requests_per_minute", 2.5).retry_after_s == 2.5
    assert Decision.refuse("request_too_large", math.inf).retry_after_s == math.inf
    with pytest.raises(ValueError):
        Decision(allowed=True)
    with pytest.raises(ValueError):
        Decision(allowed=False, ticket=ticket, reason="x", retry_after_s=1.0)
    with pytest.raises(ValueError):
        Decision.refuse("requests_per_minute", 0.0)
    with pytest.raises(ValueError):
        Decision(allowed=False, retry_after_s=1.0)


@pytest.mark.parametrize("tenant_id, request_id, tokens", [
    ("", "r", 1), ("t", "", 1), (None, "r", 1), ("t", "r", -1), ("t", "r", 1.0), ("t", "r", True),
])
def test_acquire_rejects_malformed_arguments(tenant_id, request_id, tokens):
    with pytest.raises(RequestError):
        LocalLimiter().acquire(tenant_id, request_id, UNLIMITED, tokens)


def test_release_rejects_malformed_arguments():
    limiter = LocalLimiter()
    ticket = limiter.acquire("t", "r", UNLIMITED, 10).ticket
    with pytest.raises(RequestError):
        limiter.release(ticket, -1)
    with pytest.raises(RequestError):
        limiter.release("r", 1)
    assert limiter.release(ticket, 10)
