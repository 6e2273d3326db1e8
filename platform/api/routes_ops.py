"""GET /health (the process answers), GET /ready (model loaded, database reachable, not draining),
GET /metrics (Prometheus text format)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from .state import get_state

router = APIRouter(tags=["operations"])


@router.get("/health", summary="The process is alive")
async def health():
    return {"status": "ok"}


def _db_ok(state) -> str | None:
    try:
        with state.registry.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
        return None
    except Exception as e:  # any failure means "not ready", with the reason
        return f"{type(e).__name__}: {e}"[:300]


@router.get("/ready", summary="Ready to serve: model loaded, engine running, database reachable")
async def ready(request: Request):
    state = get_state(request)
    checks: dict[str, str] = {}
    if state.load_error is not None:
        checks["model"] = f"failed to load: {state.load_error}"
    elif state.engine is None:
        checks["model"] = "loading"
    elif not state.engine.alive:
        checks["engine"] = f"stopped: {state.engine.error!r}"
    if state.draining:
        checks["server"] = "draining"
    db = await run_in_threadpool(_db_ok, state)
    if db is not None:
        checks["database"] = db
    lim = await run_in_threadpool(state.limiter.status)
    # Rate limits falling back to in-process counters is reported, not a reason to stop serving.
    limiter = {"backend": lim.backend, "redis_configured": lim.redis_configured, "redis_ok": lim.redis_ok,
               "last_error": lim.last_error}
    body = {"status": "ready" if not checks else "not ready", "problems": checks,
            "model": state.model.name if state.model else None, "rate_limits": limiter}
    return JSONResponse(body, status_code=200 if not checks else 503)


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(request: Request):
    state = get_state(request)
    # Off the loop: the limiter's status may probe an unreachable Redis (a bounded wait).
    return Response(await run_in_threadpool(state.metrics.render), media_type=CONTENT_TYPE_LATEST)
