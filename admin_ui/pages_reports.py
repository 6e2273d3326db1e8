"""Usage and latency pages (and the usage CSV), read from the metering rollups like /v1/usage and
/v1/latency: the same report functions, the tenant's own rows only."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from loraplex.adapter_store.registry import Registry
from loraplex.api.state import get_state
from loraplex.errors import RequestError
from loraplex.metering import latency_percentiles, rows_to_csv, usage_report
from loraplex.metering.report_types import BASE_LABEL, UsageRow

from .filters import ReportFilter, parse_filter
from .guard import TENANT, signed_in
from .latency_view import PCTS, latency_view
from .render import page, with_headers
from .sessions import AdminSession
from .usage_view import usage_view

router = APIRouter()


def _usage_rows(registry: Registry, tenant_id: str, f: ReportFilter) -> list[UsageRow]:
    return usage_report(registry, tenant_id, f.t0, f.t1, f.granularity, True)


@router.get("/usage")
async def usage(request: Request, session: AdminSession = Depends(signed_in(TENANT))):
    f, problems = parse_filter(request.query_params)
    try:
        rows = await run_in_threadpool(_usage_rows, get_state(request).registry, session.principal.tenant_id, f)
    except RequestError as e:  # e.g. more than 31 days by the hour
        problems.append(str(e))
        rows = []
    return page(request, "usage.html", session, f=f, problems=problems, view=usage_view(rows, f))


@router.get("/usage.csv")
async def usage_csv(request: Request, session: AdminSession = Depends(signed_in(TENANT))):
    f, _ = parse_filter(request.query_params)
    try:
        rows = await run_in_threadpool(_usage_rows, get_state(request).registry, session.principal.tenant_id, f)
    except RequestError:
        rows = []
    view = usage_view(rows, f)
    name = f"usage-{f.start.isoformat()}-{f.end.isoformat()}-{f.granularity}.csv"
    return with_headers(Response(rows_to_csv(view.rows, UsageRow), media_type="text/csv",
                                 headers={"Content-Disposition": f'attachment; filename="{name}"'}))


def _adapter_ids(registry: Registry, tenant_id: str, adapter: str) -> set[str] | None:
    """The version ids ('' for the base model) the adapter filter means; None: every adapter."""
    if not adapter:
        return None
    if adapter == BASE_LABEL:
        return {""}
    statuses = ("ready", "unhealthy", "deleted")  # a deleted adapter's history is still reported
    return {a.id for a in registry.list_adapters(tenant_id, 1000, None, statuses, adapter).items}


def _latency(registry: Registry, tenant_id: str, f: ReportFilter):
    ids = _adapter_ids(registry, tenant_id, f.adapter)
    args = (registry, tenant_id, f.t0, f.t1)
    series = latency_percentiles(*args, f.granularity, False, PCTS, adapter_ids=ids)
    overall = latency_percentiles(*args, "day", False, PCTS, per_bucket=False, adapter_ids=ids)
    per_adapter = latency_percentiles(*args, "day", True, PCTS, per_bucket=False, adapter_ids=ids)
    return series, overall, per_adapter


@router.get("/latency")
async def latency(request: Request, session: AdminSession = Depends(signed_in(TENANT))):
    f, problems = parse_filter(request.query_params)
    state = get_state(request)
    try:
        series, overall, per_adapter = await run_in_threadpool(_latency, state.registry,
                                                               session.principal.tenant_id, f)
    except RequestError as e:
        problems.append(str(e))
        series, overall, per_adapter = [], [], []
    # The target the inference service applies: the tenant's own, else the server's default.
    tenant = await request.app.state.inference.tenant(session.principal.tenant_id)
    target = tenant.ttft_target_ms or state.config.default_ttft_target_ms
    return page(request, "latency.html", session, f=f, problems=problems, target_ms=target,
                view=latency_view(series, overall, per_adapter, f))
