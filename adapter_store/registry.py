"""The registry: one object over the database that hands out dataclasses, one short transaction per call.

Thread-safe (each call opens its own session). The CRUD functions it wraps live in crud_*.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime
from typing import TypeVar

from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from . import crud_adapters, crud_tenants, crud_usage
from .db import make_engine, make_session_factory
from .errors import ConflictError, StoreError
from .schemas import (
    AdapterCreate,
    AdapterPublic,
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyPublic,
    Page,
    TenantCreate,
    TenantPublic,
    UsageEventCreate,
)

T = TypeVar("T")

# Two uploads of one name racing for the same version number: the loser retries with the next one.
_VERSION_RACE_RETRIES = 8


class Registry:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._sessions = make_session_factory(engine)

    @classmethod
    def open(cls, url: str) -> "Registry":
        return cls(make_engine(url))

    def close(self) -> None:
        self.engine.dispose()

    def _tx(self, fn: Callable[[Session], T]) -> T:
        with self._sessions.begin() as session:
            return fn(session)

    # -- tenants and keys ----------------------------------------------------------------------
    def create_tenant(self, data: TenantCreate) -> TenantPublic:
        try:
            return self._tx(lambda s: crud_tenants.create_tenant(s, data))
        except IntegrityError as e:  # a concurrent create of the same name
            raise ConflictError(f"tenant {data.name!r} already exists") from e

    def get_tenant(self, tenant_id: str) -> TenantPublic:
        return self._tx(lambda s: crud_tenants.get_tenant(s, tenant_id))

    def get_tenant_by_name(self, name: str) -> TenantPublic:
        return self._tx(lambda s: crud_tenants.get_tenant_by_name(s, name))

    def update_tenant(self, name: str, changes: dict) -> TenantPublic:
        return self._tx(lambda s: crud_tenants.update_tenant(s, name, changes))

    def ensure_tenant(self, name: str) -> TenantPublic:
        try:
            return self.create_tenant(TenantCreate(name=name))
        except ConflictError:
            return self.get_tenant_by_name(name)

    def list_tenants(self, limit: int = 100, cursor: str | None = None) -> Page[TenantPublic]:
        return self._tx(lambda s: crud_tenants.list_tenants(s, limit, cursor))

    def create_api_key(self, data: ApiKeyCreate, secret: str | None = None) -> ApiKeyCreated:
        return self._tx(lambda s: crud_tenants.create_api_key(s, data, secret))

    def authenticate(self, secret: str) -> ApiKeyPublic | None:
        return self._tx(lambda s: crud_tenants.authenticate(s, secret))

    def revoke_api_key(self, key_id: str) -> None:
        self._tx(lambda s: crud_tenants.revoke_api_key(s, key_id))

    def list_api_keys(self, tenant_id: str | None) -> list[ApiKeyPublic]:
        return self._tx(lambda s: crud_tenants.list_api_keys(s, tenant_id))

    # -- adapters ------------------------------------------------------------------------------
    def add_adapter(self, data: AdapterCreate) -> AdapterPublic:
        """Register a new version whose blob is already stored and verified."""
        return self.add_adapters([data])[0]

    def add_adapters(self, items: Sequence[AdapterCreate]) -> list[AdapterPublic]:
        """Register many versions in one transaction (bulk import); all or none."""
        for attempt in range(_VERSION_RACE_RETRIES):
            try:
                return self._tx(lambda s: crud_adapters.insert_adapters(s, items))
            except IntegrityError as e:
                if attempt == _VERSION_RACE_RETRIES - 1 or not _is_version_race(e):
                    raise StoreError(f"cannot register adapters: {e.orig}") from e
        raise AssertionError("unreachable")

    def get_adapter(self, adapter_id: str) -> AdapterPublic:
        return self._tx(lambda s: crud_adapters.get_adapter(s, adapter_id))

    def resolve(self, tenant_id: str, name: str, fingerprint: str | None = None) -> AdapterPublic:
        return self._tx(lambda s: crud_adapters.resolve(s, tenant_id, name, fingerprint))

    def list_adapters(self, tenant_id: str, limit: int = 100, cursor: str | None = None,
                      statuses: Sequence[str] = crud_adapters.LIVE_STATUSES,
                      name: str | None = None, search: str | None = None) -> Page[AdapterPublic]:
        """search: only names containing it, case-insensitively (the dashboard's search box)."""
        return self._tx(lambda s: crud_adapters.list_adapters(s, tenant_id, limit, cursor, statuses, name, search))

    def count_adapters(self, tenant_id: str, search: str | None = None) -> int:
        return self._tx(lambda s: crud_adapters.count_adapters(s, tenant_id, search=search))

    def mark_unhealthy(self, adapter_id: str, detail: str) -> None:
        self._tx(lambda s: crud_adapters.set_status(s, adapter_id, "unhealthy", detail))

    def mark_ready(self, adapter_id: str) -> None:
        self._tx(lambda s: crud_adapters.set_status(s, adapter_id, "ready", None))

    def delete_adapter(self, tenant_id: str, name: str) -> int:
        return self._tx(lambda s: crud_adapters.delete_by_name(s, tenant_id, name))

    def touch_last_used(self, adapter_ids: Iterable[str], when: datetime | None = None) -> None:
        self._tx(lambda s: crud_adapters.touch_last_used(s, adapter_ids, when))

    def referenced_digests(self, digests: Sequence[str]) -> set[str]:
        return self._tx(lambda s: crud_adapters.referenced_digests(s, digests))

    def iter_live_adapters(self, batch: int = 500) -> Iterator[AdapterPublic]:
        after: str | None = None
        while True:
            rows = self._tx(lambda s, after=after: crud_adapters.live_adapters(s, after, batch))
            yield from rows
            if len(rows) < batch:
                return
            after = rows[-1].id

    # -- usage ---------------------------------------------------------------------------------
    def record_usage(self, events: Sequence[UsageEventCreate]) -> int:
        """Raw rows only, without the hourly rollups that reports read: the server records usage through
        loraplex.metering.UsageRecorder instead (kept for bulk imports of raw history)."""
        return self._tx(lambda s: crud_usage.record_usage(s, events))


def _is_version_race(e: IntegrityError) -> bool:
    text = str(e.orig).lower()
    return "uq_adapters_tenant_id_name_version" in text or "adapters.tenant_id, adapters.name" in text
