"""Two tenants, each with an adapter of the same name: no key of one ever reads, uses, lists or deletes
anything of the other; another tenant's objects are 'not found', never 'forbidden'."""

from __future__ import annotations

import pytest

from api_server import make_tenant, upload


@pytest.fixture(scope="module")
def two(live, adapter_dirs):
    ta, admin_a = make_tenant(live, "iso-a")
    tb, admin_b = make_tenant(live, "iso-b")
    ra = upload(live, admin_a, "shared-name", adapter_dirs["a8"]).json()
    rb = upload(live, admin_b, "shared-name", adapter_dirs["b4"]).json()
    only_b = upload(live, admin_b, "only-b", adapter_dirs["b4"]).json()
    with live.client(admin_a) as c:
        user_a = c.post("/v1/keys", json={"role": "user"}).json()["api_key"]
    return dict(admin_a=admin_a, admin_b=admin_b, user_a=user_a, ra=ra, rb=rb, only_b=only_b)


def test_same_name_resolves_to_each_tenants_own_version(live, two):
    assert two["ra"]["id"] != two["rb"]["id"] and two["ra"]["rank"] == 8 and two["rb"]["rank"] == 4
    with live.client(two["admin_a"]) as c:
        assert c.get("/v1/adapters/shared-name").json()["id"] == two["ra"]["id"]
    with live.client(two["admin_b"]) as c:
        assert c.get("/v1/adapters/shared-name").json()["id"] == two["rb"]["id"]


@pytest.mark.parametrize("key", ["admin_a", "user_a"])
def test_another_tenants_adapter_is_unknown_for_inference(live, two, key):
    with live.client(two[key]) as c:
        for body in ({"adapter_id": "only-b"}, {"model": "only-b"}):
            r = c.post("/v1/completions", json=dict(body, prompt="hi", max_tokens=2))
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == "model_not_found"
            assert "only-b" in r.json()["error"]["message"]
        models = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert "only-b" not in models and models.count("shared-name") == 1


def test_admin_endpoints_never_cross_tenants(live, two):
    with live.client(two["admin_a"]) as c:
        assert c.get("/v1/adapters/only-b").status_code == 404
        assert c.delete("/v1/adapters/only-b").status_code == 404
        listed = c.get("/v1/adapters").json()["data"]
        assert {a["name"] for a in listed} == {"shared-name"}
        assert all(a["id"] != two["rb"]["id"] for a in listed)
        # Naming the other tenant explicitly is "not found" too.
        for path in ("/v1/adapters", "/v1/keys", "/v1/usage", "/v1/latency"):
            r = c.get(path, params={"tenant": "iso-b"})
            assert r.status_code == 404, (path, r.text)
        assert c.post("/v1/adapters", params={"tenant": "iso-b"}, data={"name": "x"},
                      files=[("files", ("adapter_config.json", b"{}"))]).status_code == 404
        # Keys: B's key ids are not visible and cannot be revoked from A.
        b_keys = live.client(two["admin_b"]).get("/v1/keys").json()["data"]
        a_keys = c.get("/v1/keys").json()["data"]
        assert not {k["id"] for k in a_keys} & {k["id"] for k in b_keys}
        assert c.delete(f"/v1/keys/{b_keys[0]['id']}").status_code == 404
        assert c.post("/v1/keys", json={"role": "user", "tenant": "iso-b"}).status_code == 404
        # Reports hold only A's events.
        assert c.get("/v1/usage").status_code == 200
    # B still works: nothing of B's was touched.
    with live.client(two["admin_b"]) as c:
        assert c.get("/v1/adapters/only-b").status_code == 200
        r = c.post("/v1/completions", json={"adapter_id": "only-b", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_user_keys_cannot_manage(live, two):
    with live.client(two["user_a"]) as c:
        for method, path in (("GET", "/v1/adapters"), ("GET", "/v1/keys"), ("GET", "/v1/usage"),
                             ("GET", "/v1/latency"), ("DELETE", "/v1/adapters/shared-name"), ("GET", "/v1/tenants")):
            r = c.request(method, path)
            assert r.status_code == 403, (method, path, r.text)
            assert r.json()["error"]["type"] == "permission_error"
        assert c.post("/v1/completions", json={"adapter_id": "shared-name", "prompt": "hi",
                                               "max_tokens": 2}).status_code == 200


def test_tenant_admins_cannot_act_as_operator(live, two):
    with live.client(two["admin_a"]) as c:
        assert c.get("/v1/tenants").status_code == 403
        assert c.post("/v1/tenants", json={"name": "evil"}).status_code == 403
        assert c.post("/v1/keys", json={"role": "operator"}).status_code == 400
