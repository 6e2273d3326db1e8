"""The local-folder and S3 object stores behind one interface, and content-addressed blobs on top."""

from __future__ import annotations

import os

import pytest

from loraplex.adapter_store import BlobCorruptError, BlobMissingError, BlobStore, StoreConfig, open_object_store
from loraplex.adapter_store.blobs import blob_key, digest_of, sha256_hex
from loraplex.adapter_store.local_objects import LocalObjectStore
from loraplex.errors import ConfigError


@pytest.fixture
def objects(objects_kind, tmp_path, request):
    if objects_kind == "local":
        return open_object_store(StoreConfig(data_dir=tmp_path))
    return open_object_store(StoreConfig(data_dir=tmp_path, **request.getfixturevalue("s3_settings")))


def test_put_get_stat_list_delete(objects):
    payloads = {f"sha256/{i:02x}/obj{i}": os.urandom(1000 + i) for i in range(5)}
    for key, data in payloads.items():
        objects.put(key, data)
    for key, data in payloads.items():
        assert objects.get(key) == data
        info = objects.stat(key)
        assert info.size == len(data) and info.modified.tzinfo is not None
    assert sorted(o.key for o in objects.list("sha256/")) == sorted(payloads)
    assert [o.key for o in objects.list("sha256/01/")] == ["sha256/01/obj1"]
    victim = next(iter(payloads))
    objects.delete(victim)
    objects.delete(victim)  # already gone: no error
    assert objects.stat(victim) is None
    with pytest.raises(BlobMissingError, match="missing"):
        objects.get(victim)


def test_put_replaces_whole_objects(objects):
    objects.put("sha256/aa/x", b"first version")
    objects.put("sha256/aa/x", b"2nd")
    assert objects.get("sha256/aa/x") == b"2nd"


@pytest.mark.parametrize("key", ["../escape", "/abs", "a/../b", "UPPER", "a//b", ""])
def test_unsafe_keys_are_refused(objects, key):
    with pytest.raises(ValueError, match="not a safe key"):
        objects.put(key, b"x")


def test_blobs_are_content_addressed_and_verified(objects):
    blobs = BlobStore(objects)
    data = os.urandom(4096)
    ref = blobs.put(data)
    assert ref.sha256 == sha256_hex(data) and ref.key == blob_key(ref.sha256) and ref.size == 4096
    assert digest_of(ref.key) == ref.sha256
    assert blobs.get(ref.key, ref.sha256) == data
    assert blobs.put(data) == ref  # same bytes, same address
    # Corrupt it behind the store's back: the read is refused, naming both digests.
    tampered = bytearray(data)
    tampered[100] ^= 0xFF
    objects.put(ref.key, bytes(tampered))
    with pytest.raises(BlobCorruptError) as e:
        blobs.get(ref.key, ref.sha256)
    assert ref.sha256 in str(e.value) and sha256_hex(bytes(tampered)) in str(e.value)


def test_local_partial_writes_are_hidden_and_cleaned(tmp_path):
    store = LocalObjectStore(tmp_path / "objects")
    store.put("sha256/ab/done", b"ok")
    (store.root / ".tmp" / "dead.part").write_bytes(b"half a blob")  # a writer that died midway
    assert [o.key for o in store.list()] == ["sha256/ab/done"]
    assert store.remove_partial_writes(older_than_s=3600) == 0  # may still be in progress
    assert store.remove_partial_writes(older_than_s=0) == 1
    assert list((store.root / ".tmp").iterdir()) == []


def test_object_store_urls_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="file:// or s3://"):
        StoreConfig(data_dir=tmp_path, object_store_url="ftp://x")
    with pytest.raises(ConfigError, match="bucket"):
        open_object_store(StoreConfig(data_dir=tmp_path, object_store_url="s3://"))
    local = open_object_store(StoreConfig(data_dir=tmp_path))
    assert local.url == f"file://{tmp_path / 'objects'}"
