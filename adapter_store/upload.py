"""The only way adapters enter the store: stage, validate, write the blob, then register the row.

Order matters for crash safety: the blob is written and verified before the row commits, so a crash
in between leaves an orphan blob (removed by garbage collection), never a row without its blob.
A refused upload fails before the blob is written and removes its staging folder: nothing is left.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from loraplex.models.config import ModelConfig

from .blobs import BlobRef, BlobStore
from .codec import encode_adapter
from .config import StoreConfig
from .names import check_name
from .registry import Registry
from .schemas import AdapterCreate, AdapterPublic
from .staging import UploadFile, remove_tree, stage_upload
from .upload_rules import UploadLimits
from .validate import ValidatedAdapter, validate_folder


class Uploader:
    def __init__(self, config: StoreConfig, registry: Registry, blobs: BlobStore, model: ModelConfig,
                 fingerprint: str, dtype: torch.dtype):
        self.config = config
        self.registry = registry
        self.blobs = blobs
        self.model = model
        self.fingerprint = fingerprint
        self.dtype = dtype
        self.limits = UploadLimits(config.max_upload_bytes, config.max_archive_members)
        self.staging_root = Path(config.data_dir) / "staging"

    def validate(self, name: str, files: Sequence[UploadFile]) -> ValidatedAdapter:
        """Stage and check an upload without storing anything."""
        check_name(name)
        self.staging_root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="upload-", dir=self.staging_root))
        try:
            folder = stage_upload(files, staging, self.limits)
            return validate_folder(name, folder, self.model, self.config.max_lora_rank, self.dtype)
        finally:
            remove_tree(staging)

    def upload(self, tenant_id: str, name: str, files: Sequence[UploadFile],
               after_blob: Callable[[BlobRef], None] | None = None) -> AdapterPublic:
        """Validate, store and register a new version of the tenant's adapter `name`.

        `after_blob` runs between the blob write and the row insert: tests inject crashes there.
        """
        self.registry.get_tenant(tenant_id)  # an unknown tenant is refused before any work
        checked = self.validate(name, files)
        blob = encode_adapter(checked.config, checked.tensors)
        ref = self.blobs.put(blob)
        if after_blob is not None:
            after_blob(ref)
        return self.registry.add_adapter(AdapterCreate(
            tenant_id=tenant_id,
            name=name,
            base_model_fingerprint=self.fingerprint,
            rank=checked.adapter.max_rank,
            alpha=float(checked.config.get("lora_alpha", 8)),
            target_modules=checked.adapter.target_modules,
            dtype=checked.dtype,
            size_bytes=ref.size,
            sha256=ref.sha256,
            storage_key=ref.key,
        ))
