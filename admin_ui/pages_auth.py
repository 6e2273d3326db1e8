"""Sign-in with an API key (a tenant's admin key or the operator key), sign-out, and /admin itself.

A user key cannot sign in: the dashboard manages adapters, keys and reports, which need admin. The
sign-in form has no session to hold a CSRF token yet, so it uses a double-submit token: a random value
set as a cookie when the form is shown and echoed by the form.
"""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Depends, Request
from fastapi.responses import RedirectResponse
from starlette.concurrency import run_in_threadpool

from loraplex.adapter_store.api_keys import display_prefix
from loraplex.api.auth import Principal
from loraplex.api.state import get_state

from .guard import (
    COOKIE,
    CSRF_FIELD,
    CSRF_MESSAGE,
    LOGIN_COOKIE,
    PREFIX,
    Posted,
    check_same_origin,
    clear_cookie,
    current_session,
    posted,
    safe_next,
    session_store,
    set_cookie,
    tokens_match,
)
from .render import page, with_headers

router = APIRouter()

LOGIN_TOKEN_AGE_S = 3600


def home_of(p: Principal) -> str:
    return f"{PREFIX}/tenants" if p.is_operator else f"{PREFIX}/adapters"


@router.get("")
@router.get("/")
async def home(request: Request):
    session = await current_session(request)
    target = home_of(session.principal) if session is not None else f"{PREFIX}/login"
    return with_headers(RedirectResponse(target, status_code=303))


def _login_page(request: Request, message: str | None = None, status: int = 200, next_url: str | None = None):
    token = secrets.token_urlsafe(32)
    response = page(request, "login.html", None, status, csrf_token=token, message=message,
                    next_url=safe_next(next_url or request.query_params.get("next")))
    set_cookie(response, request, LOGIN_COOKIE, token, max_age=LOGIN_TOKEN_AGE_S)
    return response


@router.get("/login")
async def login_form(request: Request):
    session = await current_session(request)
    if session is not None:
        return with_headers(RedirectResponse(home_of(session.principal), status_code=303))
    return _login_page(request)


@router.post("/login")
async def login(request: Request):
    check_same_origin(request)
    form = await request.form()
    next_url = safe_next(str(form.get("next") or ""))
    if not tokens_match(form.get(CSRF_FIELD), request.cookies.get(LOGIN_COOKIE, "")):
        return _login_page(request, CSRF_MESSAGE, 403, next_url)
    secret = str(form.get("api_key") or "").strip()
    state = get_state(request)
    key = await run_in_threadpool(state.registry.authenticate, secret) if secret else None
    if key is None:
        return _login_page(request, "That key is unknown or revoked.", 401, next_url)
    if key.role == "user":
        return _login_page(request, "User keys run inference only and cannot sign in. Sign in with a tenant's "
                                    "admin key or the operator key.", 403, next_url)
    tenant_name = None
    if key.tenant_id is not None:
        tenant_name = (await run_in_threadpool(state.registry.get_tenant, key.tenant_id)).name
    principal = Principal(key_id=key.id, tenant_id=key.tenant_id, role=key.role)
    token, _ = session_store(request).create(principal, tenant_name, display_prefix(secret))
    response = with_headers(RedirectResponse(next_url or home_of(principal), status_code=303))
    set_cookie(response, request, COOKIE, token)
    clear_cookie(response, request, LOGIN_COOKIE)
    return response


@router.post("/logout")
async def logout(request: Request, ctx: Posted = Depends(posted())):
    session_store(request).drop(request.cookies.get(COOKIE))
    response = with_headers(RedirectResponse(f"{PREFIX}/login", status_code=303))
    clear_cookie(response, request, COOKIE)
    return response
