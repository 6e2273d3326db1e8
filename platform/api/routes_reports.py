"""GET /v1/usage and GET /v1/latency: the caller's tenant (the operator: any tenant, or all), JSON or CSV.

Both read the hourly rollups that metering keeps, so they answer in the same time at any number of
recorded events. Times are ISO 8601 or unix seconds; the range is [start, end) widened to whole UTC
hours (granularity=hour) or whole UTC days (granularity=day).
"""

from __future__ import annotations

from dataclasses import asdict
from datetime import datetime, timedelta, timezone
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from loraplex.metering.reports import LatencyRow, UsageRow, latency_report, rows_to_csv, usage_report

from .auth import Principal, require, tenant_for
from .errors import bad_request
from .state import get_state

router = APIRouter(tags=["reports"])

DEFAULT_RANGE = timedelta(days=7)


def _time(value: str | None, param: str) -> datetime | None:
    if value is None:
        return None
    try:
        t = datetime.fromtimestamp(float(value), timezone.utc)
    except ValueError:
        try:
            t = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise bad_request(f"{param} must be ISO 8601 or unix seconds, got {value!r}", param=param) from None
    except (OverflowError, OSError):
        raise bad_request(f"{param} is out of range", param=param) from None
    return t if t.tzinfo is not None else t.replace(tzinfo=timezone.utc)


def _json_row(row) -> dict:
    out = asdict(row)
    for k, v in out.items():
        if isinstance(v, datetime):
            out[k] = v.isoformat()
    return out


async def _report(request: Request, p: Principal, fn, start: str | None, end: str | None, granularity: str,
                  by_adapter: bool, tenant: str | None, fmt: str, kind: str):
    state = get_state(request)
    tenant_id = await tenant_for(state, p, tenant, required=False)
    t1 = _time(end, "end") or datetime.now(timezone.utc)
    t0 = _time(start, "start") or t1 - DEFAULT_RANGE
    rows = await run_in_threadpool(fn, state.registry, tenant_id, t0, t1, granularity, by_adapter)
    if fmt == "csv":
        row_type = UsageRow if kind == "usage" else LatencyRow
        return Response(rows_to_csv(rows, row_type), media_type="text/csv",
                        headers={"Content-Disposition": f'attachment; filename="{kind}.csv"'})
    return {"object": "list", "granularity": granularity, "data": [_json_row(r) for r in rows]}


Start = Annotated[str | None, Query(max_length=64, description="ISO 8601 or unix seconds; default end - 7 days")]
End = Annotated[str | None, Query(max_length=64, description="ISO 8601 or unix seconds; default now")]
Gran = Annotated[Literal["hour", "day"], Query()]
Fmt = Annotated[Literal["json", "csv"], Query()]
TenantQ = Annotated[str | None, Query(max_length=64, description="operator only; omit for every tenant")]


@router.get("/v1/usage", summary="Requests, tokens, errors and refusals by time bucket and adapter")
async def usage(request: Request, start: Start = None, end: End = None, granularity: Gran = "day",
                by_adapter: bool = True, tenant: TenantQ = None, format: Fmt = "json",
                p: Principal = Depends(require("admin"))):
    return await _report(request, p, usage_report, start, end, granularity, by_adapter, tenant, format, "usage")


@router.get("/v1/latency", summary="TTFT, inter-token and end-to-end percentiles and TTFT-target attainment")
async def latency(request: Request, start: Start = None, end: End = None, granularity: Gran = "day",
                  by_adapter: bool = True, tenant: TenantQ = None, format: Fmt = "json",
                  p: Principal = Depends(require("admin"))):
    return await _report(request, p, latency_report, start, end, granularity, by_adapter, tenant, format, "latency")
