"""The operator's view: every tenant with its limits, TTFT target and usage at a glance (last 24 h and
7 days); a tenant's settings edited through the API's own PATCH route (same validation, and the
inference service's tenant cache refreshed at once); a new tenant with its first admin key shown once."""

from __future__ import annotations

from collections import defaultdict
from datetime import UTC, datetime, timedelta

from fastapi import APIRouter, Depends, Request
from fastapi.responses import RedirectResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from loraplex.adapter_store.registry import Registry
from loraplex.adapter_store.schemas import TENANT_SETTINGS
from loraplex.api import routes_tenants
from loraplex.api.errors import ApiError
from loraplex.api.protocol import TenantCreateBody, TenantPatchBody
from loraplex.api.state import get_state
from loraplex.errors import RequestError
from loraplex.metering import usage_report

from .api_calls import call
from .guard import OPERATOR, PREFIX, AdminError, Posted, posted, signed_in
from .pages_keys import _first_error
from .render import page, with_headers
from .sessions import AdminSession
from .usage_view import Counts

router = APIRouter()

PAGE_SIZE = 100
SETTING_LABELS = {
    "ttft_target_ms": "TTFT target (ms)",
    "requests_per_minute": "Requests per minute",
    "tokens_per_minute": "Tokens per minute",
    "max_concurrent": "Concurrent requests",
    "share": "Fair-queueing share",
}


def _glance(registry: Registry, tenant_ids: list[str]) -> dict[str, dict[str, Counts]]:
    """Per tenant: counts of the last 24 h (hourly rollups) and of the last 7 days (daily)."""
    now = datetime.now(UTC)
    out: dict[str, dict[str, Counts]] = defaultdict(lambda: {"day": Counts(), "week": Counts()})
    wanted = set(tenant_ids)
    for period, since, granularity in (("day", timedelta(hours=24), "hour"), ("week", timedelta(days=7), "day")):
        for row in usage_report(registry, None, now - since, now, granularity, False):
            if row.tenant_id in wanted:
                out[row.tenant_id][period].add(row)
    return out


async def tenants_page(request: Request, session: AdminSession, status: int = 200, **context):
    state = get_state(request)
    cursor = request.query_params.get("cursor") or None
    try:
        listing = await run_in_threadpool(state.registry.list_tenants, PAGE_SIZE, cursor)
    except RequestError:
        listing = await run_in_threadpool(state.registry.list_tenants, PAGE_SIZE, None)
    glance = await run_in_threadpool(_glance, state.registry, [t.id for t in listing.items])
    c = state.config
    defaults = {"ttft_target_ms": c.default_ttft_target_ms, "requests_per_minute": c.default_requests_per_minute,
                "tokens_per_minute": c.default_tokens_per_minute, "max_concurrent": c.default_max_concurrent}
    return page(request, "tenants.html", session, status, tenants=listing.items, next_cursor=listing.next_cursor,
                glance=glance, defaults=defaults, updated=request.query_params.get("updated"), **context)


@router.get("/tenants")
async def tenants(request: Request, session: AdminSession = Depends(signed_in(OPERATOR))):
    return await tenants_page(request, session)


@router.post("/tenants")
async def create_tenant(request: Request, ctx: Posted = Depends(posted(OPERATOR))):
    try:
        body = TenantCreateBody(name=str(ctx.form.get("name") or "").strip())
        created = await call(routes_tenants.create_tenant(body=body, request=request, p=ctx.session.principal))
    except ValidationError as e:
        return await tenants_page(request, ctx.session, 400, create_error=_first_error(e))
    except ApiError as e:
        return await tenants_page(request, ctx.session, e.status, create_error=e.message)
    return await tenants_page(request, ctx.session, 201, created=created)


async def _tenant_or_404(request: Request, session: AdminSession, name: str) -> dict:
    try:
        return await call(routes_tenants.get_tenant(name=name, request=request, p=session.principal))
    except ApiError as e:
        raise AdminError(e.status, f"There is no tenant named {name!r}." if e.status == 404 else e.message) from e


def _settings_page(request: Request, session: AdminSession, tenant: dict, values: dict, status: int = 200,
                   error: str | None = None):
    return page(request, "tenant.html", session, status, tenant=tenant, values=values, labels=SETTING_LABELS,
                error=error)


@router.get("/tenants/{name}")
async def tenant(request: Request, name: str, session: AdminSession = Depends(signed_in(OPERATOR))):
    t = await _tenant_or_404(request, session, name)
    values = {k: "" if t[k] is None else str(t[k]) for k in TENANT_SETTINGS}
    return _settings_page(request, session, t, values)


@router.post("/tenants/{name}")
async def update_tenant(request: Request, name: str, ctx: Posted = Depends(posted(OPERATOR))):
    t = await _tenant_or_404(request, ctx.session, name)
    values = {k: str(ctx.form.get(k) or "").strip() for k in TENANT_SETTINGS}
    try:
        # Every field is sent: an emptied field goes back to the server's default (the API's null).
        body = TenantPatchBody(**{k: (v or None) for k, v in values.items()})
        await call(routes_tenants.update_tenant(name=name, body=body, request=request, p=ctx.session.principal))
    except ValidationError as e:
        return _settings_page(request, ctx.session, t, values, 400, _labelled(_first_error(e)))
    except ApiError as e:
        return _settings_page(request, ctx.session, t, values, e.status, e.message)
    return with_headers(RedirectResponse(f"{PREFIX}/tenants?updated={name}", status_code=303))


def _labelled(message: str) -> str:
    field, _, rest = message.partition(": ")
    return f"{SETTING_LABELS.get(field, field)}: {rest}" if rest else message
