"""The decoder layer's elementwise steps as Triton kernels: RMSNorm (with the residual add before it), RoPE
in place on the fused qkv output, SwiGLU.

Why kernels for a few elementwise ops: on a GPU a decode step of a small batch is host-bound, and in torch
these steps are most of its launches (an RMSNorm in bf16 is eight, its residual add one more, RoPE five,
SwiGLU two: about 600 of the ~900 launches of a 28-layer model's step, benchmarks/step_launches.py). Each is
one launch here.

Numerics follow the torch formulas they replace (models/llama.py, models/rope.py, which follow transformers):
every intermediate that torch rounds to the model's dtype is rounded here too (an RMSNorm's normalised value
before the weight, each RoPE product and their sum, silu before the product), so in bf16 the results differ
from torch's only where a reduction's order or exp's last bit flips a rounding.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_launch import dual_kernel


@dual_kernel
def rms_norm_kernel(
    h_ptr,  # [T, H] unit column stride; with HAS_D the residual stream, updated in place: h += d
    stride_h,
    d_ptr,  # [T, H] unit column stride, what the layer adds (unread without HAS_D)
    stride_d,
    w_ptr,  # [H]
    out_ptr,  # [T, H] contiguous: rms_norm(h) * w
    T,
    H,
    eps,
    HAS_D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows < T)[:, None] & (cols < H)[None, :]
    rows64 = rows.to(tl.int64)
    hp = h_ptr + rows64[:, None] * stride_h + cols[None, :]
    x = tl.load(hp, mask=mask, other=0.0)
    if HAS_D:
        d = tl.load(d_ptr + rows64[:, None] * stride_d + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)  # h + d rounded, as torch adds them
        tl.store(hp, x, mask=mask)
    xf = x.to(tl.float32)
    ms = tl.sum(xf * xf, axis=1) / H  # [ROWS]
    normed = (xf * (1.0 / tl.sqrt(ms + eps))[:, None]).to(x.dtype)  # transformers: normalise in fp32, round
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
    out = (normed.to(tl.float32) * w.to(tl.float32)[None, :]).to(x.dtype)  # then weight * normed
    tl.store(out_ptr + rows64[:, None] * H + cols[None, :], out, mask=mask)


@dual_kernel
def rope_kernel(
    x_ptr,  # [T, W] unit column stride: heads 0 .. NH - 1 (q then k), HD columns each from column 0, in place
    stride_xt,
    cos_ptr,  # [T, HD] contiguous, in x's dtype
    sin_ptr,  # [T, HD]
    NH,
    HD: tl.constexpr,
    BLOCK_NH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HD // 2
    hh = tl.arange(0, BLOCK_NH)
    i = tl.arange(0, BLOCK_HALF)
    mask = (hh < NH)[:, None] & (i < half)[None, :]
    p1 = x_ptr + t * stride_xt + hh[:, None] * HD + i[None, :]  # [BLOCK_NH, BLOCK_HALF] first halves
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + half, mask=mask, other=0.0)
    imask = i < half
    c1 = tl.load(cos_ptr + t * HD + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * HD + half + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * HD + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * HD + half + i, mask=imask, other=0.0).to(tl.float32)[None, :]
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1): each product and the sum rounded to dt.
    o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(p1, o1, mask=mask)
    tl.store(p1 + half, o2, mask=mask)


@dual_kernel
def swiglu_kernel(
    gu_ptr,  # [T, 2I] unit column stride: gate | up
    stride_g,
    out_ptr,  # [T, I] contiguous: silu(gate) * up
    T,
    I,
    ROWS: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < T)[:, None] & (cols < I)[None, :]
    gp = gu_ptr + rows[:, None] * stride_g + cols[None, :]
    g = tl.load(gp, mask=mask, other=0.0)
    u = tl.load(gp + I, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu in fp32, rounded, as torch's
    tl.store(out_ptr + rows[:, None] * I + cols[None, :], (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype),
             mask=mask)


__all__ = ["rms_norm_kernel", "rope_kernel", "swiglu_kernel", "triton"]
