"""POST/GET /v1/adapters, GET/DELETE /v1/adapters/{name}: a tenant admin manages its adapters.

Uploads go through the store's validation (the only way adapters enter) on a worker thread. A delete
marks every version deleted: requests in flight keep the copy they hold and finish, new requests get
404, and the engine and host cache drop their copies between two steps.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from loraplex.adapter_store.names import check_name
from loraplex.adapter_store.staging import UploadFile as StoreFile
from loraplex.errors import AdapterError

from .auth import Principal, require, tenant_for
from .errors import bad_request, not_found, unavailable
from .state import ServerState, get_state
from .views import adapter_view

router = APIRouter(tags=["adapters"])


def _store(state: ServerState):
    if state.store is None:
        raise unavailable("the model is still loading; adapters can be managed once it is ready", code="loading")
    return state.store


@router.post("/v1/adapters", status_code=201, summary="Upload a PEFT adapter (files or one .zip/.tar.gz)")
async def upload_adapter(
    request: Request,
    name: Annotated[str, Form(min_length=1, max_length=64)],
    files: Annotated[list[UploadFile], File(description="adapter_config.json + adapter_model.safetensors, "
                                                        "or one archive")],
    tenant: Annotated[str | None, Query(max_length=64, description="operator only")] = None,
    p: Principal = Depends(require("admin")),
):
    state = get_state(request)
    store = _store(state)
    tenant_id = await tenant_for(state, p, tenant)
    try:
        check_name(name)
    except Exception as e:
        raise bad_request(str(e), param="name") from None
    staged = [StoreFile(f.filename or "", f.file) for f in files]
    if not staged:
        raise AdapterError("the upload holds no files")
    ref = await run_in_threadpool(store.upload, tenant_id, name, staged)
    return JSONResponse(adapter_view(ref), status_code=201)


@router.get("/v1/adapters", summary="The tenant's adapter versions, paginated")
async def list_adapters(
    request: Request,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    tenant: Annotated[str | None, Query(max_length=64)] = None,
    p: Principal = Depends(require("admin")),
):
    state = get_state(request)
    tenant_id = await tenant_for(state, p, tenant)
    page = await run_in_threadpool(state.registry.list_adapters, tenant_id, limit, cursor)
    return {"object": "list", "data": [adapter_view(a) for a in page.items], "next_cursor": page.next_cursor}


@router.get("/v1/adapters/{name}", summary="One adapter: its newest version and every live version")
async def get_adapter(request: Request, name: str, tenant: Annotated[str | None, Query(max_length=64)] = None,
                      p: Principal = Depends(require("admin"))):
    state = get_state(request)
    tenant_id = await tenant_for(state, p, tenant)
    page = await run_in_threadpool(state.registry.list_adapters, tenant_id, 1000, None,
                                   ("ready", "unhealthy"), name)
    if not page.items:
        raise not_found(f"adapter {name!r} does not exist", param="name")
    versions = [adapter_view(a) for a in page.items]
    return dict(versions[-1], versions=versions)


@router.delete("/v1/adapters/{name}", summary="Delete every version of an adapter")
async def delete_adapter(request: Request, name: str, tenant: Annotated[str | None, Query(max_length=64)] = None,
                         p: Principal = Depends(require("admin"))):
    state = get_state(request)
    store = _store(state)
    tenant_id = await tenant_for(state, p, tenant)
    count = await run_in_threadpool(store.delete, tenant_id, name)
    bridge = state.bridge
    if state.engine is not None and bridge is not None:
        state.engine.call_soon(lambda: bridge.forget(tenant_id, name))
    return {"id": name, "object": "adapter", "deleted": True, "versions": count}
