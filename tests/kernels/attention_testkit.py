"""KV pools, block tables and a float64 attention reference for the attention tests."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import strategies as st
from kernel_testkit import DEVICE, PageDealer
from loraplex.kernels import AttentionMetadata
from loraplex.unified_pager.geometry import PoolGeometry
from loraplex.unified_pager.pool import PagePool


def kv_geometry(block_size: int, kv_heads: int, head_dim: int, num_layers: int, num_pages: int,
                dtype: torch.dtype) -> PoolGeometry:
    d = head_dim
    return PoolGeometry(num_pages=num_pages, row_width=d, rows_per_page=2 * block_size * kv_heads,
                        block_size=block_size, num_layers=num_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                        dtype=dtype)


def build_attention_meta(
    seqs: list[tuple[int, int]],  # (tokens cached before this step, new tokens) per sequence
    block_size: int,
    num_layers: int,
    dealer: PageDealer,
    device: torch.device = DEVICE,
) -> AttentionMetadata:
    """Block tables on scattered pages (distinct per layer), as the runner builds them."""
    max_blocks = max(-(-(c + q) // block_size) for c, q in seqs)
    tables = torch.zeros(num_layers, len(seqs), max_blocks, dtype=torch.int32)
    positions, seq_of_token = [], []
    for s, (ctx, q) in enumerate(seqs):
        nb = -(-(ctx + q) // block_size)
        for layer in range(num_layers):
            tables[layer, s, :nb] = torch.from_numpy(dealer.take(nb).astype(np.int32))
        positions.extend(range(ctx, ctx + q))
        seq_of_token.extend([s] * q)
    pos = torch.tensor(positions, dtype=torch.long)
    seq_t = torch.tensor(seq_of_token, dtype=torch.long)
    qs = [0]
    for _, q in seqs:
        qs.append(qs[-1] + q)
    return AttentionMetadata(
        block_size=block_size,
        positions=pos.to(device),
        query_start=torch.tensor(qs, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_pages=tables[:, seq_t, pos // block_size].long().to(device),
        slot_offsets=(pos % block_size).to(device),
        query_lens_host=tuple(q for _, q in seqs),
        seq_lens_host=tuple(c + q for c, q in seqs),
    )


def gather_kv(kv_pool: torch.Tensor, meta: AttentionMetadata, layer: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([n, kvh, hd], [n, kvh, hd]) keys and values 0..seq_len of sequence s, read token by token."""
    bs = meta.block_size
    n = meta.seq_lens_host[s]
    pages = meta.block_tables[layer, s].long().to(kv_pool.device)
    idx = torch.arange(n)
    rows = kv_pool[pages[idx // bs], :, idx % bs]  # [n, 2, kvh, hd]
    return rows[:, 0], rows[:, 1]


def attention_ref(q: torch.Tensor, kv_pool: torch.Tensor, meta: AttentionMetadata, layer: int,
                  scale: float) -> torch.Tensor:  # [T, H, hd] float64
    """Causal attention of every new token over its sequence's keys 0..position, in float64."""
    T, H, hd = q.shape
    kvh = kv_pool.shape[3]
    group = H // kvh
    out = torch.empty(T, H, hd, dtype=torch.float64)
    starts = meta.query_start_host
    q = q.cpu()
    for s, qlen in enumerate(meta.query_lens_host):
        k, v = (t.double().cpu() for t in gather_kv(kv_pool, meta, layer, s))
        ctx = meta.seq_lens_host[s] - qlen
        for j in range(qlen):
            t = starts[s] + j
            pos = ctx + j
            kk = k[: pos + 1].repeat_interleave(group, dim=1)  # [n, H, hd]
            vv = v[: pos + 1].repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[t].double(), kk) * scale
            out[t] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), vv)
    return out


@dataclass(frozen=True)
class AttentionSpec:
    block_size: int
    kv_heads: int
    group: int  # query heads per KV head (1: MHA)
    head_dim: int
    seqs: tuple[tuple[int, int], ...]  # (cached tokens, new tokens)
    layer: int  # of 2
    seed: int


@st.composite
def attention_specs(draw, max_ctx: int = 40, max_new: int = 12, max_seqs: int = 5) -> AttentionSpec:
    n = draw(st.integers(1, max_seqs))
    seqs = draw(st.lists(
        st.tuples(st.integers(0, max_ctx), st.one_of(st.just(1), st.integers(1, max_new))), min_size=n, max_size=n))
    return AttentionSpec(
        block_size=draw(st.integers(1, 8)),
        kv_heads=draw(st.integers(1, 2)),
        group=draw(st.sampled_from([1, 3, 8])),
        head_dim=draw(st.sampled_from([16, 24, 40])),
        seqs=tuple(seqs),
        layer=draw(st.integers(0, 1)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@dataclass
class AttentionCase:
    meta: AttentionMetadata
    kv_pool: torch.Tensor  # [P, 2, bs, kvh, hd], the cached tokens already in place
    q: torch.Tensor  # [T, H, hd]
    k: torch.Tensor  # [T, kvh, hd], this step's new keys (not yet written)
    v: torch.Tensor  # [T, kvh, hd], a strided view, as the model's slice of its fused qkv output
    scale: float


def build_attention_case(spec: AttentionSpec, dtype: torch.dtype, poison_unused: bool,
                         device: torch.device = DEVICE) -> AttentionCase:
    """Random cached K/V on scattered pages. With poison_unused, every pool slot that is not a
    cached or new token of some sequence holds NaN, so reading past a sequence's end shows."""
    rng = random.Random(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    bs = spec.block_size
    blocks = sum(-(-(c + q) // bs) for c, q in spec.seqs)
    geometry = kv_geometry(bs, spec.kv_heads, spec.head_dim, 2, 2 * blocks + 4, dtype)
    pool = PagePool(geometry, device)
    kv = pool.kv_view()
    host = torch.randn(tuple(kv.shape), generator=gen).to(dtype)
    meta = build_attention_meta(list(spec.seqs), bs, 2, PageDealer(geometry.num_pages, rng), device)
    if poison_unused:
        keep = torch.zeros(geometry.num_pages, bs, dtype=torch.bool)
        for layer in range(2):
            for s, (ctx, _) in enumerate(spec.seqs):
                idx = torch.arange(ctx)
                keep[meta.block_tables[layer, s].long().cpu()[idx // bs], idx % bs] = True
        drop = ~keep[:, None, :, None, None]  # [P, 1, bs, 1, 1] over [P, 2, bs, kvh, hd]
        host = host.masked_fill(drop, float("nan"))
    kv.copy_(host.to(device))
    T, H = meta.num_tokens, spec.kv_heads * spec.group
    q = torch.randn(T, H, spec.head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(T, spec.kv_heads, spec.head_dim, generator=gen).to(dtype).to(device)
    fused = torch.randn(T, 3, spec.kv_heads, spec.head_dim, generator=gen).to(dtype).to(device)
    return AttentionCase(meta, kv, q, k, fused[:, 1], spec.head_dim**-0.5)
