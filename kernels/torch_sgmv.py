"""SGMV shrink/expand in plain torch: the CPU path and the reference for the Triton kernels.

For each segment s of tokens sharing adapter a:  y[seg] += scale_a * (x[seg] @ A_a^T) @ B_a^T,
with A_a^T [in, r] and B_a^T [r, out] read from the unified pool through the adapter's page table
(pool_rows is the pool viewed as [rows, D]; AdapterResidency.a_index/b_index give the physical
rows of one (layer, module)).

Why two shapes of loop: the tokens of short segments (decode, one token per request) are batched per
rank, since a Python loop over a batch of 64 distinct adapters would cost more than the arithmetic; segments of several tokens (prefill
chunks, or many decode tokens sharing an adapter) are one matmul each, on a view of the matrix where
its pool rows are consecutive and on a gathered copy where they are not.

The batched one-token path reads the weights in place with embedding_bag: both products are sums of
weight rows scaled by one number each, which is what embedding_bag computes (with per_sample_weights),
gathering the rows through an index without copying them out. Measured on the dev CPU for 64 distinct
rank-16 adapters (1 thread): 18.5 GB/s of adapter weights against 6.9 GB/s for a row gather + bmm,
with a 25 GB/s streaming read as the ceiling.
- shrink: s_t = sum_i x_t[i] * A^T[i, :], bags of `in` rows of A^T; rows of g = gcd(rank, D)
  elements (the pool viewed as [-1, g]), so a bag is one g-column band of A^T and a token has r/g bags.
- expand: y_t[c*D:(c+1)*D] = sum_k s_t[k] * B^T[k, c*D:(c+1)*D], bags of r pool rows, out/D per token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .metadata import LoraBatch, LoraSegment


# Segments up to this many tokens join the batched in-place path, token by token (a token's bags re-read
# its adapter's rows, which one (layer, module) keeps in cache: at most a few hundred KB); longer ones
# (prefill chunks) are a matmul each. Measured on the dev CPU: 30 adapters shared by 64 decode tokens
# (segments of 2-3 tokens) took 682 ms per step through per-segment matmuls against 176 ms without
# adapters, the per-segment op overhead (about 5 small ops per segment, layer and module) dominating.
SHORT_SEGMENT = 16


@dataclass(frozen=True)
class _TokenGroup:
    """Tokens of short segments whose adapters have one rank, multiplied as one batch of embedding bags."""

    rank: int
    band: int  # g = gcd(rank, D): width of the A^T column bands the shrink bags sum
    tokens: torch.Tensor  # [n] int64
    span: tuple[int, int] | None  # (first, end) when tokens are first..end-1: slices instead of indexing
    shrink_index: torch.Tensor  # [n * rank/g * in], rows of the pool viewed as [-1, g]
    shrink_offsets: torch.Tensor  # [n * rank/g], bag starts (every bag has `in` rows)
    expand_index: torch.Tensor  # [n * out/D * rank], rows of the pool viewed as [-1, D]
    expand_offsets: torch.Tensor  # [n * out/D], bag starts (every bag has `rank` rows)
    scales: torch.Tensor  # [n, 1] in the activation dtype

    def take(self, x: torch.Tensor) -> torch.Tensor:  # [T, F] -> [n, F]
        return x[self.span[0] : self.span[1]] if self.span is not None else x.index_select(0, self.tokens)

    def add_to(self, y: torch.Tensor, delta: torch.Tensor) -> None:  # y [T, out] += delta [n, out] at tokens
        if self.span is not None:
            y[self.span[0] : self.span[1]] += delta
        else:
            y.index_add_(0, self.tokens, delta)


@dataclass(frozen=True)
class _Plan:
    singles: tuple[_TokenGroup, ...]
    multi: tuple[LoraSegment, ...]


def _index_dtype(pool_rows: torch.Tensor, band: int) -> torch.dtype:
    # int32 halves the index bytes that every bag reads beside its weights (about 6% of the weight
    # bytes at rank 16 instead of 12%) wherever the row numbers fit.
    return torch.int32 if pool_rows.numel() // band < 2**31 else torch.int64


def _bag_indices(adapter, layer: int, module: int, pool_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(shrink index [r/g * in], expand index [out/D * r]) of one (layer, module), cached on the
    adapter's residency: they only depend on its pages."""
    cache = adapter.kernel_cache
    key = ("bags", layer, module)
    hit = cache.get(key)
    if hit is not None:
        return hit
    slot = adapter.slots[(layer, module)]
    d = pool_rows.shape[1]
    r, n_in, n_out = slot.rank, slot.in_features, slot.out_features
    g = math.gcd(r, d)
    dtype = _index_dtype(pool_rows, g)
    a_rows = adapter.a_index(layer, module)  # [r*in/D] physical rows of A^T [in, r]
    # Element i*r + j*g of A^T starts band j of input i; ordered (j, i): bag j of a token sums over i.
    e = (torch.arange(n_in, device=a_rows.device)[None, :] * r + torch.arange(0, r, g, device=a_rows.device)[:, None])
    shrink = ((a_rows[e // d] * d + e % d) // g).reshape(-1).to(dtype)
    # B^T [r, out] is r rows of out/D pool rows; ordered (c, k): bag c of a token sums over k.
    b_rows = adapter.b_index(layer, module).view(r, n_out // d)
    expand = b_rows.t().reshape(-1).to(_index_dtype(pool_rows, d))
    cache[key] = (shrink, expand)
    return shrink, expand


def _plan(lora: LoraBatch, layer: int, module: int, pool_rows: torch.Tensor, dtype: torch.dtype) -> _Plan | None:
    """Group the segments carrying (layer, module); cached on the batch, since shrink and expand
    (and every call of a step) need the same grouping."""
    cache = lora.plan_cache
    key = (layer, module)
    if key in cache:
        return cache[key]
    device = pool_rows.device
    by_rank: dict[int, list[LoraSegment]] = {}
    multi: list[LoraSegment] = []
    for seg in lora.segments:
        slot = seg.adapter.slots.get(key)
        if slot is None or seg.length == 0:
            continue
        if seg.length <= SHORT_SEGMENT:
            by_rank.setdefault(slot.rank, []).append(seg)
        else:
            multi.append(seg)
    singles = []
    for rank, segs in by_rank.items():
        # Even a lone one-token segment goes here: embedding_bag reads its rows in place, where the
        # matmul path would first copy the matrices out of scattered pages.
        slot = segs[0].adapter.slots[key]
        g = math.gcd(rank, pool_rows.shape[1])
        bags = [_bag_indices(s.adapter, layer, module, pool_rows) for s in segs]
        # Token-major: each token of a segment repeats its adapter's bags.
        shrink_index = torch.cat([b[0].repeat(s.length) for b, s in zip(bags, segs)])
        expand_index = torch.cat([b[1].repeat(s.length) for b, s in zip(bags, segs)])
        starts = [t for s in segs for t in range(s.start, s.start + s.length)]
        n = len(starts)
        contiguous = starts == list(range(starts[0], starts[0] + n))
        singles.append(
            _TokenGroup(
                rank=rank,
                band=g,
                tokens=torch.tensor(starts, dtype=torch.long, device=device),
                span=(starts[0], starts[0] + n) if contiguous else None,
                shrink_index=shrink_index,
                shrink_offsets=torch.arange(n * rank // g, dtype=shrink_index.dtype, device=device) * slot.in_features,
                expand_index=expand_index,
                expand_offsets=torch.arange(n * (slot.out_features // pool_rows.shape[1]), dtype=expand_index.dtype,
                                            device=device) * rank,
                scales=torch.tensor([[s.adapter.slots[key].scale] for s in segs for _ in range(s.length)],
                                    dtype=dtype, device=device),
            )
        )
    plan = _Plan(tuple(singles), tuple(multi)) if (singles or multi) else None
    cache[key] = plan
    return plan


def _shrink_group(
    g: _TokenGroup,
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
) -> torch.Tensor:  # [n, rank], scale applied
    n = g.tokens.numel()
    xs = g.take(x)  # [n, in]
    bands = g.rank // g.band
    # Each of a token's r/g bags weighs its rows by the same activations.
    w = xs.contiguous() if bands == 1 else xs.unsqueeze(1).expand(n, bands, xs.shape[1])
    s = F.embedding_bag(g.shrink_index, pool_rows.view(-1, g.band), g.shrink_offsets, mode="sum",
                        per_sample_weights=w.reshape(-1))  # [n * r/g, g]
    return s.view(n, g.rank) * g.scales


def _expand_group(
    g: _TokenGroup,
    s: torch.Tensor,  # [n, rank]
    pool_rows: torch.Tensor,  # [R, D]
) -> torch.Tensor:  # [n, out]
    n = s.shape[0]
    per_token = g.expand_offsets.numel() // n  # out / D bags per token, each weighing its rows by s_t
    w = s.unsqueeze(1).expand(n, per_token, g.rank).reshape(-1)
    out = F.embedding_bag(g.expand_index, pool_rows, g.expand_offsets, mode="sum", per_sample_weights=w)
    return out.view(n, -1)  # [n * out/D, D] -> [n, out]


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> torch.Tensor:  # [T, max_rank]; scale applied; columns beyond a segment's rank stay 0
    out = torch.zeros(x.shape[0], max(lora.max_rank, 1), dtype=x.dtype, device=x.device)
    plan = _plan(lora, layer, module, pool_rows, x.dtype)
    if plan is None:
        return out
    for g in plan.singles:
        out[g.tokens, : g.rank] = _shrink_group(g, x, pool_rows)  # (a [T, max_rank] buffer: no in-place add)
    for seg in plan.multi:
        slot = seg.adapter.slots[(layer, module)]
        at = _a_t(pool_rows, seg.adapter, layer, module)  # [in, r]
        out[seg.start : seg.start + seg.length, : slot.rank] = (x[seg.start : seg.start + seg.length] @ at) * slot.scale
    return out


def lora_expand(
    y: torch.Tensor,  # [T, out], updated in place (may be a column slice of a fused output)
    s: torch.Tensor,  # [T, max_rank] from lora_shrink
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> None:
    plan = _plan(lora, layer, module, pool_rows, s.dtype)
    if plan is None:
        return
    for g in plan.singles:
        g.add_to(y, _expand_group(g, g.take(s)[:, : g.rank], pool_rows))
    for seg in plan.multi:
        slot = seg.adapter.slots[(layer, module)]
        bt = _b_t(pool_rows, seg.adapter, layer, module, slot.rank)  # [r, out]
        y[seg.start : seg.start + seg.length] += s[seg.start : seg.start + seg.length, : slot.rank] @ bt


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
    plan = _plan(lora, layer, module, pool_rows, x.dtype)
    if plan is None:
        return
    for g in plan.singles:
        g.add_to(y, _expand_group(g, _shrink_group(g, x, pool_rows), pool_rows))
    apply_segments(y, x, pool_rows, plan.multi, layer, module)


def apply_segments(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    segments: tuple[LoraSegment, ...],  # each of several tokens, its adapter carrying (layer, module)
    layer: int,
    module: int,
) -> None:
    """y[seg] += scale * (x[seg] @ A^T) @ B^T, one GEMM pair per segment (long segments: BLAS speed)."""
    for seg in segments:
        slot = seg.adapter.slots[(layer, module)]
        at = _a_t(pool_rows, seg.adapter, layer, module)  # [in, r]
        bt = _b_t(pool_rows, seg.adapter, layer, module, slot.rank)  # [r, out]
        rows = slice(seg.start, seg.start + seg.length)
        # addmm_ folds the scale and the add into the expand (measured 1.3x faster than mm, mul, add).
        y[rows].addmm_(x[rows] @ at, bt, alpha=slot.scale)


def _rows(pool_rows: torch.Tensor, adapter, index: torch.Tensor, key: tuple) -> torch.Tensor:
    """[len(index), D] pool rows of one matrix: a view when they are consecutive (an adapter placed on
    a run of free pages, the usual case), else a copy gathered through the page table. Which of the two
    is decided once per residency and cached."""
    first = adapter.kernel_cache.get(key)
    if first is None:
        n = index.numel()
        consecutive = n > 0 and bool((index[1:] - index[:-1] == 1).all())
        first = adapter.kernel_cache[key] = int(index[0]) if consecutive else -1
    if first >= 0:
        return pool_rows[first : first + index.numel()]
    return pool_rows.index_select(0, index)


def _a_t(pool_rows: torch.Tensor, adapter, layer: int, module: int) -> torch.Tensor:
    """One adapter's A^T [in, r] (a segment of several tokens multiplies it by all of them)."""
    slot = adapter.slots[(layer, module)]
    rows = _rows(pool_rows, adapter, adapter.a_index(layer, module), ("a_first", layer, module))
    return rows.view(slot.in_features, slot.rank)


def _b_t(pool_rows: torch.Tensor, adapter, layer: int, module: int, rank: int) -> torch.Tensor:
    """One adapter's B^T [r, out]."""
    return _rows(pool_rows, adapter, adapter.b_index(layer, module), ("b_first", layer, module)).view(rank, -1)
