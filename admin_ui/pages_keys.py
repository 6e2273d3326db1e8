"""The tenant's API keys: the list (prefixes only), a new key (its secret shown once, on the answer to the
form, never stored), and revoking one after a confirmation page. Each action runs the API's own route."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import RedirectResponse
from pydantic import ValidationError

from loraplex.api import routes_tenants
from loraplex.api.errors import ApiError
from loraplex.api.protocol import KeyCreateBody

from .api_calls import call
from .guard import COOKIE, PREFIX, TENANT, AdminError, Posted, clear_cookie, posted, session_store, signed_in
from .render import page, with_headers
from .sessions import AdminSession

router = APIRouter()


async def _keys(request: Request, session: AdminSession) -> list[dict]:
    body = await call(routes_tenants.list_keys(request=request, tenant=None, p=session.principal))
    return sorted(body["data"], key=lambda k: (k["revoked_at"] is not None, -(k["created_at"] or 0)))


async def keys_page(request: Request, session: AdminSession, status: int = 200, **context):
    return page(request, "keys.html", session, status, keys=await _keys(request, session),
                revoked=request.query_params.get("revoked"), **context)


@router.get("/keys")
async def keys(request: Request, session: AdminSession = Depends(signed_in(TENANT))):
    return await keys_page(request, session)


@router.post("/keys")
async def create_key(request: Request, ctx: Posted = Depends(posted(TENANT))):
    label = str(ctx.form.get("label") or "").strip() or None
    try:
        body = KeyCreateBody(role=str(ctx.form.get("role") or "user"), label=label)
    except ValidationError as e:
        return await keys_page(request, ctx.session, 400, error=_first_error(e))
    created = await call(routes_tenants.create_key(body=body, request=request, p=ctx.session.principal))
    return await keys_page(request, ctx.session, 201, created=created)


def _first_error(e: ValidationError) -> str:
    first = e.errors()[0]
    field = ".".join(str(p) for p in first.get("loc", ()))
    return f"{field}: {first.get('msg', 'invalid value')}"


async def _key_or_404(request: Request, session: AdminSession, key_id: str) -> dict:
    for k in await _keys(request, session):
        if k["id"] == key_id:
            return k
    raise AdminError(404, "There is no such API key.")


@router.get("/keys/{key_id}/revoke")
async def confirm_revoke(request: Request, key_id: str, session: AdminSession = Depends(signed_in(TENANT))):
    key = await _key_or_404(request, session, key_id)
    return page(request, "key_revoke.html", session, key=key, own=key_id == session.principal.key_id)


@router.post("/keys/{key_id}/revoke")
async def revoke(request: Request, key_id: str, ctx: Posted = Depends(posted(TENANT))):
    try:
        await call(routes_tenants.revoke_key(key_id=key_id, request=request, tenant=None, p=ctx.session.principal))
    except ApiError as e:
        raise AdminError(e.status, "There is no such API key." if e.status == 404 else e.message) from e
    session_store(request).drop_key(key_id)  # sessions opened with it end now
    if key_id == ctx.session.principal.key_id:
        response = with_headers(RedirectResponse(f"{PREFIX}/login", status_code=303))
        clear_cookie(response, request, COOKIE)
        return response
    return with_headers(RedirectResponse(f"{PREFIX}/keys?revoked={key_id}", status_code=303))
