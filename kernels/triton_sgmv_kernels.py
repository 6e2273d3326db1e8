"""SGMV shrink and expand as Triton kernels that read adapter rows in place from the page pool.

Addressing (docs/PAGE_POOL.md): A of one (layer, module) is stored transposed, A^T [K, rank]
row-major from logical row a_row, so A[r, k] is element k*rank + r counted from row a_row (logical
row a_row + (k*rank + r) // D, column (k*rank + r) % D); B^T is [rank, N] row-major from b_row, so
B^T[r, n] is at logical row b_row + r*(N/D) + n//D, column n%D. Logical row L is physical row
pages[L // rows_per_page] * rows_per_page + L % rows_per_page of the pool viewed as [rows, D].
(A is transposed for the torch CPU path, which reads rows of A^T in place with embedding_bag.)

Every N chunk an expand program loads is BLOCK_N elements with BLOCK_N a power of two dividing D,
so one chunk of one rank row never leaves its pool row: the page lookup happens once per rank row
per chunk (an [R_CHUNK] vector) and the elements load as contiguous runs. A shrink chunk
[R_CHUNK, BLOCK_K] of A^T covers BLOCK_K runs of up to R_CHUNK consecutive elements (one per k). When
no run can cross a pool row (the rank divides D, or rank and D are multiples of R_CHUNK: ranks 1-128 that
are powers of two with D = 128) the page is looked up once per k, a [BLOCK_K] vector; otherwise (a rank
of 12, say) for every element. For rank 8 and the multiples of 16 the per-k loads are also said to start at
multiples of 8 elements, masked by whole runs of 8, so they compile to 16-byte loads; the other ranks' are
one element each (benchmarks/triton_sass.py counts them). All three branches are _a_tile's.

Ranks are mixed in one launch: rank is read per segment from the layout table and rows past it
are masked, so a rank-8 adapter next to a rank-64 one issues rank-8 loads (shrink programs whose
rank chunk lies past their segment's rank write zeros without a K loop; the expand loop runs
cdiv(rank, R_CHUNK) times). Nothing is padded in memory.

Tiles: the host cuts the batch into tiles (segment, first token, length <= BLOCK_M), including
tiles of tokens outside every segment (segment -1), which shrink fills with zeros and expand skips.
BLOCK_M == 1 is the decode (BGMV-style) variant: one token, products summed in registers;
BLOCK_M > 1 multiplies with tl.dot (USE_DOT) or, where a chunk is too narrow for tl.dot on a GPU
(BLOCK_K < 16), with a broadcast sum.

Groups: one launch of each kernel serves G <= 3 modules that share the input x and write adjacent
column ranges of one fused output (q | k | v, gate | up), because at decode the launches, not the
bytes, set the time (one layer's 7 modules at batch 1 on an H200: 14 launches of ~6 us each). The
modules are consecutive in TARGET_MODULES, so module g's (layer, module) entry is the first one's plus
g * the layout's (scales') module stride. Shrink folds the module into grid axis 2 (g * rc_per_mod +
rank chunk) and writes module g's partials at columns g * SR; expand maps each BLOCK_N column block
of y to its module with the column bounds (b1, b2: scalar arguments, b1 = b2 = N for one module): a
block never straddles two modules since BLOCK_N divides D and D divides every module's width. A single
module is the G = 1 case, so there is one kernel of each kind.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_launch import dual_kernel


@triton.jit
def _a_tile(pool_ptr, page_row, a_row, rank, k0, r0, r, rmask, k,
            D: tl.constexpr, rows_per_page: tl.constexpr, R_CHUNK: tl.constexpr):
    """A^T[k0 + k, r] of one segment's (layer, module), r = r0 .. r0 + R_CHUNK - 1: [R_CHUNK, BLOCK_K], 0 past
    the rank.

    Element (r, k) is k*rank + r past logical row a_row. The decode shrink's time on an H200 followed
    tokens, not bytes, and its per-element work was the suspect: where each k's run of ranks stays in one
    pool row, the page, row and address are computed once per k and the ranks add an offset."""
    if ((rank % R_CHUNK == 0) & (D % R_CHUNK == 0)) | ((rank == 8) & (D % 8 == 0)):
        # Each k's ranks r0 .. r0 + R_CHUNK - 1 are consecutive elements from a multiple of 8 that stay inside one
        # pool row up to the rank (all R_CHUNK of them, or the 8 of a rank-8 adapter), in runs of 8 that lie all
        # below the rank or all past it. Said so, the compiler loads them 16 bytes at a time (8 bf16) instead of
        # one element each. (A rank of 24 at D = 128 fails it: k = 5's first 16 ranks cross a row.)
        tl.static_assert(R_CHUNK % 8 == 0)
        rk = tl.multiple_of(rank, 8)
        w0 = (k0 + k) * rk + r0  # [BLOCK_K] first element of each k's run
        wrow0 = a_row + w0 // D
        wpage0 = tl.load(page_row + wrow0 // rows_per_page)
        wbase = (wpage0.to(tl.int64) * rows_per_page + wrow0 % rows_per_page) * D + w0 % D  # [BLOCK_K]
        # r < rk written by runs of 8: the compiler sees a mask constant over each run (it does not for r < rk).
        run_in = r // 8 < rk // 8  # [R_CHUNK]
        a = tl.load(pool_ptr + tl.multiple_of(wbase, 8)[None, :] + (r - r0)[:, None], mask=run_in[:, None], other=0.0)
    elif D % rank == 0:
        # Names apart from the other branches': a compiled if needs one type per name in every branch.
        e0 = (k0 + k) * rank + r0  # [BLOCK_K] first element of each k's run
        lrow0 = a_row + e0 // D
        page0 = tl.load(page_row + lrow0 // rows_per_page)
        base = (page0.to(tl.int64) * rows_per_page + lrow0 % rows_per_page) * D + e0 % D  # [BLOCK_K]
        a = tl.load(pool_ptr + base[None, :] + (r - r0)[:, None], mask=rmask[:, None], other=0.0)
    else:
        e = (k0 + k)[None, :] * rank + r[:, None]  # [R_CHUNK, BLOCK_K]
        lrow = a_row + e // D
        page = tl.load(page_row + lrow // rows_per_page, mask=rmask[:, None], other=0)
        prow = page.to(tl.int64) * rows_per_page + lrow % rows_per_page
        a = tl.load(pool_ptr + prow * D + e % D, mask=rmask[:, None], other=0.0)
    return a


@dual_kernel
def sgmv_shrink_kernel(
    x_ptr,  # [T, K] activations, unit column stride
    stride_xt,
    pool_ptr,  # [R, D] pool rows, contiguous
    out_ptr,  # [SPLIT, T, G * SR] float32 partial sums (scale applied), module g at columns g * SR; all written
    stride_os,
    stride_ot,
    tile_seg_ptr,  # [NT] int32, segment of each tile (-1: no adapter)
    tile_start_ptr,  # [NT] int32, first token
    tile_len_ptr,  # [NT] int32, tokens in the tile (<= BLOCK_M)
    layout_ptr,  # [S, L, 7, 3] int32: rank, a_row, b_row
    stride_lay,
    scales_ptr,  # [S, L, 7] float32
    stride_sc,
    pages_ptr,  # [S, P] int32, each segment's adapter page table
    stride_pg,
    lay_off,  # offset of (layer, first module) in a segment's layout
    sc_off,  # offset of (layer, first module) in a segment's scales
    lay_mstride,  # layout offset from one module to the next
    sc_mstride,  # scales offset from one module to the next
    rc_per_mod,  # SR // R_CHUNK: rank chunks (grid axis 2 programs) per module
    # A compile-time constant (one per pool geometry): the decode shrink finds the page of every element it
    # loads, and a division by a run-time integer costs a GPU about twenty instructions where a constant's is
    # a shift or a multiply.
    rows_per_page: tl.constexpr,
    K,
    chunks_per_split,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    R_CHUNK: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.program_id(2) // rc_per_mod  # module of the group
    rc = tl.program_id(2) % rc_per_mod
    seg = tl.load(tile_seg_ptr + tile)
    t0 = tl.load(tile_start_ptr + tile).to(tl.int64)
    tlen = tl.load(tile_len_ptr + tile)
    segc = tl.maximum(seg, 0)
    lay = layout_ptr + segc * stride_lay + lay_off + g * lay_mstride
    rank = tl.load(lay)  # 0 where the segment's adapter has no slot for this module: zeros written
    rank = tl.where(seg >= 0, rank, 0)
    a_row = tl.load(lay + 1)
    scale = tl.load(scales_ptr + segc * stride_sc + sc_off + g * sc_mstride)
    out_mod = out_ptr + g * (rc_per_mod * R_CHUNK)  # this module's SR columns of the partials

    r = rc * R_CHUNK + tl.arange(0, R_CHUNK)
    rmask = r < rank
    k = tl.arange(0, BLOCK_K)
    n_chunks = K // BLOCK_K
    c_lo = split * chunks_per_split
    c_hi = tl.minimum(c_lo + chunks_per_split, n_chunks)
    # Programs past the segment's rank (or without an adapter) skip the loop and write zeros.
    c_hi = tl.where(rc * R_CHUNK < rank, c_hi, c_lo)
    page_row = pages_ptr + segc * stride_pg

    if BLOCK_M == 1:
        acc = tl.zeros([R_CHUNK], dtype=tl.float32)
        for c in range(c_lo, c_hi):
            k0 = c * BLOCK_K
            a = _a_tile(pool_ptr, page_row, a_row, rank, k0, rc * R_CHUNK, r, rmask, k, D, rows_per_page, R_CHUNK)
            xv = tl.load(x_ptr + t0 * stride_xt + k0 + k)  # [BLOCK_K]
            acc += tl.sum(a.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
        tl.store(out_mod + split * stride_os + t0 * stride_ot + r, acc * scale)
    else:
        m = tl.arange(0, BLOCK_M)
        mmask = m < tlen
        tok = t0 + m
        acc2 = tl.zeros([BLOCK_M, R_CHUNK], dtype=tl.float32)
        for c in range(c_lo, c_hi):
            k0 = c * BLOCK_K
            a = _a_tile(pool_ptr, page_row, a_row, rank, k0, rc * R_CHUNK, r, rmask, k, D, rows_per_page, R_CHUNK)
            xt = tl.load(x_ptr + tok[:, None] * stride_xt + k0 + k[None, :], mask=mmask[:, None], other=0.0)
            if USE_DOT:
                acc2 = tl.dot(xt, tl.trans(a.to(xt.dtype)), acc2, input_precision=DOT_PREC)
            else:
                acc2 += tl.sum(xt.to(tl.float32)[:, None, :] * a.to(tl.float32)[None, :, :], axis=2)
        ptrs = out_mod + split * stride_os + tok[:, None] * stride_ot + r[None, :]
        tl.store(ptrs, acc2 * scale, mask=mmask[:, None])


@dual_kernel
def sgmv_expand_kernel(
    s_ptr,  # [SPLIT, T, G * SR] shrink output (partials summed here), module g from column g * stride_sg
    stride_ss,
    stride_st,
    stride_sg,
    num_splits,
    y_ptr,  # [T, N] updated in place (may be a column slice: unit column stride only); module g owns [lo_g, hi_g)
    stride_yt,
    pool_ptr,  # [R, D] pool rows, contiguous
    tile_seg_ptr,
    tile_start_ptr,
    tile_len_ptr,
    layout_ptr,
    stride_lay,
    pages_ptr,
    stride_pg,
    lay_off,  # offset of (layer, first module) in a segment's layout
    lay_mstride,  # layout offset from one module to the next
    rows_per_page: tl.constexpr,  # as in the shrink
    b1,  # first column of module 1 (N with one module)
    b2,  # first column of module 2 (N with fewer than three)
    N,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    R_CHUNK: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    seg = tl.load(tile_seg_ptr + tile)
    t0 = tl.load(tile_start_ptr + tile).to(tl.int64)
    tlen = tl.load(tile_len_ptr + tile)
    segc = tl.maximum(seg, 0)

    n0 = nb * BLOCK_N  # first column of y of this block; the whole block lies in module g
    g = (n0 >= b1).to(tl.int32) + (n0 >= b2).to(tl.int32)
    lo = tl.where(g == 0, 0, tl.where(g == 1, b1, b2))
    hi = tl.where(g == 0, b1, tl.where(g == 1, b2, N))
    lay = layout_ptr + segc * stride_lay + lay_off + g * lay_mstride
    rank = tl.load(lay)  # 0 where the segment's adapter has no slot for this module: y left alone
    rank = tl.where(seg >= 0, rank, 0)
    b_row = tl.load(lay + 2)
    s_mod = s_ptr + g * stride_sg  # this module's partial columns
    nm = n0 - lo  # first column of the block inside its module (a multiple of BLOCK_N, as lo is of D)

    n = tl.arange(0, BLOCK_N)
    nr = (hi - lo) // D  # pool rows per row of B^T
    page_row = pages_ptr + segc * stride_pg
    n_rc = tl.cdiv(rank, R_CHUNK)  # 0 without an adapter: y is then neither read nor written
    n_lim = tl.where(rank > 0, BLOCK_N, 0)  # columns of y this program touches

    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for rc in range(n_rc):
            r = rc * R_CHUNK + tl.arange(0, R_CHUNK)
            rmask = r < rank
            sv = tl.zeros([R_CHUNK], dtype=tl.float32)
            for sp in range(num_splits):
                sv += tl.load(s_mod + sp * stride_ss + t0 * stride_st + r, mask=rmask, other=0.0).to(tl.float32)
            lrow = b_row + r * nr + nm // D
            page = tl.load(page_row + lrow // rows_per_page, mask=rmask, other=0)
            prow = page.to(tl.int64) * rows_per_page + lrow % rows_per_page
            # Each rank row's chunk starts at a multiple of BLOCK_N. Said so, its elements load 16 bytes at a
            # time with Triton 3.6 (the H200 image's) as well, which does not find it by itself.
            brow = tl.multiple_of(prow * D + nm % D, BLOCK_N)  # [R_CHUNK]
            b = tl.load(pool_ptr + brow[:, None] + n[None, :], mask=rmask[:, None], other=0.0)
            acc += tl.sum(sv[:, None] * b.to(tl.float32), axis=0)
        ymask = n < n_lim
        yp = y_ptr + t0 * stride_yt + n0 + n
        yv = tl.load(yp, mask=ymask, other=0.0)
        tl.store(yp, (yv.to(tl.float32) + acc).to(yv.dtype), mask=ymask)
    else:
        m = tl.arange(0, BLOCK_M)
        mmask = m < tlen
        tok = t0 + m
        acc2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for rc in range(n_rc):
            r = rc * R_CHUNK + tl.arange(0, R_CHUNK)
            rmask = r < rank
            smask = mmask[:, None] & rmask[None, :]
            st = tl.zeros([BLOCK_M, R_CHUNK], dtype=tl.float32)
            for sp in range(num_splits):
                sptr = s_mod + sp * stride_ss + tok[:, None] * stride_st + r[None, :]
                st += tl.load(sptr, mask=smask, other=0.0).to(tl.float32)
            lrow = b_row + r * nr + nm // D
            page = tl.load(page_row + lrow // rows_per_page, mask=rmask, other=0)
            prow = page.to(tl.int64) * rows_per_page + lrow % rows_per_page
            # Each rank row's chunk starts at a multiple of BLOCK_N. Said so, its elements load 16 bytes at a
            # time with Triton 3.6 (the H200 image's) as well, which does not find it by itself.
            brow = tl.multiple_of(prow * D + nm % D, BLOCK_N)  # [R_CHUNK]
            b = tl.load(pool_ptr + brow[:, None] + n[None, :], mask=rmask[:, None], other=0.0)
            if USE_DOT:
                # s rounded to the weights' dtype, as the torch path multiplies it.
                acc2 = tl.dot(st.to(b.dtype), b, acc2, input_precision=DOT_PREC)
            else:
                acc2 += tl.sum(st[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        ymask = mmask[:, None] & (n[None, :] < n_lim)
        yp = y_ptr + tok[:, None] * stride_yt + n0 + n[None, :]
        yv = tl.load(yp, mask=ymask, other=0.0)
        tl.store(yp, (yv.to(tl.float32) + acc2).to(yv.dtype), mask=ymask)
