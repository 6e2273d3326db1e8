"""SGMV shrink/expand in plain torch: the CPU path and the reference for the Triton kernels.

For each segment s of tokens sharing adapter a:  y[seg] += scale_a * (x[seg] @ A_a^T) @ B_a^T,
with A_a's rows and B_a^T's rows read from the unified pool through the adapter's page table
(pool_rows is the pool viewed as [rows, D]; AdapterResidency.a_index/b_index give the physical
rows of one (layer, module)).

Why two shapes of loop: one-token segments (decode) of different adapters are batched per rank into one bmm, since a
Python loop over a batch of 64 distinct adapters would cost more than the arithmetic; segments of
several tokens (prefill chunks, or many decode tokens sharing an adapter) are one matmul each.
The gather of a (layer, module)'s rows is per step and cache-sized; the Triton path reads the
rows in place instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .metadata import LoraBatch, LoraSegment


@dataclass(frozen=True)
class _SingleGroup:
    """One-token segments of one rank: gathered and multiplied as one batch."""

    rank: int
    tokens: torch.Tensor  # [n] int64
    a_index: torch.Tensor  # [n * rank * in / D] int64, physical pool rows
    b_index: torch.Tensor  # [n * rank * out / D] int64
    scales: torch.Tensor  # [n, 1] in the activation dtype


@dataclass(frozen=True)
class _Plan:
    singles: tuple[_SingleGroup, ...]
    multi: tuple[LoraSegment, ...]


def _plan(lora: LoraBatch, layer: int, module: int, dtype: torch.dtype, device: torch.device) -> _Plan | None:
    """Group the segments carrying (layer, module); cached on the batch, since shrink and expand
    (and every call of a step) need the same grouping."""
    cache = lora.plan_cache
    key = (layer, module)
    if key in cache:
        return cache[key]
    by_rank: dict[int, list[LoraSegment]] = {}
    multi: list[LoraSegment] = []
    for seg in lora.segments:
        slot = seg.adapter.slots.get(key)
        if slot is None:
            continue
        if seg.length == 1:
            by_rank.setdefault(slot.rank, []).append(seg)
        else:
            multi.append(seg)
    singles = []
    for rank, segs in list(by_rank.items()):
        if len(segs) == 1:  # nothing to batch: the direct path reads the matrix in place
            multi.extend(segs)
            continue
        singles.append(
            _SingleGroup(
                rank=rank,
                tokens=torch.tensor([s.start for s in segs], dtype=torch.long, device=device),
                a_index=torch.cat([s.adapter.a_index(layer, module) for s in segs]),
                b_index=torch.cat([s.adapter.b_index(layer, module) for s in segs]),
                scales=torch.tensor([[s.adapter.slots[key].scale] for s in segs], dtype=dtype, device=device),
            )
        )
    plan = _Plan(tuple(singles), tuple(multi)) if (singles or multi) else None
    cache[key] = plan
    return plan


def _gather(pool_rows: torch.Tensor, index: torch.Tensor, n: int, rank: int) -> torch.Tensor:
    return pool_rows.index_select(0, index).view(n, rank, -1)  # [n, r, features]


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> torch.Tensor:  # [T, max_rank]; scale applied; columns beyond a segment's rank stay 0
    out = torch.zeros(x.shape[0], max(lora.max_rank, 1), dtype=x.dtype, device=x.device)
    plan = _plan(lora, layer, module, x.dtype, x.device)
    if plan is None:
        return out
    for g in plan.singles:
        a = _gather(pool_rows, g.a_index, g.tokens.numel(), g.rank)  # [n, r, in]
        out[g.tokens, : g.rank] = torch.bmm(a, x[g.tokens].unsqueeze(-1)).squeeze(-1) * g.scales
    for seg in plan.multi:
        slot = seg.adapter.slots[(layer, module)]
        a = _matrix(pool_rows, seg.adapter, layer, module, slot.rank, "a")  # [r, in]
        out[seg.start : seg.start + seg.length, : slot.rank] = (x[seg.start : seg.start + seg.length] @ a.t()) * slot.scale
    return out


def lora_expand(
    y: torch.Tensor,  # [T, out], updated in place (may be a column slice of a fused output)
    s: torch.Tensor,  # [T, max_rank] from lora_shrink
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> None:
    plan = _plan(lora, layer, module, s.dtype, s.device)
    if plan is None:
        return
    for g in plan.singles:
        b = _gather(pool_rows, g.b_index, g.tokens.numel(), g.rank)  # [n, r, out]
        y.index_add_(0, g.tokens, torch.bmm(s[g.tokens, : g.rank].unsqueeze(1), b).squeeze(1))
    for seg in plan.multi:
        slot = seg.adapter.slots[(layer, module)]
        b = _matrix(pool_rows, seg.adapter, layer, module, slot.rank, "b")  # [r, out]
        y[seg.start : seg.start + seg.length] += s[seg.start : seg.start + seg.length, : slot.rank] @ b


def apply_lora(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> None:
    """y += each token's adapter delta for (layer, module); tokens without one are untouched.

    Same arithmetic as lora_shrink then lora_expand, without the [T, max_rank] buffer between them.
    """
    plan = _plan(lora, layer, module, x.dtype, x.device)
    if plan is None:
        return
    for g in plan.singles:
        n = g.tokens.numel()
        a = _gather(pool_rows, g.a_index, n, g.rank)  # [n, r, in]
        s = torch.bmm(a, x[g.tokens].unsqueeze(-1)) * g.scales.unsqueeze(-1)  # [n, r, 1]
        b = _gather(pool_rows, g.b_index, n, g.rank)  # [n, r, out]
        y.index_add_(0, g.tokens, torch.bmm(s.transpose(1, 2), b).squeeze(1))
    for seg in plan.multi:
        slot = seg.adapter.slots[(layer, module)]
        a = _matrix(pool_rows, seg.adapter, layer, module, slot.rank, "a")  # [r, in]
        b = _matrix(pool_rows, seg.adapter, layer, module, slot.rank, "b")  # [r, out]
        rows = slice(seg.start, seg.start + seg.length)
        y[rows] += ((x[rows] @ a.t()) * slot.scale) @ b


def _matrix(pool_rows: torch.Tensor, adapter, layer: int, module: int, rank: int, which: str) -> torch.Tensor:
    """One adapter's A [r, in] or B^T [r, out], gathered through its page table."""
    index = adapter.a_index(layer, module) if which == "a" else adapter.b_index(layer, module)
    return pool_rows.index_select(0, index).view(rank, -1)
