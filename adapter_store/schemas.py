"""Typed records at the registry's seam: XCreate (what a caller supplies), XPublic (what it gets back).

ORM objects never leave registry.py; callers see these frozen dataclasses, which are safe to pass
between threads and to serialise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, TypeVar

T = TypeVar("T")

ADAPTER_STATUSES = ("ready", "unhealthy", "deleted")
ROLES = ("user", "admin", "operator")
USAGE_STATUSES = ("ok", "cancelled", "refused", "error")


@dataclass(frozen=True)
class TenantCreate:
    name: str
    ttft_target_ms: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    share: float = 1.0


@dataclass(frozen=True)
class TenantPublic:
    id: str
    name: str
    ttft_target_ms: int | None
    created_at: datetime
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    share: float = 1.0


# What an operator may change on a tenant (PATCH semantics: only the fields given).
TENANT_SETTINGS = ("ttft_target_ms", "requests_per_minute", "tokens_per_minute", "max_concurrent", "share")


@dataclass(frozen=True)
class ApiKeyCreate:
    tenant_id: str | None  # None for an operator key
    role: str
    label: str | None = None


@dataclass(frozen=True)
class ApiKeyPublic:
    id: str
    tenant_id: str | None
    role: str
    prefix: str  # the first characters of the key, to tell keys apart; never the whole key
    label: str | None
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True)
class ApiKeyCreated:
    """The only place the clear key ever appears: shown once to whoever created it."""

    key: ApiKeyPublic
    secret: str


@dataclass(frozen=True)
class AdapterCreate:
    """A validated adapter whose blob is already written and verified (blob before row)."""

    tenant_id: str
    name: str
    base_model_fingerprint: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dtype: str
    size_bytes: int
    sha256: str
    storage_key: str


@dataclass(frozen=True)
class AdapterPublic:
    id: str  # the version's uuid: what every cache key holds
    tenant_id: str
    name: str
    version: int
    base_model_fingerprint: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dtype: str
    size_bytes: int
    sha256: str
    storage_key: str
    status: str
    status_detail: str | None
    created_at: datetime
    last_used_at: datetime | None


@dataclass(frozen=True)
class UsageEventCreate:
    tenant_id: str
    request_id: str
    status: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    adapter_id: str | None = None
    api_key_id: str | None = None
    reason: str | None = None
    queue_ms: float | None = None
    ttft_ms: float | None = None
    itl_mean_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    itl_max_ms: float | None = None
    e2e_ms: float | None = None
    created_at: datetime | None = None  # None: now


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a keyset-paginated listing; pass next_cursor back for the next page (None: the end)."""

    items: list[T] = field(default_factory=list)
    next_cursor: str | None = None
