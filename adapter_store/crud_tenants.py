"""Tenants and their API keys: plain functions on a Session (the registry opens the session)."""

from __future__ import annotations

import uuid

from loraplex.errors import RequestError
from sqlalchemy import select
from sqlalchemy.orm import Session

from .api_keys import display_prefix, hash_secret, new_secret
from .cursor import decode_cursor, encode_cursor
from .errors import ConflictError, NotFoundError
from .models import ApiKey, Tenant
from .names import check_name
from .schemas import (
    ROLES,
    TENANT_SETTINGS,
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyPublic,
    Page,
    TenantCreate,
    TenantPublic,
)
from .timeutil import aware, utcnow


def tenant_public(row: Tenant) -> TenantPublic:
    return TenantPublic(id=row.id, name=row.name, ttft_target_ms=row.ttft_target_ms, created_at=aware(row.created_at),
                        requests_per_minute=row.requests_per_minute, tokens_per_minute=row.tokens_per_minute,
                        max_concurrent=row.max_concurrent, share=row.share if row.share is not None else 1.0)


def _check_settings(values: dict) -> dict:
    for name, value in values.items():
        if name not in TENANT_SETTINGS:
            raise RequestError(f"{name!r} is not a tenant setting; settings are {', '.join(TENANT_SETTINGS)}")
        if name == "share":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1000:
                raise RequestError(f"share must be a number in (0, 1000], got {value!r}")
        elif value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise RequestError(f"{name} must be a positive integer or null, got {value!r}")
    return values


def create_tenant(session: Session, data: TenantCreate) -> TenantPublic:
    name = check_name(data.name, "tenant name")
    if session.scalar(select(Tenant.id).where(Tenant.name == name)) is not None:
        raise ConflictError(f"tenant {name!r} already exists")
    settings = _check_settings({k: getattr(data, k) for k in TENANT_SETTINGS})
    row = Tenant(id=str(uuid.uuid4()), name=name, created_at=utcnow(), **settings)
    session.add(row)
    session.flush()
    return tenant_public(row)


def get_tenant(session: Session, tenant_id: str) -> TenantPublic:
    row = session.get(Tenant, tenant_id)
    if row is None:
        raise NotFoundError(f"tenant id {tenant_id!r} does not exist")
    return tenant_public(row)


def get_tenant_by_name(session: Session, name: str) -> TenantPublic:
    row = session.scalar(select(Tenant).where(Tenant.name == name))
    if row is None:
        raise NotFoundError(f"tenant {name!r} does not exist")
    return tenant_public(row)


def update_tenant(session: Session, name: str, changes: dict) -> TenantPublic:
    """Set some of a tenant's settings (TENANT_SETTINGS); fields not given keep their values."""
    _check_settings(changes)
    row = session.scalar(select(Tenant).where(Tenant.name == name))
    if row is None:
        raise NotFoundError(f"tenant {name!r} does not exist")
    for key, value in changes.items():
        setattr(row, key, value)
    session.flush()
    return tenant_public(row)


def list_tenants(session: Session, limit: int = 100, cursor: str | None = None) -> Page[TenantPublic]:
    if limit < 1:
        raise RequestError(f"limit must be at least 1, got {limit}")
    query = select(Tenant).order_by(Tenant.name).limit(limit + 1)
    if cursor is not None:
        (after,) = decode_cursor(cursor, 1)
        query = query.where(Tenant.name > after)
    rows = list(session.scalars(query))
    more = len(rows) > limit
    rows = rows[:limit]
    return Page([tenant_public(r) for r in rows], encode_cursor(rows[-1].name) if more else None)


def api_key_public(row: ApiKey) -> ApiKeyPublic:
    return ApiKeyPublic(id=row.id, tenant_id=row.tenant_id, role=row.role, prefix=row.prefix, label=row.label,
                        created_at=aware(row.created_at), revoked_at=aware(row.revoked_at))


def create_api_key(session: Session, data: ApiKeyCreate, secret: str | None = None) -> ApiKeyCreated:
    """A new key; `secret` lets an operator set the first key from LORAPLEX_OPERATOR_KEY."""
    if data.role not in ROLES:
        raise RequestError(f"role {data.role!r} is not one of {', '.join(ROLES)}")
    if (data.role == "operator") != (data.tenant_id is None):
        raise RequestError("operator keys belong to no tenant; user and admin keys belong to one")
    if data.tenant_id is not None:
        get_tenant(session, data.tenant_id)
    secret = secret or new_secret()
    row = ApiKey(id=str(uuid.uuid4()), tenant_id=data.tenant_id, role=data.role, key_hash=hash_secret(secret),
                 prefix=display_prefix(secret), label=data.label, created_at=utcnow())
    session.add(row)
    session.flush()
    return ApiKeyCreated(key=api_key_public(row), secret=secret)


def authenticate(session: Session, secret: str) -> ApiKeyPublic | None:
    """The live key whose secret this is, or None (unknown or revoked)."""
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_secret(secret)))
    if row is None or row.revoked_at is not None:
        return None
    return api_key_public(row)


def revoke_api_key(session: Session, key_id: str) -> None:
    row = session.get(ApiKey, key_id)
    if row is None:
        raise NotFoundError(f"API key id {key_id!r} does not exist")
    if row.revoked_at is None:
        row.revoked_at = utcnow()


def list_api_keys(session: Session, tenant_id: str | None) -> list[ApiKeyPublic]:
    query = select(ApiKey).where(ApiKey.tenant_id.is_(None) if tenant_id is None else ApiKey.tenant_id == tenant_id)
    return [api_key_public(r) for r in session.scalars(query.order_by(ApiKey.created_at, ApiKey.id))]
