"""Adapter versions in the registry: plain functions on a Session (the registry opens the session).

A row is only ever inserted for a blob that is already written and verified (blob before row);
versions are numbered per (tenant, name) and never reused, and "the adapter" a request names is
its newest ready version.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime

from loraplex.errors import AdapterNotFoundError, RequestError
from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session

from .cursor import decode_cursor, encode_cursor
from .errors import NotFoundError
from .models import Adapter
from .names import check_name
from .schemas import ADAPTER_STATUSES, AdapterCreate, AdapterPublic, Page
from .timeutil import aware, utcnow

LIVE_STATUSES = ("ready", "unhealthy")  # listed and keeping their blob; "deleted" rows do neither


def adapter_public(row: Adapter) -> AdapterPublic:
    return AdapterPublic(
        id=row.id, tenant_id=row.tenant_id, name=row.name, version=row.version,
        base_model_fingerprint=row.base_model_fingerprint, rank=row.rank, alpha=row.alpha,
        target_modules=tuple(t for t in row.target_modules.split(",") if t), dtype=row.dtype,
        size_bytes=row.size_bytes, sha256=row.sha256, storage_key=row.storage_key, status=row.status,
        status_detail=row.status_detail, created_at=aware(row.created_at), last_used_at=aware(row.last_used_at),
    )


def _row(data: AdapterCreate, version: int, now: datetime) -> dict:
    check_name(data.name)
    return dict(
        id=str(uuid.uuid4()), tenant_id=data.tenant_id, name=data.name, version=version,
        base_model_fingerprint=data.base_model_fingerprint, rank=data.rank, alpha=data.alpha,
        target_modules=",".join(data.target_modules), dtype=data.dtype, size_bytes=data.size_bytes,
        sha256=data.sha256, storage_key=data.storage_key, status="ready", status_detail=None,
        created_at=now, last_used_at=None,
    )


def _next_versions(session: Session, tenant_id: str, names: Iterable[str]) -> dict[str, int]:
    names = sorted(set(names))
    latest: dict[str, int] = {}
    for start in range(0, len(names), 500):  # keep IN lists short for every backend
        chunk = names[start:start + 500]
        query = (select(Adapter.name, func.max(Adapter.version))
                 .where(Adapter.tenant_id == tenant_id, Adapter.name.in_(chunk)).group_by(Adapter.name))
        latest.update({name: v for name, v in session.execute(query)})
    return {name: latest.get(name, 0) + 1 for name in names}


def insert_adapters(session: Session, items: Sequence[AdapterCreate]) -> list[AdapterPublic]:
    """Insert new versions (one per item, in order). A concurrent insert of the same name makes the
    flush fail on the unique (tenant, name, version) constraint; the registry retries then."""
    now = utcnow()
    rows: list[Adapter] = []
    by_tenant: dict[str, list[AdapterCreate]] = {}
    for item in items:
        by_tenant.setdefault(item.tenant_id, []).append(item)
    versions: dict[tuple[str, str], int] = {}
    for tenant_id, group in by_tenant.items():
        for name, v in _next_versions(session, tenant_id, (i.name for i in group)).items():
            versions[(tenant_id, name)] = v
    for item in items:
        key = (item.tenant_id, item.name)
        row = Adapter(**_row(item, versions[key], now))
        versions[key] += 1  # two items of one name in one batch get consecutive versions
        rows.append(row)
    session.add_all(rows)
    session.flush()
    return [adapter_public(r) for r in rows]


def get_adapter(session: Session, adapter_id: str) -> AdapterPublic:
    row = session.get(Adapter, adapter_id)
    if row is None:
        raise NotFoundError(f"adapter id {adapter_id!r} does not exist")
    return adapter_public(row)


def resolve(session: Session, tenant_id: str, name: str, fingerprint: str | None = None) -> AdapterPublic:
    """The newest ready version of the tenant's adapter `name` (for this base model, if given)."""
    query = select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name, Adapter.status == "ready")
    if fingerprint is not None:
        query = query.where(Adapter.base_model_fingerprint == fingerprint)
    row = session.scalar(query.order_by(Adapter.version.desc()).limit(1))
    if row is None:
        raise AdapterNotFoundError(f"adapter {name!r} does not exist or has no ready version")
    return adapter_public(row)


def list_adapters(
    session: Session,
    tenant_id: str,
    limit: int = 100,
    cursor: str | None = None,
    statuses: Sequence[str] = LIVE_STATUSES,
    name: str | None = None,
    search: str | None = None,
) -> Page[AdapterPublic]:
    """The tenant's adapter versions ordered by (name, version); keyset-paginated so that page n costs
    the same as page 1 at any size. search: only names containing it (case-insensitive)."""
    if not 1 <= limit <= 1000:
        raise RequestError(f"limit must be between 1 and 1000, got {limit}")
    bad = [s for s in statuses if s not in ADAPTER_STATUSES]
    if bad:
        raise RequestError(f"unknown adapter status {bad[0]!r}; statuses are {', '.join(ADAPTER_STATUSES)}")
    query = select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.status.in_(list(statuses)))
    if name is not None:
        query = query.where(Adapter.name == name)
    if search:
        query = query.where(_name_contains(search))
    if cursor is not None:
        after_name, after_version = decode_cursor(cursor, 2)
        query = query.where(or_(Adapter.name > after_name,
                                and_(Adapter.name == after_name, Adapter.version > after_version)))
    rows = list(session.scalars(query.order_by(Adapter.name, Adapter.version).limit(limit + 1)))
    more = len(rows) > limit
    rows = rows[:limit]
    nxt = encode_cursor(rows[-1].name, rows[-1].version) if more else None
    return Page([adapter_public(r) for r in rows], nxt)


def count_adapters(session: Session, tenant_id: str, statuses: Sequence[str] = LIVE_STATUSES,
                   search: str | None = None) -> int:
    query = select(func.count()).select_from(Adapter).where(Adapter.tenant_id == tenant_id,
                                                            Adapter.status.in_(list(statuses)))
    if search:
        query = query.where(_name_contains(search))
    return int(session.scalar(query) or 0)


def _name_contains(text: str):
    """Adapter.name contains text, case-insensitively, with LIKE's wildcards taken literally."""
    escaped = text.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return func.lower(Adapter.name).like(f"%{escaped}%", escape="\\")


def set_status(session: Session, adapter_id: str, status: str, detail: str | None) -> None:
    if status not in ADAPTER_STATUSES:
        raise RequestError(f"unknown adapter status {status!r}")
    result = session.execute(update(Adapter).where(Adapter.id == adapter_id)
                             .values(status=status, status_detail=detail))
    if result.rowcount == 0:
        raise NotFoundError(f"adapter id {adapter_id!r} does not exist")


def delete_by_name(session: Session, tenant_id: str, name: str) -> int:
    """Mark every live version of the name deleted; returns how many. Rows stay (usage events point at
    them); their blobs become garbage once no live row shares the content."""
    result = session.execute(
        update(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.name == name,
                              Adapter.status.in_(LIVE_STATUSES))
        .values(status="deleted", status_detail="deleted by request")
    )
    if result.rowcount == 0:
        raise AdapterNotFoundError(f"adapter {name!r} does not exist")
    return result.rowcount


def touch_last_used(session: Session, adapter_ids: Iterable[str], when: datetime | None = None) -> None:
    ids = sorted(set(adapter_ids))
    when = when or utcnow()
    for start in range(0, len(ids), 500):
        session.execute(update(Adapter).where(Adapter.id.in_(ids[start:start + 500])).values(last_used_at=when))


def referenced_digests(session: Session, digests: Sequence[str]) -> set[str]:
    """Which of these sha256 digests a live (ready or unhealthy) row points at."""
    found: set[str] = set()
    digests = list(digests)
    for start in range(0, len(digests), 500):
        query = select(Adapter.sha256).where(Adapter.sha256.in_(digests[start:start + 500]),
                                             Adapter.status.in_(LIVE_STATUSES)).distinct()
        found.update(session.scalars(query))
    return found


def live_adapters(session: Session, after_id: str | None, limit: int) -> list[AdapterPublic]:
    """Live rows in id order, a batch at a time (for the scrub that re-verifies every blob)."""
    query = select(Adapter).where(Adapter.status.in_(LIVE_STATUSES))
    if after_id is not None:
        query = query.where(Adapter.id > after_id)
    return [adapter_public(r) for r in session.scalars(query.order_by(Adapter.id).limit(limit))]
