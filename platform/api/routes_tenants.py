"""Tenants (operator) and API keys (tenant admin for its own tenant; operator for any)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from loraplex.adapter_store.errors import NotFoundError
from loraplex.adapter_store.schemas import ApiKeyCreate, TenantCreate

from .auth import Principal, require, tenant_for
from .errors import not_found
from .protocol import KeyCreateBody, TenantCreateBody, TenantPatchBody
from .state import get_state
from .views import key_view, tenant_view

router = APIRouter(tags=["tenants and keys"])


@router.post("/v1/tenants", status_code=201, summary="Create a tenant and its first admin key (operator)")
async def create_tenant(body: TenantCreateBody, request: Request, p: Principal = Depends(require("operator"))):
    registry = get_state(request).registry

    def create():
        tenant = registry.create_tenant(TenantCreate(**body.model_dump()))
        key = registry.create_api_key(ApiKeyCreate(tenant_id=tenant.id, role="admin", label="first admin key"))
        return tenant, key

    tenant, key = await run_in_threadpool(create)
    return JSONResponse({"tenant": tenant_view(tenant), "api_key": key.secret,
                         "key": key_view(key.key, tenant.name)}, status_code=201)


@router.get("/v1/tenants", summary="List tenants (operator)")
async def list_tenants(request: Request, limit: Annotated[int, Query(ge=1, le=1000)] = 100,
                       cursor: Annotated[str | None, Query(max_length=512)] = None,
                       p: Principal = Depends(require("operator"))):
    page = await run_in_threadpool(get_state(request).registry.list_tenants, limit, cursor)
    return {"object": "list", "data": [tenant_view(t) for t in page.items], "next_cursor": page.next_cursor}


@router.get("/v1/tenants/{name}", summary="One tenant (operator)")
async def get_tenant(name: str, request: Request, p: Principal = Depends(require("operator"))):
    try:
        tenant = await run_in_threadpool(get_state(request).registry.get_tenant_by_name, name)
    except NotFoundError:
        raise not_found(f"tenant {name!r} does not exist", param="name") from None
    return tenant_view(tenant)


@router.patch("/v1/tenants/{name}", summary="Change a tenant's TTFT target, limits or share (operator)")
async def update_tenant(name: str, body: TenantPatchBody, request: Request,
                        p: Principal = Depends(require("operator"))):
    changes = body.model_dump(exclude_unset=True)
    if changes.get("share", 1.0) is None:
        changes["share"] = 1.0  # null share: back to the default weight
    try:
        tenant = await run_in_threadpool(get_state(request).registry.update_tenant, name, changes)
    except NotFoundError:
        raise not_found(f"tenant {name!r} does not exist", param="name") from None
    request.app.state.inference.forget_tenant(tenant.id)  # applies to the next request, not in 5 s
    return tenant_view(tenant)


@router.post("/v1/keys", status_code=201, summary="Create an API key (shown once)")
async def create_key(body: KeyCreateBody, request: Request, p: Principal = Depends(require("admin"))):
    state = get_state(request)
    tenant_id = await tenant_for(state, p, body.tenant)
    tenant = await run_in_threadpool(state.registry.get_tenant, tenant_id)
    created = await run_in_threadpool(state.registry.create_api_key,
                                      ApiKeyCreate(tenant_id=tenant_id, role=body.role, label=body.label))
    return JSONResponse(dict(key_view(created.key, tenant.name), api_key=created.secret), status_code=201)


@router.get("/v1/keys", summary="The tenant's API keys (prefixes only)")
async def list_keys(request: Request, tenant: Annotated[str | None, Query(max_length=64)] = None,
                    p: Principal = Depends(require("admin"))):
    state = get_state(request)
    tenant_id = await tenant_for(state, p, tenant, required=False)
    keys = await run_in_threadpool(state.registry.list_api_keys, tenant_id)
    name = tenant if p.is_operator else None
    return {"object": "list", "data": [key_view(k, name) for k in keys]}


@router.delete("/v1/keys/{key_id}", summary="Revoke an API key")
async def revoke_key(key_id: str, request: Request, tenant: Annotated[str | None, Query(max_length=64)] = None,
                     p: Principal = Depends(require("admin"))):
    state = get_state(request)
    tenant_id = await tenant_for(state, p, tenant, required=False)
    keys = await run_in_threadpool(state.registry.list_api_keys, tenant_id)
    if not any(k.id == key_id for k in keys):
        raise not_found(f"API key {key_id!r} does not exist", param="key_id")
    await run_in_threadpool(state.registry.revoke_api_key, key_id)
    return {"id": key_id, "object": "api_key", "revoked": True}
