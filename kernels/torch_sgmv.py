"""SGMV shrink/expand in plain torch: the CPU path and the reference for the Triton kernels.

For each segment s of tokens sharing adapter a:  y[seg] += scale_a * (x[seg] @ A_a^T) @ B_a^T,
with A_a's rows and B_a^T's rows read from the unified pool through the adapter's page table
(pool_rows is the pool viewed as [rows, D]; AdapterResidency.a_index/b_index give the physical
rows of one (layer, module)).

Why two shapes of loop: one-token segments (decode) are batched per rank into one bmm, since a
Python loop over a batch of 64 distinct adapters would cost more than the arithmetic; segments of
several tokens (prefill chunks, or many decode tokens sharing an adapter) are one matmul each.
The gather of a (layer, module)'s rows is per step and cache-sized; the Triton path reads the
rows in place instead.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .metadata import LoraBatch, LoraSegment


def _groups(lora: LoraBatch, layer: int, module: int):
    """Split the segments that carry (layer, module) into single-token groups keyed by rank and
    multi-token segments."""
    singles: dict[int, list[LoraSegment]] = defaultdict(list)
    multi: list[LoraSegment] = []
    for seg in lora.segments:
        slot = seg.adapter.slots.get((layer, module))
        if slot is None:
            continue
        if seg.length == 1:
            singles[slot.rank].append(seg)
        else:
            multi.append(seg)
    return singles, multi


def _rows(pool_rows: torch.Tensor, index: torch.Tensor, rank: int) -> torch.Tensor:
    return pool_rows.index_select(0, index).view(rank, -1)


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> torch.Tensor:  # [T, max_rank]; columns beyond a segment's rank are unused
    out = torch.zeros(x.shape[0], max(lora.max_rank, 1), dtype=x.dtype, device=x.device)
    singles, multi = _groups(lora, layer, module)
    for rank, segs in singles.items():
        tok = torch.tensor([s.start for s in segs], dtype=torch.long, device=x.device)
        index = torch.cat([s.adapter.a_index(layer, module) for s in segs])
        a = pool_rows.index_select(0, index).view(len(segs), rank, -1)  # [n, r, in]
        scale = torch.tensor([s.adapter.slots[(layer, module)].scale for s in segs], dtype=x.dtype, device=x.device)
        s_ = torch.bmm(a, x[tok].unsqueeze(-1)).squeeze(-1)  # [n, r]
        out[tok, :rank] = s_ * scale[:, None]
    for seg in multi:
        slot = seg.adapter.slots[(layer, module)]
        a = _rows(pool_rows, seg.adapter.a_index(layer, module), slot.rank)  # [r, in]
        xs = x[seg.start : seg.start + seg.length]
        out[seg.start : seg.start + seg.length, : slot.rank] = (xs @ a.t()) * slot.scale
    return out


def lora_expand(
    y: torch.Tensor,  # [T, out], updated in place (may be a column slice of a fused output)
    s: torch.Tensor,  # [T, max_rank] from lora_shrink
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> None:
    singles, multi = _groups(lora, layer, module)
    for rank, segs in singles.items():
        tok = torch.tensor([s_.start for s_ in segs], dtype=torch.long, device=y.device)
        index = torch.cat([s_.adapter.b_index(layer, module) for s_ in segs])
        b = pool_rows.index_select(0, index).view(len(segs), rank, -1)  # [n, r, out]
        delta = torch.bmm(s[tok, :rank].unsqueeze(1), b).squeeze(1)  # [n, out]
        y.index_add_(0, tok, delta)
    for seg in multi:
        slot = seg.adapter.slots[(layer, module)]
        b = _rows(pool_rows, seg.adapter.b_index(layer, module), slot.rank)  # [r, out]
        y[seg.start : seg.start + seg.length] += s[seg.start : seg.start + seg.length, : slot.rank] @ b


def apply_lora(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> None:
    """y += each token's adapter delta for (layer, module); tokens without one are untouched."""
    if not any((layer, module) in seg.adapter.slots for seg in lora.segments):
        return
    s = lora_shrink(x, pool_rows, lora, layer, module)
    lora_expand(y, s, pool_rows, lora, layer, module)
