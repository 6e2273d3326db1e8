"""The Triton RMSNorm / residual add / RoPE / SwiGLU kernels (interpreted on the CPU, compiled on a GPU) against a
float64 reference and against the torch formulas they replace (models.llama.TORCH_POINTWISE), on fresh random
inputs: widths that are not powers of two, strided rows, batches of 0, 1 and many tokens.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_testkit import DEVICE, rel_err
from loraplex.kernels import triton_pointwise as tp
from loraplex.models.llama import TORCH_POINTWISE

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.float16]
SLOW = settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def fresh(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(*shape, dtype=torch.float64)


def rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # float64
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def strided(t: torch.Tensor, dtype: torch.dtype, pad: int) -> torch.Tensor:
    """t in dtype on the test device, as a column slice of a wider tensor when pad > 0 (rows strided)."""
    if pad == 0:
        return t.to(dtype).to(DEVICE).contiguous()
    wide = torch.full((t.shape[0], t.shape[1] + pad), float("nan"), dtype=dtype, device=DEVICE)
    wide[:, : t.shape[1]] = t.to(dtype)
    return wide[:, : t.shape[1]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SLOW
@given(tokens=st.sampled_from([0, 1, 5, 37]), hidden=st.sampled_from([8, 96, 200, 576]), pad=st.sampled_from([0, 3]))
def test_rms_norm_and_residual_add(dtype, tokens, hidden, pad):
    eps = 1e-6
    h64, d64, w64 = fresh(tokens, hidden, scale=3.0), fresh(tokens, hidden), 1 + 0.1 * fresh(hidden)
    w = w64.to(dtype).to(DEVICE)
    h, d = strided(h64, dtype, pad), strided(d64, dtype, pad)
    tol = TOL[dtype]
    # The norm alone: h untouched.
    before = h.clone()
    y = tp.rms_norm(h, w, eps)
    assert y.shape == (tokens, hidden) and y.dtype == dtype
    if tokens:
        assert rel_err(y.cpu(), rms_ref(h.cpu().double(), w.cpu().double(), eps)) < tol
        assert rel_err(y.cpu(), TORCH_POINTWISE.rms_norm(h, w, eps).cpu()) < tol
    assert torch.equal(h, before)
    # With the residual add: h updated in place (rounded to its dtype, as torch's h + d), the norm of the sum.
    ref_h, ref_x = TORCH_POINTWISE.add_rms_norm(h.clone(), d, w, eps)
    h2, x = tp.add_rms_norm(h, d, w, eps)
    assert h2 is h
    assert torch.equal(h, ref_h)  # one rounding of an exact fp32 sum: bit for bit torch's
    if tokens:
        assert rel_err(x.cpu(), rms_ref(h.cpu().double(), w.cpu().double(), eps)) < tol
        assert rel_err(x.cpu(), ref_x.cpu()) < tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SLOW
@given(tokens=st.sampled_from([0, 1, 6, 33]), heads=st.sampled_from([(4, 2, 16), (6, 2, 8), (3, 1, 64), (14, 2, 128)]),
       pad=st.sampled_from([0, 5]))
def test_rope_in_place_on_the_q_and_k_heads(dtype, tokens, heads, pad):
    nh, nkv, hd = heads
    width = (nh + 2 * nkv) * hd  # q | k | v
    qkv64 = fresh(tokens, width)
    ang = torch.rand(tokens, hd // 2, dtype=torch.float64) * 100
    cos64, sin64 = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    cos, sin = cos64.to(dtype).to(DEVICE), sin64.to(dtype).to(DEVICE)
    qkv = strided(qkv64, dtype, pad)
    before = qkv.clone()
    ref_q, ref_k = TORCH_POINTWISE.rope(qkv.clone(), heads, cos, sin)
    q, k = tp.rope(qkv, heads, cos, sin)
    assert q.shape == (tokens, nh, hd) and k.shape == (tokens, nkv, hd)
    assert q.data_ptr() == qkv.data_ptr() or tokens == 0  # views of qkv, rotated in place
    ke = (nh + nkv) * hd
    assert torch.equal(qkv[:, ke:], before[:, ke:])  # v untouched
    if tokens:
        # float64 reference from the rounded inputs: x * cos + rotate_half(x) * sin
        x = before[:, :ke].cpu().double().view(tokens, nh + nkv, hd)
        c, s = cos.cpu().double()[:, None], sin.cpu().double()[:, None]
        rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        ref = (x * c + rot * s).view(tokens, ke)
        assert rel_err(qkv[:, :ke].cpu(), ref) < TOL[dtype]
        assert rel_err(torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1)], 1).cpu(),
                       torch.cat([ref_q.reshape(tokens, -1), ref_k.reshape(tokens, -1)], 1).cpu()) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SLOW
@given(tokens=st.sampled_from([0, 1, 7, 40]), inter=st.sampled_from([8, 100, 1536, 1800]), pad=st.sampled_from([0, 2]))
def test_swiglu(dtype, tokens, inter, pad):
    gu64 = fresh(tokens, 2 * inter, scale=2.0)
    gu = strided(gu64, dtype, pad)
    out = tp.swiglu(gu, inter)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    if tokens:
        g, u = gu.cpu().double()[:, :inter], gu.cpu().double()[:, inter:]
        assert rel_err(out.cpu(), torch.nn.functional.silu(g) * u) < TOL[dtype]
        assert rel_err(out.cpu(), TORCH_POINTWISE.swiglu(gu, inter).cpu()) < TOL[dtype]
