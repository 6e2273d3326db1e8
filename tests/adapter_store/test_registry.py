"""The registry on SQLite and PostgreSQL: tenants, hashed API keys, adapter versions, usage events."""

from __future__ import annotations

import random
import string
import threading
import uuid

import pytest
from sqlalchemy import text

from loraplex.adapter_store import (
    AdapterCreate,
    ApiKeyCreate,
    ConflictError,
    NotFoundError,
    Registry,
    TenantCreate,
    UsageEventCreate,
)
from loraplex.errors import AdapterError, AdapterNotFoundError, RequestError


@pytest.fixture
def registry(db_url):
    reg = Registry.open(db_url)
    yield reg
    reg.close()


def tenant_name() -> str:
    return "t-" + uuid.uuid4().hex[:10]


def adapter_create(tenant_id: str, name: str, fingerprint: str = "f" * 64) -> AdapterCreate:
    digest = "".join(random.choices("0123456789abcdef", k=64))
    return AdapterCreate(tenant_id=tenant_id, name=name, base_model_fingerprint=fingerprint, rank=4, alpha=8.0,
                         target_modules=("q_proj", "v_proj"), dtype="float32", size_bytes=123, sha256=digest,
                         storage_key=f"sha256/{digest[:2]}/{digest}")


def test_tenant_names_are_unique_and_checked(registry):
    name = tenant_name()
    t = registry.create_tenant(TenantCreate(name=name, ttft_target_ms=250))
    assert registry.get_tenant(t.id) == t == registry.get_tenant_by_name(name)
    assert t.created_at.tzinfo is not None
    with pytest.raises(ConflictError, match="already exists"):
        registry.create_tenant(TenantCreate(name=name))
    with pytest.raises(AdapterError, match="tenant name"):
        registry.create_tenant(TenantCreate(name="../evil"))
    with pytest.raises(NotFoundError):
        registry.get_tenant_by_name(tenant_name())
    assert registry.ensure_tenant(name) == t


def test_api_keys_are_stored_only_as_hashes(registry):
    t = registry.create_tenant(TenantCreate(name=tenant_name()))
    created = registry.create_api_key(ApiKeyCreate(tenant_id=t.id, role="admin", label="ci"))
    secret = created.secret
    assert secret.startswith("lpx_") and len(secret) > 40
    assert created.key.prefix == secret[:12]
    with registry.engine.connect() as conn:
        rows = [tuple(map(str, r)) for r in conn.execute(text("SELECT * FROM api_keys"))]
    assert rows and not any(secret in value for row in rows for value in row)
    assert registry.authenticate(secret) == created.key
    assert registry.authenticate(secret + "x") is None
    registry.revoke_api_key(created.key.id)
    assert registry.authenticate(secret) is None
    assert [k.id for k in registry.list_api_keys(t.id)] == [created.key.id]


def test_operator_keys_have_no_tenant_and_roles_are_checked(registry):
    t = registry.create_tenant(TenantCreate(name=tenant_name()))
    op = registry.create_api_key(ApiKeyCreate(tenant_id=None, role="operator"), secret="lpx_" + uuid.uuid4().hex)
    assert registry.authenticate(op.secret).role == "operator"
    with pytest.raises(RequestError, match="operator keys belong to no tenant"):
        registry.create_api_key(ApiKeyCreate(tenant_id=t.id, role="operator"))
    with pytest.raises(RequestError, match="role"):
        registry.create_api_key(ApiKeyCreate(tenant_id=t.id, role="root"))
    with pytest.raises(NotFoundError):
        registry.create_api_key(ApiKeyCreate(tenant_id=str(uuid.uuid4()), role="user"))


def test_versions_count_up_per_name_and_resolve_takes_the_newest_ready(registry):
    t = registry.create_tenant(TenantCreate(name=tenant_name()))
    other = registry.create_tenant(TenantCreate(name=tenant_name()))
    v1 = registry.add_adapter(adapter_create(t.id, "bot"))
    v2 = registry.add_adapter(adapter_create(t.id, "bot"))
    o1 = registry.add_adapter(adapter_create(other.id, "bot"))
    assert (v1.version, v2.version, o1.version) == (1, 2, 1)
    assert len({v1.id, v2.id, o1.id}) == 3
    assert registry.resolve(t.id, "bot") == v2
    registry.mark_unhealthy(v2.id, "blob corrupt")
    assert registry.resolve(t.id, "bot").id == v1.id  # the newest *ready* version
    assert registry.get_adapter(v2.id).status_detail == "blob corrupt"
    registry.mark_ready(v2.id)
    assert registry.resolve(t.id, "bot").id == v2.id
    with pytest.raises(AdapterNotFoundError):
        registry.resolve(t.id, "bot", fingerprint="0" * 64)  # made for another base model
    with pytest.raises(AdapterNotFoundError):
        registry.resolve(t.id, "nobody")


def test_delete_hides_every_version_and_keeps_rows(registry):
    t = registry.create_tenant(TenantCreate(name=tenant_name()))
    a = registry.add_adapter(adapter_create(t.id, "gone"))
    registry.add_adapter(adapter_create(t.id, "gone"))
    assert registry.delete_adapter(t.id, "gone") == 2
    with pytest.raises(AdapterNotFoundError):
        registry.resolve(t.id, "gone")
    assert registry.list_adapters(t.id).items == []
    assert registry.get_adapter(a.id).status == "deleted"
    assert registry.referenced_digests([a.sha256]) == set()
    with pytest.raises(AdapterNotFoundError):
        registry.delete_adapter(t.id, "gone")
    # A later upload of the name continues the numbering: versions are never reused.
    assert registry.add_adapter(adapter_create(t.id, "gone")).version == 3


def test_listing_is_paginated_in_name_version_order(registry):
    t = registry.create_tenant(TenantCreate(name=tenant_name()))
    names = random.sample([f"a{''.join(random.choices(string.ascii_lowercase, k=6))}" for _ in range(40)], 40)
    created = registry.add_adapters([adapter_create(t.id, n) for n in names for _ in range(random.randint(1, 3))])
    expected = sorted((a.name, a.version) for a in created)
    seen, cursor, pages = [], None, 0
    while True:
        page = registry.list_adapters(t.id, limit=7, cursor=cursor)
        seen += [(a.name, a.version) for a in page.items]
        pages += 1
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert seen == expected
    assert pages == -(-len(expected) // 7)
    assert registry.count_adapters(t.id) == len(expected)
    with pytest.raises(RequestError, match="cursor"):
        registry.list_adapters(t.id, cursor="not-a-cursor")


def test_search_filters_names_case_insensitively_and_literally(registry):
    t = registry.create_tenant(TenantCreate(name=tenant_name()))
    names = ["Support-Bot", "support_v2", "supportxv2", "sales", *[f"bulk-{i:03d}" for i in range(25)]]
    registry.add_adapters([adapter_create(t.id, n) for n in names])
    found = lambda q, **kw: [a.name for a in registry.list_adapters(t.id, search=q, **kw).items]  # noqa: E731
    assert found("SUPPORT") == ["Support-Bot", "support_v2", "supportxv2"]
    assert found("t_v") == ["support_v2"]  # '_' is a character, not LIKE's wildcard
    assert found("%") == []
    assert registry.count_adapters(t.id, search="bulk-") == 25
    page = registry.list_adapters(t.id, limit=10, search="bulk-")
    rest = registry.list_adapters(t.id, limit=100, cursor=page.next_cursor, search="bulk-")
    assert [a.name for a in page.items + rest.items] == [f"bulk-{i:03d}" for i in range(25)]
    assert found("") == sorted(names)  # an empty search lists everything


def test_bulk_add_numbers_repeated_names_consecutively(registry):
    t = registry.create_tenant(TenantCreate(name=tenant_name()))
    rows = registry.add_adapters([adapter_create(t.id, "x"), adapter_create(t.id, "y"), adapter_create(t.id, "x")])
    assert [(r.name, r.version) for r in rows] == [("x", 1), ("y", 1), ("x", 2)]


def test_concurrent_uploads_of_one_name_get_distinct_versions(registry):
    t = registry.create_tenant(TenantCreate(name=tenant_name()))
    results, errors = [], []

    def add():
        try:
            results.append(registry.add_adapter(adapter_create(t.id, "race")).version)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=add) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert sorted(results) == [1, 2, 3, 4, 5, 6]


def test_usage_events_are_recorded_in_batches(registry):
    t = registry.create_tenant(TenantCreate(name=tenant_name()))
    a = registry.add_adapter(adapter_create(t.id, "metered"))
    events = [UsageEventCreate(tenant_id=t.id, request_id=f"r{i}", status=random.choice(["ok", "refused"]),
                               adapter_id=a.id if i % 2 else None, prompt_tokens=i, completion_tokens=2 * i,
                               ttft_ms=1.5 * i) for i in range(50)]
    assert registry.record_usage(events) == 50
    with registry.engine.connect() as conn:
        total = conn.execute(text("SELECT sum(completion_tokens), count(*) FROM usage_events WHERE tenant_id = :t"),
                             {"t": t.id}).one()
    assert tuple(total) == (sum(2 * i for i in range(50)), 50)
    with pytest.raises(RequestError, match="usage status"):
        registry.record_usage([UsageEventCreate(tenant_id=t.id, request_id="x", status="weird")])
