"""UsageRecord: what the server hands to metering when a request ends, whatever its outcome."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from loraplex.adapter_store.schemas import USAGE_STATUSES
from loraplex.errors import RequestError


@dataclass(frozen=True)
class UsageRecord:
    """One request (served, cancelled, refused or failed). Times in milliseconds; None = not measured.

    Which values reach the latency histograms: ttft_ms and itl_ms whatever the status (a cancelled
    request's first token was real), e2e_ms only for status "ok" (a refusal's or a cancellation's
    end-to-end time is not a serving latency). Validated here, at construction, so that a bad record
    fails in the caller's code and never poisons a batch in the writer thread.
    """

    tenant_id: str
    request_id: str
    status: str  # ok | cancelled | refused | error
    reason: str | None = None  # why refused or failed
    adapter_id: str | None = None  # the adapter version's uuid; None = the base model
    api_key_id: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: tuple[float, ...] = ()  # every inter-token gap of the request, in order
    ttft_target_ms: float | None = None  # the tenant's TTFT target when the request ran
    created_at: datetime | None = None  # UTC (a naive time is taken as UTC); None = when recorded

    def __post_init__(self) -> None:
        if self.status not in USAGE_STATUSES:
            raise RequestError(f"usage status {self.status!r} is not one of {', '.join(USAGE_STATUSES)}")
        for name in ("tenant_id", "request_id"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise RequestError(f"usage record {name} must be a non-empty string")
        for name in ("prompt_tokens", "completion_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise RequestError(f"usage record {name} must be an integer >= 0, got {value!r}")
        for name in ("queue_ms", "ttft_ms", "e2e_ms", "ttft_target_ms"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value)):
                raise RequestError(f"usage record {name} must be a finite number or None, got {value!r}")
        if not isinstance(self.itl_ms, tuple):
            raise RequestError(f"usage record itl_ms must be a tuple, got {type(self.itl_ms).__name__}")
        if self.created_at is not None and not isinstance(self.created_at, datetime):
            raise RequestError(f"usage record created_at must be a datetime, got {self.created_at!r}")
