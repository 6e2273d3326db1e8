"""JSON views of registry records (what the API returns for adapters, tenants and keys)."""

from __future__ import annotations

from datetime import datetime

from loraplex.adapter_store.schemas import AdapterPublic, ApiKeyPublic, TenantPublic


def unix(t: datetime | None) -> int | None:
    return None if t is None else int(t.timestamp())


def adapter_view(a: AdapterPublic) -> dict:
    return {"id": a.id, "object": "adapter", "name": a.name, "version": a.version, "rank": a.rank,
            "alpha": a.alpha, "target_modules": list(a.target_modules), "dtype": a.dtype,
            "size_bytes": a.size_bytes, "sha256": a.sha256, "status": a.status, "status_detail": a.status_detail,
            "created_at": unix(a.created_at), "last_used_at": unix(a.last_used_at)}


def tenant_view(t: TenantPublic) -> dict:
    return {"id": t.id, "object": "tenant", "name": t.name, "ttft_target_ms": t.ttft_target_ms,
            "requests_per_minute": t.requests_per_minute, "tokens_per_minute": t.tokens_per_minute,
            "max_concurrent": t.max_concurrent, "share": t.share, "created_at": unix(t.created_at)}


def key_view(k: ApiKeyPublic, tenant_name: str | None = None) -> dict:
    return {"id": k.id, "object": "api_key", "tenant": tenant_name, "role": k.role, "prefix": k.prefix,
            "label": k.label, "created_at": unix(k.created_at), "revoked_at": unix(k.revoked_at)}
