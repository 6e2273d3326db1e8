"""Who is signed in, and the checks every dashboard request passes: a live session, the right role,
and for anything that changes state, the session's CSRF token and a same-origin request.

Cookies (Path=/admin, HttpOnly, SameSite=Strict, Secure when the request came over https):
- COOKIE: the session token (sessions.py keeps the session itself);
- LOGIN_COOKIE: the sign-in form's double-submit token (there is no session yet to hold a CSRF token).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.responses import Response

from loraplex.adapter_store.registry import Registry
from loraplex.api.auth import Principal
from loraplex.api.state import get_state

from .sessions import MAX_AGE_S, AdminSession, SessionStore

PREFIX = "/admin"
COOKIE = "loraplex_admin"
LOGIN_COOKIE = "loraplex_admin_login"
CSRF_FIELD = "csrf_token"
CSRF_HEADER = "x-csrf-token"

TENANT = "tenant"  # a tenant's admin key
OPERATOR = "operator"


class SignInRequired(Exception):
    """No live session: pages redirect to the sign-in form (which comes back to `next_url`)."""

    def __init__(self, next_url: str):
        super().__init__(next_url)
        self.next_url = next_url


class AdminError(Exception):
    """An error page (or, for the upload script, a JSON error) with this status and message."""

    def __init__(self, status: int, message: str, title: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.title = title or {403: "Not allowed", 404: "Not found"}.get(status, "Something went wrong")


@dataclass(frozen=True)
class Posted:
    """A state-changing request that passed every check: its session and its form."""

    session: AdminSession
    form: FormData


def session_store(request: Request) -> SessionStore:
    return request.app.state.admin_sessions


def _key_is_live(registry: Registry, p: Principal) -> bool:
    return any(k.id == p.key_id and k.revoked_at is None for k in registry.list_api_keys(p.tenant_id))


async def current_session(request: Request) -> AdminSession | None:
    token = request.cookies.get(COOKIE)
    store = session_store(request)
    session = store.get(token)
    if session is None:
        return None
    # Revoking the key a session was opened with ends the session at its next request.
    if not await run_in_threadpool(_key_is_live, get_state(request).registry, session.principal):
        store.drop(token)
        return None
    return session


def _check_role(session: AdminSession, role: str | None) -> None:
    if role == TENANT and session.is_operator:
        raise AdminError(403, "This page shows one tenant's data; the operator key manages tenants "
                              "(see Tenants).")
    if role == OPERATOR and not session.is_operator:
        raise AdminError(403, "This page needs the operator key.")


def signed_in(role: str | None = None):
    """Dependency for pages: the live session (else a redirect to sign-in) with the role asked for."""

    async def dependency(request: Request) -> AdminSession:
        session = await current_session(request)
        if session is None:
            target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            raise SignInRequired(target)
        _check_role(session, role)
        return session

    return dependency


def check_same_origin(request: Request) -> None:
    """Refuse a state-changing request that a browser says came from another site (defence in depth
    beside SameSite cookies and the CSRF token). Browsers send Sec-Fetch-Site; for those that do not,
    Origin's host must be the Host asked for. The scheme is not compared: behind a TLS proxy the server
    may see http while the page was https."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        if site == "cross-site":
            raise AdminError(403, "This request came from another site and was refused.")
        return
    origin = request.headers.get("origin")
    if origin is not None and origin != "null" and urlsplit(origin).netloc != request.headers.get("host"):
        raise AdminError(403, "This request came from another site and was refused.")


def tokens_match(sent: object, expected: str) -> bool:
    return isinstance(sent, str) and bool(sent) and hmac.compare_digest(sent.encode(), expected.encode())


CSRF_MESSAGE = "The form's security token is missing or out of date. Reload the page and try again."


def posted(role: str | None = None):
    """Dependency for every POST: a live session with the role, same origin, and the session's CSRF
    token in the form (or the X-CSRF-Token header, which the upload script sends)."""

    async def dependency(request: Request) -> Posted:
        session = await current_session(request)
        if session is None:
            raise AdminError(401, "Your session has ended; sign in again.", "Signed out")
        _check_role(session, role)
        check_same_origin(request)
        header = request.headers.get(CSRF_HEADER)
        if header is not None and not tokens_match(header, session.csrf_token):
            raise AdminError(403, CSRF_MESSAGE)  # refused before the body (maybe an upload) is read
        form = await request.form()
        if header is None and not tokens_match(form.get(CSRF_FIELD), session.csrf_token):
            raise AdminError(403, CSRF_MESSAGE)
        return Posted(session, form)

    return dependency


def set_cookie(response: Response, request: Request, name: str, value: str, max_age: int = int(MAX_AGE_S)) -> None:
    response.set_cookie(name, value, max_age=max_age, path=PREFIX, httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")


def clear_cookie(response: Response, request: Request, name: str) -> None:
    response.delete_cookie(name, path=PREFIX, httponly=True, samesite="strict", secure=request.url.scheme == "https")


def sign_in_url(next_url: str | None = None) -> str:
    return f"{PREFIX}/login" + (f"?next={quote(next_url, safe='')}" if next_url else "")


def safe_next(next_url: str | None) -> str | None:
    """Only paths inside the dashboard: a sign-in link must not redirect elsewhere (open redirect)."""
    if not next_url or not next_url.startswith(PREFIX + "/") or next_url.startswith("//") or "\\" in next_url:
        return None
    return next_url
