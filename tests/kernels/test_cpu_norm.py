"""The C++ RMSNorm kernels (kernels/cpu_norm.cpp) against float64, and the residual add fused before one.

Where the kernel cannot be built the tests skip with the build error, except under CI, where the build
is part of what is tested.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testkit import rel_err
from loraplex.kernels import cpu_norm
from native_kernels import require_built

FAST = settings(max_examples=40, deadline=None)


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_norm", cpu_norm.available(), "norm kernel")


def _ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:  # float64 [T, H]
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _rows(t: int, h: int, pad: int) -> torch.Tensor:
    """[t, h] float32 whose rows are strided by h + pad (a column slice of a wider tensor), varied scales."""
    wide = torch.randn(t, h + pad) * torch.rand(t, 1) * 10
    return wide[:, :h]


@FAST
@given(t=st.integers(0, 40), h=st.integers(1, 700), pad=st.integers(0, 3), eps=st.sampled_from([1e-6, 1e-5, 0.5]))
def test_rms_norm_matches_float64(t, h, pad, eps):
    x, w = _rows(t, h, pad), torch.randn(h)
    before = x.clone()
    y = cpu_norm.rms_norm(x, w, eps)
    assert y.shape == (t, h) and y.is_contiguous() and y.dtype == torch.float32
    if t:
        assert rel_err(y, _ref(x, w, eps)) < 1e-5
    assert torch.equal(x, before)  # the input is read only


@FAST
@given(t=st.integers(1, 40), h=st.integers(1, 700), pad=st.integers(0, 3))
def test_add_rms_norm_updates_the_residual_in_place(t, h, pad):
    h0, d, w = _rows(t, h, pad), _rows(t, h, pad), torch.randn(h)
    start, wide = h0.clone(), h0.as_strided((t, h + pad), h0.stride())  # the whole rows, pad included
    pad_before = wide[:, h:].clone()
    y = cpu_norm.add_rms_norm(h0, d, w, 1e-6)
    assert torch.allclose(h0, start + d, rtol=0, atol=0)  # float32 add, exactly as torch's
    assert torch.equal(wide[:, h:], pad_before)  # nothing written past the rows' H columns
    assert rel_err(y, _ref(start.double() + d.double(), w, 1e-6)) < 1e-5


def test_zero_rows_give_zero_not_nan():
    # rsqrt(0 + eps) is finite: a row of zeros normalises to zeros, as torch's formula does.
    y = cpu_norm.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6)
    assert torch.equal(y, torch.zeros(2, 8))


@pytest.mark.parametrize("bad", ["weight_len", "dtype", "shape"])
def test_bad_input_is_refused(bad):
    x, w, d = torch.randn(3, 8), torch.randn(8), torch.randn(3, 8)
    if bad == "weight_len":
        w = torch.randn(7)
    elif bad == "dtype":
        x = x.double()
    else:
        d = torch.randn(2, 8)
    before = x.clone()
    with pytest.raises(RuntimeError, match="weight|float32|shape"):
        if bad == "shape":
            cpu_norm.add_rms_norm(x, d, w, 1e-6)
        else:
            cpu_norm.rms_norm(x, w, 1e-6)
    assert torch.equal(x, before)
