"""Paged attention in plain torch: the CPU path and the reference the Triton kernels match.

K/V are read through block tables from the unified pool: kv_pool is the pool viewed as
[num_pages, 2, block_size, num_kv_heads, head_dim]. Decode sequences (one new token) are attended
together in one batched gather; prefill chunks one sequence at a time (causal inside the chunk,
full over the tokens cached before it).
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata


def write_kv(
    kv_pool: torch.Tensor,  # [num_pages, 2, block_size, kv_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    meta: AttentionMetadata,
    layer: int,
) -> None:
    """Store this step's new K/V of every token in its block's page for this layer."""
    pages = meta.slot_pages[layer]
    kv_pool[pages, 0, meta.slot_offsets] = k
    kv_pool[pages, 1, meta.slot_offsets] = v


def _attend(
    q: torch.Tensor,  # [B, kv_heads, G*Q, head_dim]
    k: torch.Tensor,  # [B, kv_heads, N, head_dim]
    v: torch.Tensor,  # [B, kv_heads, N, head_dim]
    mask: torch.Tensor,  # [B, 1, G*Q or 1, N] bool, True = may attend
    scale: float,
) -> torch.Tensor:  # [B, kv_heads, G*Q, head_dim]
    # Softmax in float32 (as transformers does) so half-precision runs stay close to the reference.
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_pool: torch.Tensor,  # [num_pages, 2, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    layer: int,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv_pool.shape[3]
    group = num_heads // kv_heads
    bs = meta.block_size
    out = torch.empty_like(q)
    tables = meta.block_tables[layer]  # [S, max_blocks]
    starts = meta.query_start_host

    decode = meta.decode_seqs
    if decode:
        idx = list(decode)
        lens = [meta.seq_lens_host[i] for i in idx]
        nblocks = (max(lens) + bs - 1) // bs
        pages = tables[idx, :nblocks].long()  # [B, nb]
        b = len(idx)
        # index_select on whole pages: a plain memcpy per page, several times faster on the CPU
        # than advanced indexing with a 2-D index.
        kv = kv_pool.index_select(0, pages.view(-1)).view(b, nblocks, *kv_pool.shape[1:])  # [B, nb, 2, bs, kvh, hd]
        kv = kv.permute(0, 2, 4, 1, 3, 5).reshape(b, 2, kv_heads, nblocks * bs, head_dim)
        tok = torch.tensor([starts[i] for i in idx], dtype=torch.long, device=q.device)
        qd = q[tok].view(b, kv_heads, group, head_dim)
        n = nblocks * bs
        mask = torch.arange(n, device=q.device)[None, :] < torch.tensor(lens, device=q.device)[:, None]
        # Slots past a sequence's length hold whatever the page's last owner left; zero their V so
        # that a stale non-finite value cannot turn a zero attention weight into NaN.
        v = kv[:, 1].masked_fill(~mask[:, None, :, None], 0)
        o = _attend(qd, kv[:, 0], v, mask[:, None, None, :], scale)  # [B, kvh, G, hd]
        out[tok] = o.reshape(b, num_heads, head_dim)

    for i in meta.prefill_seqs:
        qlen, slen = meta.query_lens_host[i], meta.seq_lens_host[i]
        ctx = slen - qlen
        nblocks = (slen + bs - 1) // bs
        pages = tables[i, :nblocks].long()
        kv = kv_pool.index_select(0, pages)  # [nb, 2, bs, kvh, hd]
        kv = kv.permute(1, 3, 0, 2, 4).reshape(2, kv_heads, nblocks * bs, head_dim)[:, :, :slen]
        s0 = starts[i]
        # [qlen, H, hd] -> [kvh, G*qlen, hd], grouping the query heads that share a K/V head.
        qp = q[s0 : s0 + qlen].view(qlen, kv_heads, group, head_dim).permute(1, 2, 0, 3)
        qp = qp.reshape(kv_heads, group * qlen, head_dim)
        qpos = torch.arange(ctx, slen, device=q.device)
        causal = torch.arange(slen, device=q.device)[None, :] <= qpos[:, None]  # [qlen, slen]
        mask = causal.repeat(group, 1)[None]  # [1, G*qlen, slen]
        o = _attend(qp[None], kv[0][None], kv[1][None], mask[:, None], scale)[0]  # [kvh, G*qlen, hd]
        o = o.view(kv_heads, group, qlen, head_dim).permute(2, 0, 1, 3).reshape(qlen, num_heads, head_dim)
        out[s0 : s0 + qlen] = o
    return out
