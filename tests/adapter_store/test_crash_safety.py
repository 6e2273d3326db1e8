"""Blob before row: a crash between the two leaves an orphan blob, never a row without its blob, and
garbage collection then leaves a consistent store (every live row has its blob, no unreferenced blob)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from sqlalchemy.exc import OperationalError

from adapter_files import write_peft_adapter
from loraplex.adapter_store import StoreError
from store_helpers import blob_keys, folder_files, new_tenant


class InjectedCrash(Exception):
    pass


def crash(_ref):
    raise InjectedCrash("power cut between blob write and row commit")


def assert_consistent(store, tenant_ids):
    """Every live row's blob exists and verifies; every blob is referenced by a live row."""
    live = [a for t in tenant_ids for a in store.list_adapters(t, limit=1000).items]
    for a in live:
        store.blobs.get(a.storage_key, a.sha256)
    assert sorted(blob_keys(store)) == sorted({a.storage_key for a in live})


def test_crash_between_blob_and_row_leaves_an_orphan_that_gc_removes(make_store, objects_kind, tiny_config,
                                                                         tmp_path):
    store = make_store(objects=objects_kind)
    tenant = new_tenant(store)
    kept = store.upload_path(tenant, "kept", write_peft_adapter(tmp_path / "k", tiny_config, r=2))
    files = write_peft_adapter(tmp_path / "c", tiny_config, r=4)
    with pytest.raises(InjectedCrash):
        store.upload(tenant, "crashed", folder_files(files), after_blob=crash)
    assert len(blob_keys(store)) == 2  # the orphan is there
    assert [a.name for a in store.list_adapters(tenant).items] == ["kept"]  # but no row

    young = store.collect_garbage()  # default min age: the orphan may belong to an upload in flight
    assert young.deleted == [] and young.kept_young == 1
    dry = store.collect_garbage(min_age_s=0, dry_run=True)
    assert len(dry.deleted) == 1 and len(blob_keys(store)) == 2
    report = store.collect_garbage(min_age_s=0)
    assert len(report.deleted) == 1 and report.freed_bytes > 0
    assert kept.storage_key not in report.deleted
    assert_consistent(store, [tenant])
    assert store.get(store.resolve(tenant, "kept")).max_rank == 2


def test_registry_failure_after_blob_leaves_no_row(make_store, tiny_config, tmp_path):
    """A real database failure in the window: the SQLite file is swapped out after the blob is written."""
    store = make_store()
    tenant = new_tenant(store)
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=2)
    engine = store.registry.engine
    db_file = engine.url.database

    def lose_database(_ref):
        engine.dispose()  # pooled connections hold the old file open
        os.replace(db_file, db_file + ".away")

    with pytest.raises(OperationalError, match="no such table"):
        store.upload(tenant, "lost", folder_files(folder), after_blob=lose_database)
    engine.dispose()
    os.replace(db_file + ".away", db_file)
    assert store.list_adapters(tenant).items == []
    assert len(blob_keys(store)) == 1
    store.collect_garbage(min_age_s=0)
    assert_consistent(store, [tenant])


def test_a_killed_uploader_process_leaves_a_consistent_store_after_gc(make_store, tiny_config, tmp_path):
    """A real crash: a separate process is killed (os._exit) right after writing the blob."""
    store = make_store()
    tenant = new_tenant(store)
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=2)
    model_dir = tmp_path / "model-config"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(__import__("json").dumps(tiny_config.raw))
    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from loraplex.adapter_store import AdapterStore, StoreConfig
        from loraplex.models.config import load_model_config
        config = StoreConfig(data_dir=Path({str(store.config.data_dir)!r}), max_lora_rank=16)
        store = AdapterStore.open(config, load_model_config({str(model_dir)!r}))
        from loraplex.adapter_store.staging import files_from_path
        store.upload({tenant!r}, "killed", files_from_path(Path({str(folder)!r})), after_blob=lambda ref: os._exit(9))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    assert len(blob_keys(store)) == 1 and store.list_adapters(tenant).items == []
    assert len(store.collect_garbage(min_age_s=0).deleted) == 1
    assert_consistent(store, [tenant])
    # The store works after the crash: the same upload now succeeds.
    ref = store.upload_path(tenant, "killed", folder)
    assert store.get(ref).max_rank == 2


def test_gc_keeps_blobs_shared_with_live_rows_and_frees_deleted_ones(make_store, tiny_config, tmp_path):
    store = make_store()
    tenant = new_tenant(store)
    shared = write_peft_adapter(tmp_path / "s", tiny_config, r=2)
    a = store.upload_path(tenant, "a", shared)
    store.upload_path(tenant, "b", shared)  # same bytes, same blob
    solo = store.upload_path(tenant, "solo", write_peft_adapter(tmp_path / "x", tiny_config, r=4))
    store.delete(tenant, "a")
    store.delete(tenant, "solo")
    report = store.collect_garbage(min_age_s=0)
    assert report.deleted == [solo.storage_key]  # a's blob is still b's
    assert store.blobs.exists(a.storage_key)
    assert_consistent(store, [tenant])


def test_gc_removes_partial_writes_and_leaves_foreign_objects(make_store):
    store = make_store()
    root = store.blobs.objects.root
    (root / ".tmp" / "died.part").write_bytes(b"half")
    old = time.time() - 7200
    os.utime(root / ".tmp" / "died.part", (old, old))
    store.blobs.objects.put("sha256/zz/not-a-digest", b"something else")
    report = store.collect_garbage()
    assert report.partial_writes_removed == 1 and report.foreign == 1
    assert blob_keys(store) == ["sha256/zz/not-a-digest"]


def test_failed_blob_write_leaves_nothing(make_store, tiny_config, tmp_path):
    store = make_store(objects="s3")
    tenant = new_tenant(store)
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=2)
    store.blobs.objects.bucket = "no-such-bucket-" + os.urandom(4).hex()  # every write fails at S3
    with pytest.raises(StoreError, match="cannot write"):
        store.upload_path(tenant, "x", folder)
    assert store.list_adapters(tenant).items == []
