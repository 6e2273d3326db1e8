"""Server-rendered pages: the Jinja environment (autoescaped), the display filters, and the security
headers every dashboard response carries.

The Content-Security-Policy allows scripts, styles and fetches from this origin only, so nothing is
loaded from elsewhere at run time and injected markup could not run inline script.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from functools import cache
from importlib.resources import files
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from jinja2 import Environment, PackageLoader, select_autoescape
from markupsafe import Markup
from starlette.responses import Response

from .guard import CSRF_FIELD, PREFIX
from .sessions import AdminSession

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",  # pages hold tenant data (and once, a new key): never cached
}

TENANT_NAV = (("adapters", "Adapters"), ("usage", "Usage"), ("latency", "Latency"), ("keys", "API keys"))
OPERATOR_NAV = (("tenants", "Tenants"),)


def with_headers(response: Response) -> Response:
    response.headers.update(SECURITY_HEADERS)
    return response


@cache
def static_version(name: str) -> str:
    """A short content hash, appended to static URLs so that a changed file is never read from a cache."""
    return hashlib.sha256(files("loraplex.admin_ui").joinpath("static", name).read_bytes()).hexdigest()[:10]


def static_url(name: str) -> str:
    return f"{PREFIX}/static/{name}?v={static_version(name)}"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "—"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def fmt_time(t: datetime | None) -> str:
    if t is None:
        return "never"
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def fmt_timestamp(t: int | float | None) -> str:
    return fmt_time(None if t is None else datetime.fromtimestamp(t, UTC))


def fmt_ms(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:,.1f} ms" if v < 1000 else f"{v / 1000:,.2f} s"


def fmt_share(v: float | None) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def fmt_num(v: int | float | None) -> str:
    return "—" if v is None else f"{v:,}"


def fmt_optional(v: object, default: str = "server default") -> str:
    return default if v is None else f"{v:,}" if isinstance(v, int) else str(v)


def json_script(value: Any) -> Markup:
    """JSON for a <script type="application/json"> data block, safe against '</script>' in the data."""
    text = json.dumps(value, separators=(",", ":"))
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


@cache
def environment() -> Environment:
    env = Environment(loader=PackageLoader("loraplex.admin_ui", "templates"),
                      autoescape=select_autoescape(["html"]), trim_blocks=True, lstrip_blocks=True)
    env.filters.update(bytes=fmt_bytes, when=fmt_time, timestamp=fmt_timestamp, ms=fmt_ms, share=fmt_share, num=fmt_num,
                       optional=fmt_optional, json_script=json_script)
    env.globals.update(static=static_url, prefix=PREFIX, csrf_field=CSRF_FIELD)
    return env


def page(request: Request, template: str, session: AdminSession | None, status: int = 200,
         **context: Any) -> HTMLResponse:
    nav = () if session is None else OPERATOR_NAV if session.is_operator else TENANT_NAV
    # The sign-in page has no session yet: it passes its own (double-submit) token.
    csrf_token = context.pop("csrf_token", None) or (session.csrf_token if session is not None else "")
    html = environment().get_template(template).render(request=request, session=session, nav=nav,
                                                       path=request.url.path, csrf_token=csrf_token, **context)
    return with_headers(HTMLResponse(html, status_code=status))
