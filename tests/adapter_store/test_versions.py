"""Versions: a re-upload is a new uuid, requests get the newest ready version, and a version whose blob is
corrupt or missing is marked unhealthy with a clear error and never served."""

from __future__ import annotations

import pytest

from adapter_files import write_peft_adapter
from loraplex.adapter_store import AdapterUnavailableError
from loraplex.errors import AdapterNotFoundError
from store_helpers import new_tenant


@pytest.fixture
def store(make_store, objects_kind):
    return make_store(objects=objects_kind)


def test_reupload_is_a_new_version_and_is_served_next(store, tiny_config, tmp_path):
    tenant = new_tenant(store)
    v1 = store.upload_path(tenant, "bot", write_peft_adapter(tmp_path / "1", tiny_config, r=2))
    first = store.get(store.resolve(tenant, "bot"))
    v2 = store.upload_path(tenant, "bot", write_peft_adapter(tmp_path / "2", tiny_config, r=4))
    assert v2.id != v1.id and v2.version == v1.version + 1
    second = store.get(store.resolve(tenant, "bot"))
    assert (first.max_rank, second.max_rank) == (2, 4)
    assert store.cache.keys() == [v1.id, v2.id]  # cache keys are versions, never names


def test_corrupt_blob_marks_the_version_unhealthy_and_is_never_served(store, tiny_config, tmp_path):
    tenant = new_tenant(store)
    good = store.upload_path(tenant, "bot", write_peft_adapter(tmp_path / "1", tiny_config, r=2))
    bad = store.upload_path(tenant, "bot", write_peft_adapter(tmp_path / "2", tiny_config, r=4))
    data = bytearray(store.blobs.objects.get(bad.storage_key))
    data[-10] ^= 0x55  # flip bits inside a tensor: still parses as safetensors, but is not what was uploaded
    store.blobs.objects.put(bad.storage_key, bytes(data))

    with pytest.raises(AdapterUnavailableError) as e:
        store.get(store.resolve(tenant, "bot"))
    message = str(e.value)
    assert "bot@v2" in message and bad.id in message and "corrupt" in message and "will not be served" in message
    row = store.registry.get_adapter(bad.id)
    assert row.status == "unhealthy" and "corrupt" in row.status_detail
    assert bad.id not in store.cache
    # The name now resolves to the newest *ready* version.
    assert store.resolve(tenant, "bot").id == good.id
    assert store.get(store.resolve(tenant, "bot")).max_rank == 2
    # Listed with its status, so an operator can see it.
    assert {a.id: a.status for a in store.list_adapters(tenant).items} == {good.id: "ready", bad.id: "unhealthy"}


def test_missing_blob_marks_unhealthy_and_scrub_restores_it(store, tiny_config, tmp_path):
    tenant = new_tenant(store)
    ref = store.upload_path(tenant, "bot", write_peft_adapter(tmp_path / "1", tiny_config, r=2))
    saved = store.blobs.objects.get(ref.storage_key)
    store.blobs.objects.delete(ref.storage_key)
    with pytest.raises(AdapterUnavailableError, match="missing"):
        store.get(ref)
    with pytest.raises(AdapterNotFoundError):
        store.resolve(tenant, "bot")
    assert store.scrub().marked_unhealthy == []  # already marked
    store.blobs.objects.put(ref.storage_key, saved)  # restored from a backup, say
    report = store.scrub()
    assert report.marked_ready == [ref.id]
    assert store.get(store.resolve(tenant, "bot")).max_rank == 2


def test_scrub_finds_corruption_before_any_request(store, tiny_config, tmp_path):
    tenant = new_tenant(store)
    ref = store.upload_path(tenant, "bot", write_peft_adapter(tmp_path / "1", tiny_config, r=2))
    store.blobs.objects.put(ref.storage_key, b"garbage")
    report = store.scrub()
    assert report.checked >= 1 and report.marked_unhealthy == [ref.id]
    assert store.registry.get_adapter(ref.id).status == "unhealthy"


def test_deleted_adapters_are_not_served(store, tiny_config, tmp_path):
    tenant = new_tenant(store)
    store.upload_path(tenant, "bot", write_peft_adapter(tmp_path / "1", tiny_config, r=2))
    store.delete(tenant, "bot")
    with pytest.raises(AdapterNotFoundError):
        store.resolve(tenant, "bot")


def test_tenants_never_see_each_others_adapters(store, tiny_config, tmp_path):
    a, b = new_tenant(store), new_tenant(store)
    ref = store.upload_path(a, "shared-name", write_peft_adapter(tmp_path / "1", tiny_config, r=2))
    with pytest.raises(AdapterNotFoundError):
        store.resolve(b, "shared-name")
    assert store.list_adapters(b).items == []
    mine = store.upload_path(b, "shared-name", write_peft_adapter(tmp_path / "2", tiny_config, r=4))
    assert mine.version == 1 and store.resolve(a, "shared-name").id == ref.id
