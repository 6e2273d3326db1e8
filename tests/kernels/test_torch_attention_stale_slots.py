"""Decode attention must ignore whatever stale values sit in KV slots past a sequence's length."""

from __future__ import annotations

import torch

from loraplex.kernels import AttentionMetadata
from loraplex.kernels.torch_attention import paged_attention


def test_nan_in_unwritten_slots_does_not_leak():
    bs, kvh, hd, heads, pages = 4, 2, 8, 4, 12
    kv_pool = torch.full((pages, 2, bs, kvh, hd), float("nan"))
    lens = [5, 2, 9]  # each sequence's last block is only partly written
    tables = torch.zeros(1, len(lens), 3, dtype=torch.int32)
    free = iter(torch.randperm(pages).tolist())
    ks, vs = [], []
    for s, n in enumerate(lens):
        k, v = torch.randn(n, kvh, hd), torch.randn(n, kvh, hd)
        ks.append(k)
        vs.append(v)
        for b in range((n + bs - 1) // bs):
            page = next(free)
            tables[0, s, b] = page
            m = min(bs, n - b * bs)
            kv_pool[page, 0, :m] = k[b * bs : b * bs + m]
            kv_pool[page, 1, :m] = v[b * bs : b * bs + m]
    q = torch.randn(len(lens), heads, hd)
    meta = AttentionMetadata(
        block_size=bs,
        positions=torch.tensor([n - 1 for n in lens]),
        query_start=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        slot_pages=torch.zeros(1, len(lens), dtype=torch.long),
        slot_offsets=torch.zeros(len(lens), dtype=torch.long),
        query_lens_host=(1,) * len(lens),
        seq_lens_host=tuple(lens),
    )
    out = paged_attention(q, kv_pool, meta, 0, hd**-0.5)
    assert torch.isfinite(out).all()
    group = heads // kvh
    for s in range(len(lens)):
        k = ks[s].double().repeat_interleave(group, dim=1)  # [n, heads, hd]
        v = vs[s].double().repeat_interleave(group, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[s].double(), k) * hd**-0.5, dim=-1)
        ref = torch.einsum("hn,nhd->hd", w, v)
        assert torch.allclose(out[s].double(), ref, atol=1e-5)
