"""The dashboard's guards over plain HTTP against the real server: who may sign in, the session cookie,
CSRF on every state-changing request, tenants kept apart, sessions that end."""

from __future__ import annotations

import time

import httpx
import pytest

from admin_browser import csrf_of, http_sign_in
from api_server import OPERATOR_KEY, make_tenant, upload


@pytest.fixture(scope="module")
def tenants(live, adapters):
    """Two tenants; the first has an adapter."""
    _, key_a = make_tenant(live, "sec-a")
    _, key_b = make_tenant(live, "sec-b")
    assert upload(live, key_a, "private-bot", adapters["good"]).status_code == 201
    return key_a, key_b


def _new_key(live, admin_key: str, role: str) -> dict:
    with live.client(admin_key) as c:
        r = c.post("/v1/keys", json={"role": role, "label": f"a {role} key"})
        assert r.status_code == 201, r.text
        return r.json()


def test_a_user_key_cannot_sign_in_and_a_bad_key_neither(live, tenants):
    key_a, _ = tenants
    user = _new_key(live, key_a, "user")["api_key"]
    for key, status, message in ((user, 403, "User keys run inference only"),
                                 ("lpx_not-a-key", 401, "unknown or revoked")):
        with httpx.Client(base_url=live.url) as c:
            r = c.post("/admin/login", data={"csrf_token": csrf_of(c.get("/admin/login").text), "api_key": key})
            assert r.status_code == status and message in r.text
            assert "loraplex_admin" not in c.cookies
            assert c.get("/admin/adapters").status_code == 303  # still signed out


def test_the_session_cookie(live, tenants):
    key_a, _ = tenants
    with httpx.Client(base_url=live.url) as c:
        r = c.post("/admin/login", data={"csrf_token": csrf_of(c.get("/admin/login").text), "api_key": key_a})
        cookie = next(v for k, v in r.headers.multi_items() if k == "set-cookie" and v.startswith("loraplex_admin="))
        attrs = [a.strip().lower() for a in cookie.split(";")]
        assert "httponly" in attrs and "samesite=strict" in attrs and "path=/admin" in attrs
        assert "secure" not in attrs  # plain http here
        assert key_a not in cookie  # the cookie is a session token, never the key
    # Behind a TLS proxy (uvicorn trusts 127.0.0.1's X-Forwarded-Proto) the cookie is Secure.
    with httpx.Client(base_url=live.url, headers={"X-Forwarded-Proto": "https"}) as c:
        form = c.get("/admin/login")
        login = form.cookies["loraplex_admin_login"]  # Secure too: httpx would not send it over http itself
        r = c.post("/admin/login", data={"csrf_token": csrf_of(form.text), "api_key": key_a},
                   headers={"Cookie": f"loraplex_admin_login={login}"})
        cookie = next(v for k, v in r.headers.multi_items() if k == "set-cookie" and v.startswith("loraplex_admin="))
        assert "secure" in [a.strip().lower() for a in cookie.split(";")]


def test_pages_carry_security_headers(live, tenants):
    with http_sign_in(live.url, tenants[0]) as c:
        r = c.get("/admin/adapters")
        assert r.status_code == 200
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["cache-control"] == "no-store" and r.headers["x-content-type-options"] == "nosniff"


def test_every_post_needs_the_csrf_token(live, tenants):
    key_a, _ = tenants
    with http_sign_in(live.url, key_a) as c:
        token = csrf_of(c.get("/admin/keys").text)
        keys_before = len(c.get("/v1/keys", headers={"Authorization": f"Bearer {key_a}"}).json()["data"])
        posts = [("/admin/keys", {"role": "admin"}), ("/admin/adapters/private-bot/delete", {}),
                 ("/admin/adapters/upload", {"name": "x"}), ("/admin/logout", {})]
        for path, data in posts:
            for sent in ({}, {"csrf_token": "forged"}):
                r = c.post(path, data={**data, **sent})
                assert r.status_code == 403 and "security token" in r.text, (path, sent, r.status_code)
        assert c.post("/admin/keys", data={"role": "user"}, headers={"X-CSRF-Token": "forged"}).status_code == 403
        # Nothing happened: no key made, the adapter is there, the session is alive.
        assert len(c.get("/v1/keys", headers={"Authorization": f"Bearer {key_a}"}).json()["data"]) == keys_before
        assert c.get("/admin/adapters/private-bot").status_code == 200
        # A request another site started is refused even with the right token.
        for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"}):
            r = c.post("/admin/keys", data={"csrf_token": token, "role": "user"}, headers=headers)
            assert r.status_code == 403, headers
        assert c.post("/admin/keys", data={"csrf_token": token, "role": "user"}).status_code == 201
    with httpx.Client(base_url=live.url) as c:  # the sign-in form's own token
        c.get("/admin/login")
        assert c.post("/admin/login", data={"api_key": key_a}).status_code == 403
        assert c.post("/admin/login", data={"api_key": key_a, "csrf_token": "forged"}).status_code == 403
        assert "loraplex_admin" not in c.cookies


def test_another_tenants_adapter_is_not_found(live, tenants):
    key_a, key_b = tenants
    with http_sign_in(live.url, key_b) as c:
        for path in ("/admin/adapters/private-bot", "/admin/adapters/private-bot/delete"):
            r = c.get(path)
            assert r.status_code == 404 and "no adapter named" in r.text
        r = c.post("/admin/adapters/private-bot/delete", data={"csrf_token": csrf_of(c.get("/admin/keys").text)})
        assert r.status_code == 404
        assert "private-bot" not in c.get("/admin/adapters").text
        assert "private-bot" not in c.get("/admin/adapters?q=private").text
        assert "private-bot" not in c.get("/admin/usage").text
        assert c.get("/admin/tenants").status_code == 403  # operator only
    with http_sign_in(live.url, key_a) as c:
        assert c.get("/admin/adapters/private-bot").status_code == 200  # still there


def test_operator_signs_in_to_the_tenants_view_only(live, tenants):
    with http_sign_in(live.url, OPERATOR_KEY) as c:
        r = c.get("/admin/", follow_redirects=True)
        assert r.url.path == "/admin/tenants" and "sec-a" in r.text and "sec-b" in r.text
        assert c.get("/admin/adapters").status_code == 403


def test_sign_out_and_revocation_end_sessions(live, tenants):
    key_a, _ = tenants
    with http_sign_in(live.url, key_a) as c:
        r = c.post("/admin/logout", data={"csrf_token": csrf_of(c.get("/admin/keys").text)})
        assert r.status_code == 303 and r.headers["location"] == "/admin/login"
        assert c.get("/admin/adapters").status_code == 303
    # A second admin key signs in; revoking that key (through the API) ends its session.
    second = _new_key(live, key_a, "admin")
    with http_sign_in(live.url, second["api_key"]) as c:
        assert c.get("/admin/adapters").status_code == 200
        with live.client(key_a) as api:
            assert api.delete(f"/v1/keys/{second['id']}").status_code == 200
        r = c.get("/admin/adapters")
        assert r.status_code == 303 and r.headers["location"].startswith("/admin/login")


def test_sessions_expire(live, tenants):
    sessions = _app(live).state.admin_sessions
    idle = sessions.idle_ttl_s
    with http_sign_in(live.url, tenants[0]) as c:
        try:
            sessions.idle_ttl_s = 0.5
            time.sleep(0.8)
            r = c.get("/admin/usage")
            assert r.status_code == 303 and "/admin/login" in r.headers["location"]
        finally:
            sessions.idle_ttl_s = idle


def test_next_never_leaves_the_dashboard(live, tenants):
    with httpx.Client(base_url=live.url) as c:
        page = c.get("/admin/login", params={"next": "https://evil.example/"}).text
        assert "evil.example" not in page
        r = c.post("/admin/login", data={"csrf_token": csrf_of(page), "api_key": tenants[0],
                                         "next": "//evil.example/admin/"})
        assert r.headers["location"] == "/admin/adapters"
        page = c.get("/admin/login", params={"next": "/admin/usage?granularity=hour"})
        assert page.status_code == 303  # already signed in


def _app(live):
    app = live.server.config.loaded_app
    while not hasattr(app, "state"):
        app = app.app
    return app


def test_upload_without_javascript(live, tenants, adapters):
    """The form posts on its own too: a refusal comes back as the page with the message by the form, a
    success as a redirect to the new adapter; the upload script gets the same as JSON."""
    def files(folder, field="files"):
        # A folder picker names each file by its path in the folder; the server keeps the plain name.
        prefix = f"{folder.name}/" if field == "folder" else ""
        return [(field, (prefix + p.name, p.read_bytes(), "application/octet-stream"))
                for p in sorted(folder.iterdir())]

    with http_sign_in(live.url, tenants[0]) as c:
        token = csrf_of(c.get("/admin/adapters").text)
        r = c.post("/admin/adapters/upload", data={"csrf_token": token, "name": "nojs"}, files=files(adapters["dora"]))
        assert r.status_code == 400 and 'id="upload-error"' in r.text and "DoRA" in r.text
        assert 'value="nojs"' in r.text  # the name is kept in the form
        r = c.post("/admin/adapters/upload", data={"csrf_token": token, "name": "nojs"},
                   files=files(adapters["good"], "folder"))
        assert r.status_code == 303 and r.headers["location"] == "/admin/adapters/nojs?uploaded=1"
        r = c.post("/admin/adapters/upload", data={"name": "nojs"}, files=files(adapters["dora"]),
                   headers={"X-CSRF-Token": token, "Accept": "application/json"})
        assert r.status_code == 400 and "DoRA" in r.json()["message"] and r.json()["ok"] is False
        r = c.post("/admin/adapters/upload", data={"name": "bad name!"}, files=files(adapters["good"]),
                   headers={"X-CSRF-Token": token, "Accept": "application/json"})
        assert r.status_code == 400 and "not allowed" in r.json()["message"]
        r = c.post("/admin/adapters/upload", data={"name": "nojs"},
                   headers={"X-CSRF-Token": token, "Accept": "application/json"})
        assert r.status_code == 400 and "Choose the adapter's files" in r.json()["message"]
