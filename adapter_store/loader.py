"""Fetch, verify, decode and pack one adapter version from the object store, timing each stage.

A missing or corrupt blob marks the version unhealthy in the registry (so resolution stops choosing
it) and raises AdapterUnavailableError: bad bytes are never decoded, let alone served.

Packing puts the weights in the page pool's row layout (unified_pager.pack_adapter) here, on the
loading thread, so that the engine thread places the adapter with one page-granular copy. The
layout depends only on the model and the dtype, not on the engine's page size.

A blob whose safetensors header is byte for byte that of a blob decoded before (same config, ranks and
modules: the header holds the config) skips the decode: the plan learnt from the first
(unified_pager.pack_plan) packs it straight from the fetched bytes, NaN/Inf check included.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from loraplex.errors import AdapterError
from loraplex.lora.types import LoraAdapter
from loraplex.models.config import ModelConfig
from loraplex.unified_pager import PackPlans, RowLayout, pack_adapter
from loraplex.unified_pager.pack_plan import header_matrices, learn_plan

from .blobs import BlobStore
from .codec import decode_adapter, header_bytes, read_header
from .errors import AdapterUnavailableError, BlobCorruptError, BlobMissingError
from .registry import Registry
from .schemas import AdapterPublic


@dataclass(frozen=True)
class LoadTimings:
    fetch_s: float
    verify_s: float
    decode_s: float
    nbytes: int  # of the blob
    pack_s: float = 0.0  # into the pool's row layout (and page-locked memory when pinning)

    @property
    def total_s(self) -> float:
        return self.fetch_s + self.verify_s + self.decode_s + self.pack_s


def display_name(ref: AdapterPublic) -> str:
    return f"{ref.name}@v{ref.version}"


class AdapterLoader:
    def __init__(self, registry: Registry, blobs: BlobStore, model: ModelConfig, max_lora_rank: int,
                 dtype: torch.dtype, pin_memory: bool = False):
        self.registry = registry
        self.blobs = blobs
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.pin_memory = pin_memory
        self.layout = RowLayout.for_model(model, dtype)
        self.plans = PackPlans(model, max_lora_rank, self.layout)

    def load(self, ref: AdapterPublic) -> tuple[LoraAdapter, LoadTimings]:
        t0 = time.perf_counter()
        try:
            data = self.blobs.fetch(ref.storage_key)
            t1 = time.perf_counter()
            self.blobs.verify(data, ref.sha256, ref.storage_key)
        except (BlobMissingError, BlobCorruptError) as e:
            detail = str(e)
            self.registry.mark_unhealthy(ref.id, detail)
            raise AdapterUnavailableError(
                f"adapter {display_name(ref)} ({ref.id}) is unavailable and will not be served: {detail}"
            ) from e
        t2 = time.perf_counter()
        name, source = display_name(ref), f"store:{ref.id}"
        try:
            header, start = header_bytes(data)
        except AdapterError:  # decode_adapter below says what is wrong with it
            header, start = None, 0
        plan = self.plans.get(header, len(data) - start) if header is not None else None
        adapter = None
        if plan is not None:
            adapter = plan.pack(name, data, start, source, pin_memory=self.pin_memory)
        if adapter is not None:  # a planned load decodes nothing: its time is all packing
            t3 = t2
        else:
            adapter = decode_adapter(name, data, self.model, self.max_lora_rank, self.dtype, source=source)
            t3 = time.perf_counter()
            # The packed rows replace the decoded tensors (which alias the blob): the blob's memory goes.
            # The NaN/Inf check rides on the copy (the upload checked these bytes; the planned path checks
            # them on its copy too, so both paths refuse the same blobs).
            adapter = pack_adapter(adapter, self.layout, pin_memory=self.pin_memory, check_finite=True)
            if header is not None:
                matrices = header_matrices(read_header(data)[0])
                if matrices is not None:
                    self.plans.learn(header, learn_plan(adapter, matrices, len(data) - start))
        t4 = time.perf_counter()
        # last_used_at moves when a version is loaded into host RAM, not per request: that keeps database
        # writes off the request path (the API can add per-request precision in its metering batches).
        self.registry.touch_last_used([ref.id])
        return adapter, LoadTimings(t1 - t0, t2 - t1, t3 - t2, len(data), t4 - t3)

