"""mount_admin(app): the dashboard's routes under /admin, its static files, its session store, and the
handlers that turn its errors into pages (the API's handlers answer JSON, which suits API clients)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from . import pages_adapters, pages_auth, pages_keys, pages_reports, pages_tenants
from .guard import PREFIX, AdminError, SignInRequired, current_session, sign_in_url
from .render import page, with_headers
from .sessions import SessionStore


def mount_admin(app: FastAPI, sessions: SessionStore | None = None) -> None:
    """Serve the dashboard at /admin on the API's app (same state, registry, store and reports)."""
    app.state.admin_sessions = sessions or SessionStore()
    for module in (pages_auth, pages_adapters, pages_reports, pages_keys, pages_tenants):
        app.include_router(module.router, prefix=PREFIX, include_in_schema=False)
    static = str(files("loraplex.admin_ui").joinpath("static"))
    app.mount(f"{PREFIX}/static", StaticFiles(directory=static), name="admin-static")

    async def on_sign_in_required(request: Request, exc: SignInRequired):
        return with_headers(RedirectResponse(sign_in_url(exc.next_url), status_code=303))

    async def on_admin_error(request: Request, exc: AdminError):
        if "application/json" in request.headers.get("accept", ""):  # the upload script
            return with_headers(JSONResponse({"ok": False, "message": exc.message}, exc.status))
        session = await current_session(request) if exc.status != 401 else None
        return page(request, "error.html", session, exc.status, title=exc.title, message=exc.message)

    app.add_exception_handler(SignInRequired, on_sign_in_required)
    app.add_exception_handler(AdminError, on_admin_error)
