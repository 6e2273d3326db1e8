"""Helpers of the dashboard tests: sign in through the form (in a browser page, or with httpx), read the
CSRF token of a page, screenshots at a laptop and a phone width, and the page checks every page passes
(no horizontal scrolling, a label on every control). Imported by name, like tests/api/api_server.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

LAPTOP = {"width": 1366, "height": 900}
PHONE = {"width": 390, "height": 844}

_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')

# Controls a person can reach that have no accessible name (label, aria-label or aria-labelledby; a
# button's own text). Hidden controls are left out.
UNLABELLED_JS = """() => Array.from(document.querySelectorAll(
    'input:not([type=hidden]), select, textarea, button')).filter((el) => {
  if (el.closest('[hidden]') || el.offsetParent === null) return false;
  if (el.tagName === 'BUTTON') return !el.textContent.trim() && !el.getAttribute('aria-label');
  return !(el.labels && el.labels.length) && !el.getAttribute('aria-label') && !el.getAttribute('aria-labelledby');
}).map((el) => el.outerHTML.slice(0, 120))"""

OVERFLOW_JS = "() => document.documentElement.scrollWidth - window.innerWidth"


def csrf_of(html: str) -> str:
    match = _CSRF.search(html)
    assert match, "the page has no CSRF field"
    return match.group(1)


@contextmanager
def http_sign_in(base_url: str, key: str) -> Iterator[httpx.Client]:
    """An httpx client signed in through the form, as a browser would (cookies kept, no redirects followed)."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        form = client.get("/admin/login")
        r = client.post("/admin/login", data={"csrf_token": csrf_of(form.text), "api_key": key})
        assert r.status_code == 303, r.text
        yield client


def sign_in(page, base_url: str, key: str) -> None:
    """Sign in from the keyboard only: the key field has focus on arrival; Enter submits."""
    page.goto(f"{base_url}/admin/login")
    # Chromium moves focus to an autofocus field at its next rendering step, which on a loaded machine can come
    # after goto's load event (a CI run read the focus too early); wait for it, with a bound, rather than race it.
    page.wait_for_function("document.activeElement && document.activeElement.id === 'api-key'", timeout=10_000)
    page.keyboard.type(key)
    with page.expect_navigation():
        page.keyboard.press("Enter")


def check_page(page, folder: Path, name: str) -> None:
    """Screenshots at a laptop and a phone width; at both, no horizontal page scroll; labels everywhere."""
    for label, size in (("laptop", LAPTOP), ("phone", PHONE)):
        page.set_viewport_size(size)
        page.wait_for_timeout(100)  # the charts redraw at the new width
        page.screenshot(path=str(folder / f"{name}-{label}.png"), full_page=True)
        overflow = page.evaluate(OVERFLOW_JS)
        assert overflow <= 0, f"{name} scrolls sideways by {overflow}px at {label} width"
    assert page.evaluate(UNLABELLED_JS) == [], f"{name} has controls without a label"
    page.set_viewport_size(LAPTOP)
