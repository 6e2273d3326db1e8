"""What the model runner hands the kernels each step: the seam between engine and kernels.

Built once per step; every layer reuses it. Host-side tuples serve the torch path (which plans
its loops in Python without reading device tensors back); the tensors serve the Triton path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplex.unified_pager import AdapterResidency


@dataclass(frozen=True)
class AttentionMetadata:
    """A flattened ragged batch of S sequences and T tokens (sequence s owns tokens
    query_start[s]:query_start[s+1]); each sequence's K/V lives in pool pages, one page per layer
    per block of block_size tokens."""

    block_size: int
    positions: torch.Tensor  # [T] int64, absolute position of each token
    query_start: torch.Tensor  # [S+1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [S] int32, tokens in the cache after this step (context + query)
    block_tables: torch.Tensor  # [L, S, max_blocks] int32, page id of each block for each layer
    slot_pages: torch.Tensor  # [L, T] int64, page that receives each new token's K/V, per layer
    slot_offsets: torch.Tensor  # [T] int64, row of that token inside its page (position % block_size)
    query_lens_host: tuple[int, ...]  # [S] on the host
    seq_lens_host: tuple[int, ...]  # [S] on the host
    # Per-step launch plans (tile tables) that a backend derives once and reuses in every layer.
    plan_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @cached_property
    def decode_seqs(self) -> tuple[int, ...]:
        """Sequences with exactly one new token: attended as one batched gather."""
        return tuple(i for i, q in enumerate(self.query_lens_host) if q == 1)

    @cached_property
    def prefill_seqs(self) -> tuple[int, ...]:
        """Sequences with a chunk of several new tokens (causal inside the chunk)."""
        return tuple(i for i, q in enumerate(self.query_lens_host) if q > 1)

    @cached_property
    def query_start_host(self) -> tuple[int, ...]:
        out = [0]
        for q in self.query_lens_host:
            out.append(out[-1] + q)
        return tuple(out)


@dataclass(frozen=True)
class LoraSegment:
    """A run of consecutive tokens that use one adapter (SGMV's segment)."""

    start: int  # first token index in the flattened batch
    length: int
    adapter: "AdapterResidency"


@dataclass(frozen=True)
class LoraBatch:
    """Adapter segments of one step; tokens outside every segment use the base model only."""

    segments: tuple[LoraSegment, ...]
    num_tokens: int
    # Per-(layer, module) grouping that a backend derives once per step and reuses.
    plan_cache: dict = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def max_rank(self) -> int:
        return max((s.adapter.max_rank for s in self.segments), default=0)

    @cached_property
    def device_tensors(self) -> "LoraDeviceTensors":
        return LoraDeviceTensors.build(self)


@dataclass(frozen=True)
class LoraDeviceTensors:
    """The segment table as tensors, for kernels that run on the device (Triton)."""

    seg_start: torch.Tensor  # [S] int32
    seg_len: torch.Tensor  # [S] int32
    layout: torch.Tensor  # [S, L, 7, 3] int32: rank (0 = module absent), a_row, b_row (logical rows)
    scales: torch.Tensor  # [S, L, 7] float32
    pages: torch.Tensor  # [S, P] int32: each segment's adapter page table, padded with 0

    @staticmethod
    def build(batch: LoraBatch) -> "LoraDeviceTensors":
        segs = batch.segments
        device = segs[0].adapter.pages.device if segs else torch.device("cpu")
        max_pages = max((int(s.adapter.pages.numel()) for s in segs), default=1)
        pages = torch.zeros(len(segs), max_pages, dtype=torch.int32, device=device)
        for i, s in enumerate(segs):
            pages[i, : s.adapter.pages.numel()] = s.adapter.pages.to(torch.int32)
        return LoraDeviceTensors(
            seg_start=torch.tensor([s.start for s in segs], dtype=torch.int32, device=device),
            seg_len=torch.tensor([s.length for s in segs], dtype=torch.int32, device=device),
            layout=torch.stack([s.adapter.layout for s in segs]).to(device) if segs else torch.zeros(0, 0, 7, 3, dtype=torch.int32),
            scales=torch.stack([s.adapter.scales for s in segs]).to(device) if segs else torch.zeros(0, 0, 7),
            pages=pages,
        )
