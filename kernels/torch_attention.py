"""Paged attention in plain torch: the CPU path and the reference the Triton kernels match.

K/V are read through block tables from the unified pool: kv_pool is the pool viewed as
[num_pages, 2, block_size, num_kv_heads, head_dim]. Decode sequences (one new token) are attended
together: one gather of all their K and V blocks per layer and one scaled_dot_product_attention
call over the padded batch with a length mask. Prefill chunks go one sequence at a time (causal
inside the chunk, full over the tokens cached before it). Index plans are built once per step
(torch_attention_plan) and reused by every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata
from .torch_attention_plan import decode_plan, write_rows


def write_kv(
    kv_pool: torch.Tensor,  # [num_pages, 2, block_size, kv_heads, head_dim]
    k: torch.Tensor,  # [T, kv_heads, head_dim]
    v: torch.Tensor,  # [T, kv_heads, head_dim]
    meta: AttentionMetadata,
    layer: int,
) -> None:
    """Store this step's new K/V of every token in its block's page for this layer."""
    t = k.shape[0]
    rows = write_rows(meta, k.device)[layer]  # [2, T]
    slots = kv_pool.view(-1, kv_pool.shape[3] * kv_pool.shape[4])  # token rows (see torch_attention_plan)
    # index_copy_ on one flat row index: cheaper than advanced indexing with two index tensors.
    slots.index_copy_(0, rows[0], k.reshape(t, -1))
    slots.index_copy_(0, rows[1], v.reshape(t, -1))


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_pool: torch.Tensor,  # [num_pages, 2, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    layer: int,
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv_pool.shape[3]
    gqa = num_heads != kv_heads
    bs = meta.block_size
    blocks = kv_pool.view(-1, bs * kv_heads * head_dim)  # block rows (see torch_attention_plan)

    plan = decode_plan(meta, q.device, q.dtype)
    if plan is not None:
        b, n = plan.num_seqs, plan.num_slots
        # One index_select of whole blocks (a memcpy per block) gives K as [B, N, kvh, hd] and V
        # likewise, contiguous per sequence: SDPA reads them through strides, no permute copy.
        kv = blocks.index_select(0, plan.rows[layer])  # [2*B*nb, bs*kvh*hd]
        if plan.stale is not None:
            kv.view(2 * b * n, -1).index_fill_(0, plan.stale, 0)
        kv = kv.view(2, b, n, kv_heads, head_dim).transpose(2, 3)  # [2, B, kvh, N, hd]
        qd = q if plan.tok is None else q.index_select(0, plan.tok)  # [B, H, hd]
        o = F.scaled_dot_product_attention(
            qd.unsqueeze(2), kv[0], kv[1], attn_mask=plan.mask, scale=scale, enable_gqa=gqa
        )  # [B, H, 1, hd]
        if plan.tok is None:
            return o.reshape(b, num_heads, head_dim)
        out = torch.empty_like(q)
        out[plan.tok] = o.view(b, num_heads, head_dim)
    else:
        out = torch.empty_like(q)
    prefill_attention(out, q, kv_pool, meta, layer, scale)
    return out


def prefill_attention(
    out: torch.Tensor,  # [T, num_heads, head_dim], written at the prefill chunks' tokens only
    q: torch.Tensor,  # [T, num_heads, head_dim]
    kv_pool: torch.Tensor,  # [num_pages, 2, block_size, kv_heads, head_dim]
    meta: AttentionMetadata,
    layer: int,
    scale: float,
) -> None:
    """Attention of each prefill chunk (causal inside it, full over the tokens cached before it),
    one sequence at a time; decode tokens' rows of out are left as they are."""
    head_dim, kv_heads = q.shape[2], kv_pool.shape[3]
    gqa = q.shape[1] != kv_heads
    bs = meta.block_size
    blocks = kv_pool.view(-1, bs * kv_heads * head_dim)  # block rows (see torch_attention_plan)
    tables = meta.block_tables[layer]  # [S, max_blocks]
    starts = meta.query_start_host
    for i in meta.prefill_seqs:
        qlen, slen = meta.query_lens_host[i], meta.seq_lens_host[i]
        ctx = slen - qlen
        nblocks = (slen + bs - 1) // bs
        pages = tables[i, :nblocks].long()
        kv = blocks.index_select(0, torch.cat((pages * 2, pages * 2 + 1)))  # [2*nb, bs*kvh*hd]
        kv = kv.view(2, nblocks * bs, kv_heads, head_dim)[:, :slen].transpose(1, 2)  # [2, kvh, slen, hd]
        s0 = starts[i]
        qp = q[s0 : s0 + qlen].transpose(0, 1)  # [H, qlen, hd]
        qpos = torch.arange(ctx, slen, device=q.device)
        causal = torch.arange(slen, device=q.device)[None, :] <= qpos[:, None]  # [qlen, slen]
        o = F.scaled_dot_product_attention(
            qp[None], kv[0][None], kv[1][None], attn_mask=causal, scale=scale, enable_gqa=gqa
        )  # [1, H, qlen, hd]
        out[s0 : s0 + qlen] = o[0].transpose(0, 1)
