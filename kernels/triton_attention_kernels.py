"""Paged attention and the K/V write as Triton kernels over the unified pool.

The pool is viewed as kv [num_pages, 2, BLOCK_SIZE, kv_heads, head_dim]; key n of sequence s is
row n % BLOCK_SIZE of page tables[s, n // BLOCK_SIZE] (one page per block per layer; the host
passes the layer's [S, max_blocks] table). Nothing is gathered into a contiguous K/V buffer: each
program walks the block table of its sequence and loads BLOCK_N keys at a time, one page lookup
per key (a small int32 load that stays in cache).

One program = one tile of one sequence x one KV head. Its BLOCK_M rows are (token, query head)
pairs: row i is token i // GROUP of the tile and query head kv_head * GROUP + i % GROUP, so the
GROUP query heads that share a K/V head (GQA/MQA; GROUP = 1 for MHA) read each K/V block once,
and a decode token of a GQA model still fills the rows of one tl.dot. Online softmax in float32
(as the torch path's float32 softmax), exp2 with log2(e) folded into the scale.

Causal masking: row r (token at absolute position pos_r) sees keys 0..pos_r, i.e. all cached
tokens and the chunk's tokens up to itself; the key loop stops at the tile's last position, so a
prefill tile never reads keys after its own tokens. A chunk may start mid-block: positions come
from seq_len - query_len, not from block boundaries.

Split-KV (flash-decoding) for decode batches too small to fill the GPU: NUM_SPLITS programs per
(tile, head) each take a slice of the keys and write unnormalised partials (max, sum, acc);
attention_combine_kernel merges them.
"""

from __future__ import annotations

import triton.language as tl

from .triton_launch import dual_kernel

LOG2E = 1.4426950408889634


@dual_kernel
def write_kv_kernel(
    k_ptr,  # [T, kv_heads, head_dim], unit last stride
    v_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    kv_ptr,  # [P, 2, BLOCK_SIZE, kv_heads, head_dim]
    stride_page,
    stride_kv,
    stride_slot,
    stride_head,
    slot_pages_ptr,  # [T] int64, this layer's page for each token
    slot_offsets_ptr,  # [T] int64, row in the page
    KVH,
    HD,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    page = tl.load(slot_pages_ptr + t).to(tl.int64)
    off = tl.load(slot_offsets_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < KVH)[:, None] & (d < HD)[None, :]
    dst = kv_ptr + page * stride_page + off * stride_slot + h[:, None] * stride_head + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(dst + stride_kv, v, mask=mask)


@dual_kernel
def paged_attention_kernel(
    q_ptr,  # [T, H, head_dim], unit last stride
    stride_qt,
    stride_qh,
    kv_ptr,  # [P, 2, BLOCK_SIZE, kv_heads, head_dim]
    stride_page,
    stride_kv,
    stride_slot,
    stride_head,
    out_ptr,  # [T, H, head_dim] (NUM_SPLITS == 1)
    stride_ot,
    stride_oh,
    part_m_ptr,  # [NT, kv_heads, NUM_SPLITS, BLOCK_M] float32 (NUM_SPLITS > 1)
    part_l_ptr,  # [NT, kv_heads, NUM_SPLITS, BLOCK_M] float32
    part_acc_ptr,  # [NT, kv_heads, NUM_SPLITS, BLOCK_M, BLOCK_D] float32
    tables_ptr,  # [S, max_blocks] int32, this layer's block tables
    stride_tab,
    query_start_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    tile_seq_ptr,  # [NT] int32
    tile_start_ptr,  # [NT] int32, first token of the tile in the flattened batch
    tile_len_ptr,  # [NT] int32, tokens in the tile
    qk_scale,  # softmax scale * log2(e)
    HD,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_kvh = tl.num_programs(1)
    seq = tl.load(tile_seq_ptr + tile)
    t0 = tl.load(tile_start_ptr + tile)
    tlen = tl.load(tile_len_ptr + tile)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    ctx = tl.load(seq_lens_ptr + seq) - q_len  # tokens cached before this chunk
    first_pos = ctx + (t0 - q_start)

    i = tl.arange(0, BLOCK_M)
    tok = i // GROUP
    head = kvh * GROUP + i % GROUP
    rmask = tok < tlen
    pos = first_pos + tok  # [BLOCK_M] absolute position of each row's token
    d = tl.arange(0, BLOCK_D)
    dmask = d < HD
    row_t = (t0 + tok).to(tl.int64)
    qv = tl.load(q_ptr + row_t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                 mask=rmask[:, None] & dmask[None, :], other=0.0)

    kv_end = first_pos + tlen  # keys 0 .. kv_end - 1 are seen by some row of the tile
    per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    n_lo = split * per_split
    n_hi = tl.minimum(n_lo + per_split, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table = tables_ptr + seq * stride_tab
    head_off = kvh * stride_head
    for n0 in range(n_lo, n_hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < n_hi
        page = tl.load(table + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        base = page * stride_page + (n % BLOCK_SIZE) * stride_slot + head_off  # [BLOCK_N]
        ldmask = nmask[:, None] & dmask[None, :]
        k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=ldmask, other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(qv, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, BLOCK_N]
        allowed = (n[None, :] <= pos[:, None]) & nmask[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no allowed key yet keeps m = -inf; shift by 0 there to avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(kv_ptr + stride_kv + base[:, None] + d[None, :], mask=ldmask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if NUM_SPLITS == 1:
        # Every real row sees key 0, so l_i > 0; padded rows are never stored.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        optrs = out_ptr + row_t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    else:
        prow = ((tile * num_kvh + kvh) * NUM_SPLITS + split).to(tl.int64) * BLOCK_M + i
        tl.store(part_m_ptr + prow, m_i)
        tl.store(part_l_ptr + prow, l_i)
        tl.store(part_acc_ptr + prow[:, None] * BLOCK_D + d[None, :], acc)


@dual_kernel
def attention_combine_kernel(
    out_ptr,  # [T, H, head_dim]
    stride_ot,
    stride_oh,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    tile_start_ptr,
    tile_len_ptr,
    HD,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """Merge the NUM_SPLITS partial softmaxes of one (tile, kv head) into its output rows."""
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    num_kvh = tl.num_programs(1)
    t0 = tl.load(tile_start_ptr + tile)
    tlen = tl.load(tile_len_ptr + tile)
    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    tok = i // GROUP
    head = kvh * GROUP + i % GROUP
    rmask = tok < tlen
    first = ((tile * num_kvh + kvh) * NUM_SPLITS).to(tl.int64) * BLOCK_M
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for sp in range(NUM_SPLITS):
        m_all = tl.maximum(m_all, tl.load(part_m_ptr + first + sp * BLOCK_M + i))
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    l_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for sp in range(NUM_SPLITS):
        prow = first + sp * BLOCK_M + i
        w = tl.exp2(tl.load(part_m_ptr + prow) - m_safe)  # 0 for a split that saw no key
        l_all += w * tl.load(part_l_ptr + prow)
        acc += w[:, None] * tl.load(part_acc_ptr + prow[:, None] * BLOCK_D + d[None, :])
    l_safe = tl.where(l_all > 0.0, l_all, 1.0)
    o = acc / l_safe[:, None]
    row_t = (t0 + tok).to(tl.int64)
    optrs = out_ptr + row_t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & (d < HD)[None, :])
