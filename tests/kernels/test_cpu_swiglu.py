"""The C++ SwiGLU kernel (kernels/cpu_swiglu.cpp) against float64, over the whole float range its exp sees.

Where the kernel cannot be built the tests skip with the build error, except under CI, where the build
is part of what is tested.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loraplex.kernels import cpu_swiglu
from native_kernels import require_built


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_swiglu", cpu_swiglu.available(), "SwiGLU kernel")


def _ref(gu: torch.Tensor, inter: int) -> torch.Tensor:  # float64
    g, u = gu[:, :inter].double(), gu[:, inter:].double()
    return g * torch.sigmoid(g) * u


@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 20), inter=st.integers(1, 300), pad=st.integers(0, 3), scale=st.sampled_from([0.1, 3.0, 30.0]),
       seed=st.integers(0, 2**31 - 1))
def test_swiglu_matches_float64(t, inter, pad, scale, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(t, 2 * inter + pad, generator=g) * scale
    gu = wide[:, : 2 * inter]  # rows strided by 2I + pad, as a column slice would be
    before = gu.clone()
    act = cpu_swiglu.swiglu(gu, inter)
    assert act.shape == (t, inter) and act.is_contiguous()
    ref = _ref(gu, inter)
    # Elementwise: a few float32 ulps of each value (plus an absolute floor for values near 0).
    assert torch.all((act.double() - ref).abs() <= 4e-7 * ref.abs() + 1e-30)
    assert torch.equal(gu, before)


def test_swiglu_at_the_ends_of_exp():
    # Gates where exp(-g) under- or overflows float32, and signed zeros: silu must stay finite and exact there.
    gates = torch.tensor([-1e4, -200.0, -100.0, -88.5, -87.0, -20.0, -1e-3, -0.0, 0.0, 1e-3, 20.0, 87.0, 88.5, 100.0,
                          1e4, 3.4e38, -3.4e38])
    n = gates.numel()
    gu = torch.cat([gates, torch.full((n,), 0.5)])[None, :].repeat(3, 1)  # up 0.5: silu(3.4e38) * up stays finite
    act = cpu_swiglu.swiglu(gu, n)
    assert torch.isfinite(act).all()
    ref = _ref(gu, n)
    assert torch.all((act.double() - ref).abs() <= 4e-7 * ref.abs() + 1e-30)


def test_swiglu_refuses_an_odd_split():
    with pytest.raises(RuntimeError, match="2 x 5 columns"):
        cpu_swiglu.swiglu(torch.randn(2, 11), 5)
