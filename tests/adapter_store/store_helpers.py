"""Small helpers shared by the adapter-store tests."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from loraplex.adapter_store import AdapterStore, UploadFile


def new_tenant(store: AdapterStore) -> str:
    """A tenant with a fresh name (tests sharing the session's PostgreSQL database never collide)."""
    return store.registry.ensure_tenant(f"t-{uuid.uuid4().hex[:10]}").id


def folder_files(folder: Path) -> list[UploadFile]:
    return [UploadFile(p.name, p.read_bytes()) for p in sorted(Path(folder).iterdir())]


def blob_keys(store: AdapterStore) -> list[str]:
    return [o.key for o in store.blobs.objects.list()]


def staging_leftovers(store: AdapterStore) -> list[Path]:
    root = store.uploader.staging_root
    return sorted(root.rglob("*")) if root.exists() else []


def assert_nothing_stored(store: AdapterStore, tenant_id: str) -> None:
    """A refused upload leaves no blob, no row and no staging files."""
    assert blob_keys(store) == []
    assert store.registry.list_adapters(tenant_id, statuses=("ready", "unhealthy", "deleted")).items == []
    assert staging_leftovers(store) == []


def assert_same_adapter(got, want):
    """Two LoraAdapters hold the same modules, ranks, scales and (bit for bit) the same tensors."""
    assert got.max_rank == want.max_rank and got.target_modules == want.target_modules
    assert len(got.modules) == len(want.modules)
    for g, w in zip(got.modules, want.modules, strict=True):
        assert (g.layer, g.module, g.rank) == (w.layer, w.module, w.rank)
        assert g.scale == pytest.approx(w.scale)
        assert torch.equal(g.a, w.a) and torch.equal(g.b, w.b)
