"""Accepted uploads: PEFT folders (as files), .zip and .tar.gz archives, on SQLite/PostgreSQL and local/S3.
What comes back out of the store is exactly what the engine's own loader reads from the folder."""

from __future__ import annotations

import random

import pytest
import torch

from adapter_files import tar_gz_folder, write_peft_adapter, zip_folder
from factories import make_peft_adapter
from loraplex.adapter_store import UploadFile
from loraplex.adapter_store.blobs import sha256_hex
from loraplex.lora.peft_loader import load_peft_adapter
from store_helpers import assert_same_adapter, blob_keys, folder_files, new_tenant, staging_leftovers


def test_peft_folder_round_trips_through_every_backend(make_store, db_url, objects_kind, tiny_model_dir,
                                                         tiny_config, tmp_path):
    store = make_store(db="sqlite" if db_url.startswith("sqlite") else "postgresql", objects=objects_kind)
    tenant = new_tenant(store)
    folder = make_peft_adapter(tiny_model_dir, tmp_path / "peft", r=random.choice([2, 4, 8]),
                               target_modules=("q_proj", "k_proj", "down_proj"), use_rslora=True)
    ref = store.upload(tenant, "support-bot", folder_files(folder))
    assert (ref.name, ref.version, ref.status, ref.dtype) == ("support-bot", 1, "ready", "float32")
    assert ref.target_modules == ("q_proj", "k_proj", "down_proj")
    assert ref.base_model_fingerprint == store.fingerprint
    assert blob_keys(store) == [ref.storage_key]
    assert sha256_hex(store.blobs.objects.get(ref.storage_key)) == ref.sha256 and ref.size_bytes > 0
    assert staging_leftovers(store) == []
    served = store.get(store.resolve(tenant, "support-bot"))
    assert_same_adapter(served, load_peft_adapter("x", folder, tiny_config, 16))


@pytest.mark.parametrize("kind", ["zip", "tar.gz", "zip-in-folder", "tar.gz-in-folder"])
def test_archives_are_accepted(make_store, tiny_config, tmp_path, kind):
    store = make_store()
    tenant = new_tenant(store)
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=4)
    inner = "my-adapter/" if kind.endswith("in-folder") else ""
    suffix = kind.removesuffix("-in-folder")
    make = zip_folder if suffix == "zip" else tar_gz_folder
    archive = make(folder, tmp_path / f"upload.{suffix}", inner)
    ref = store.upload(tenant, "archived", [UploadFile(archive.name, archive.read_bytes())])
    assert_same_adapter(store.get(ref), load_peft_adapter("x", folder, tiny_config, 16))


def test_same_content_shares_one_blob_but_not_one_version(make_store, tiny_config, tmp_path):
    store = make_store()
    tenant = new_tenant(store)
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=4)
    first = store.upload_path(tenant, "twin", folder)
    again = store.upload_path(tenant, "twin", folder)
    other = store.upload_path(tenant, "twin-b", folder)
    assert first.sha256 == again.sha256 == other.sha256
    assert len({first.id, again.id, other.id}) == 3 and again.version == 2
    assert blob_keys(store) == [first.storage_key]


def test_streams_and_paths_are_accepted(make_store, tiny_config, tmp_path):
    store = make_store()
    tenant = new_tenant(store)
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=2, readme=False)
    with open(folder / "adapter_model.safetensors", "rb") as weights:
        files = [UploadFile("adapter_config.json", folder / "adapter_config.json"),
                 UploadFile("adapter_model.safetensors", weights)]
        ref = store.upload(tenant, "streamed", files)
    assert store.get(ref).max_rank == 2


def test_half_precision_weights_keep_their_dtype_in_the_blob(make_store, tiny_config, tmp_path):
    store = make_store()
    tenant = new_tenant(store)
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=4, dtype=torch.bfloat16)
    ref = store.upload_path(tenant, "bf16", folder)
    assert ref.dtype == "bfloat16"
    served = store.get(ref)
    assert served.modules[0].a.dtype == torch.float32  # decoded to the serving dtype
    assert_same_adapter(served, load_peft_adapter("x", folder, tiny_config, 16))
