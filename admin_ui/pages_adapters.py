"""The tenant's adapters: the table (search, keyset paging, requests in the last 24 h), the detail page,
upload (files, a folder or one archive; JSON answers for the page's upload script, a page otherwise)
and delete with a confirmation page. Uploads and deletes run the API's own route functions."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import PurePosixPath
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, RedirectResponse
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from loraplex.adapter_store.schemas import AdapterPublic
from loraplex.api import routes_adapters
from loraplex.api.errors import ApiError, bad_request
from loraplex.api.state import ServerState, get_state
from loraplex.errors import RequestError
from loraplex.metering import latency_percentiles, usage_report
from loraplex.metering.report_types import LatencyPercentileRow, UsageRow

from .api_calls import call
from .guard import PREFIX, TENANT, AdminError, Posted, posted, signed_in
from .latency_view import PCTS
from .render import page, with_headers
from .sessions import AdminSession
from .usage_view import Counts, requests_by_adapter_id

router = APIRouter()

PAGE_SIZES = (25, 50, 100)
DEFAULT_PAGE_SIZE = 50
MAX_BACK = 200  # previous-page cursors kept in the URL (beyond: "previous" restarts at the first page)
RECENT = timedelta(hours=24)
DETAIL_RANGE = timedelta(days=7)
UPLOAD_PATH = f"{PREFIX}/adapters/upload"


@dataclass
class Listing:
    items: list[AdapterPublic]
    next_cursor: str | None
    total: int
    requests_24h: dict[str | None, int]
    problem: str | None = None


def _listing(state: ServerState, tenant_id: str, query: str, size: int, cursor: str | None) -> Listing:
    problem = None
    try:
        page_ = state.registry.list_adapters(tenant_id, size, cursor, search=query)
    except RequestError:  # a stale or edited cursor: start again from the first page
        problem, page_ = "That page link is no longer valid; showing the first page.", \
            state.registry.list_adapters(tenant_id, size, None, search=query)
    now = datetime.now(UTC)
    # The hourly rollups of the last 24 h (whole hours: up to 25 of them), per adapter version.
    recent = usage_report(state.registry, tenant_id, now - RECENT, now, "hour", True)
    return Listing(page_.items, page_.next_cursor, state.registry.count_adapters(tenant_id, search=query),
                   requests_by_adapter_id(recent), problem)


def _page_size(raw: str | None) -> int:
    return int(raw) if raw in {str(s) for s in PAGE_SIZES} else DEFAULT_PAGE_SIZE


async def adapters_page(request: Request, session: AdminSession, status: int = 200, upload_error: str | None = None,
                        upload_name: str = ""):
    params = request.query_params
    query = (params.get("q") or "").strip()[:64]
    size = _page_size(params.get("per_page"))
    cursor = params.get("cursor") or None
    back = params.getlist("back")[-MAX_BACK:]
    listing = await run_in_threadpool(_listing, get_state(request), session.principal.tenant_id, query, size, cursor)
    if listing.problem:
        cursor, back = None, []

    def link(**changes) -> str:
        base = {"q": query, "per_page": str(size)}
        base.update(changes)
        items = [(k, v) for k, v in base.items() if k != "back" and v] + [("back", b) for b in base.get("back", [])]
        return f"{PREFIX}/adapters?{urlencode(items)}"

    next_url = link(cursor=listing.next_cursor, back=[*back, cursor or ""]) if listing.next_cursor else None
    prev_url = link(cursor=back[-1], back=back[:-1]) if back else None
    first = len(back) * size + 1
    return page(request, "adapters.html", session, status, listing=listing, query=query, size=size,
                sizes=PAGE_SIZES, next_url=next_url, prev_url=prev_url, first=first,
                last=first + len(listing.items) - 1, upload_error=upload_error, upload_name=upload_name,
                upload_path=UPLOAD_PATH, deleted=params.get("deleted"),
                max_upload=get_state(request).config.store.max_upload_bytes)


@router.get("/adapters")
async def adapters(request: Request, session: AdminSession = Depends(signed_in(TENANT))):
    return await adapters_page(request, session)


def _upload_files(ctx: Posted) -> list[UploadFile]:
    files = [f for f in ctx.form.getlist("files") if isinstance(f, UploadFile) and f.filename]
    for f in ctx.form.getlist("folder"):
        if isinstance(f, UploadFile) and f.filename:
            # A folder picker names files by their path inside the folder: the store wants plain names.
            f.filename = PurePosixPath(f.filename.replace("\\", "/")).name
            files.append(f)
    return files


@router.post("/adapters/upload")
async def upload(request: Request, ctx: Posted = Depends(posted(TENANT))):
    wants_json = "application/json" in request.headers.get("accept", "")
    name = str(ctx.form.get("name") or "").strip()
    try:
        files = _upload_files(ctx)
        if not name:
            raise bad_request("Give the adapter a name.", param="name")
        if not files:
            raise bad_request("Choose the adapter's files (adapter_config.json and adapter_model.safetensors), "
                              "its folder, or one .zip or .tar.gz archive.", param="files")
        body = await call(routes_adapters.upload_adapter(request=request, name=name, files=files, tenant=None,
                                                         p=ctx.session.principal))
    except ApiError as e:
        if wants_json:
            return with_headers(JSONResponse({"ok": False, "message": e.message, "param": e.param}, e.status))
        return await adapters_page(request, ctx.session, e.status, upload_error=e.message, upload_name=name)
    finally:
        await ctx.form.close()
    url = f"{PREFIX}/adapters/{quote(body['name'])}?uploaded={body['version']}"
    if wants_json:
        return with_headers(JSONResponse({"ok": True, "url": url, "name": body["name"], "version": body["version"]},
                                         201))
    return with_headers(RedirectResponse(url, status_code=303))


@dataclass
class VersionFigures:
    adapter: AdapterPublic
    usage: Counts
    latency: LatencyPercentileRow | None


def _detail(state: ServerState, tenant_id: str, name: str) -> list[VersionFigures]:
    versions = state.registry.list_adapters(tenant_id, 1000, None, ("ready", "unhealthy"), name).items
    if not versions:
        return []
    now = datetime.now(UTC)
    usage: list[UsageRow] = [r for r in usage_report(state.registry, tenant_id, now - DETAIL_RANGE, now, "day", True)
                             if r.adapter_id in {v.id for v in versions}]
    latency = latency_percentiles(state.registry, tenant_id, now - DETAIL_RANGE, now, "day", True, PCTS,
                                  per_bucket=False, adapter_ids={v.id for v in versions})
    by_id = {r.adapter_id: r for r in latency}
    out = []
    for v in reversed(versions):  # newest first
        counts = Counts()
        for r in usage:
            if r.adapter_id == v.id:
                counts.add(r)
        out.append(VersionFigures(v, counts, by_id.get(v.id)))
    return out


async def _versions_or_404(request: Request, session: AdminSession, name: str) -> list[VersionFigures]:
    versions = await run_in_threadpool(_detail, get_state(request), session.principal.tenant_id, name)
    if not versions:  # also another tenant's adapter: its existence is never revealed
        raise AdminError(404, f"There is no adapter named {name!r}.")
    return versions


@router.get("/adapters/{name}")
async def adapter_detail(request: Request, name: str, session: AdminSession = Depends(signed_in(TENANT))):
    versions = await _versions_or_404(request, session, name)
    state = get_state(request)
    return page(request, "adapter.html", session, name=name, versions=versions, newest=versions[0].adapter,
                uploaded=request.query_params.get("uploaded"),
                model_name=state.model.name if state.model is not None else "the base model")


@router.get("/adapters/{name}/delete")
async def confirm_delete(request: Request, name: str, session: AdminSession = Depends(signed_in(TENANT))):
    versions = await _versions_or_404(request, session, name)
    return page(request, "adapter_delete.html", session, name=name, versions=versions)


@router.post("/adapters/{name}/delete")
async def delete(request: Request, name: str, ctx: Posted = Depends(posted(TENANT))):
    try:
        await call(routes_adapters.delete_adapter(request=request, name=name, tenant=None, p=ctx.session.principal))
    except ApiError as e:
        raise AdminError(e.status, f"There is no adapter named {name!r}." if e.status == 404 else e.message) from e
    return with_headers(RedirectResponse(f"{PREFIX}/adapters?{urlencode({'deleted': name})}", status_code=303))
