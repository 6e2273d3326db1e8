"""The C++ row argmax (kernels/cpu_argmax.cpp) gives torch.argmax's answer: ties, NaN, infinities, strides.

Where the kernel cannot be built the tests skip with the build error, except under CI.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from loraplex.kernels import cpu_argmax
from native_kernels import require_built


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_argmax", cpu_argmax.available(), "argmax kernel")


SPECIALS = [math.nan, math.inf, -math.inf, 0.0, -0.0]


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 9), v=st.integers(1, 200), pad=st.integers(0, 3), levels=st.integers(1, 6),
       specials=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(SPECIALS)), max_size=6),
       seed=st.integers(0, 2**31 - 1))
def test_argmax_rows_matches_torch(n, v, pad, levels, specials, seed):
    g = torch.Generator().manual_seed(seed)
    # Few distinct values: most rows have ties for their maximum, which must resolve to the first.
    wide = torch.randint(0, levels, (n, v + pad), generator=g).float()
    for pos, val in specials:
        if n:
            wide[pos % n, pos % v] = val
    x = wide[:, :v]  # rows strided by v + pad
    got = cpu_argmax.argmax_rows(x)
    assert got.dtype == torch.int64 and got.shape == (n,)
    assert torch.equal(got, x.argmax(dim=-1)), (x, got)


def test_argmax_rows_at_vocabulary_size():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 49152, generator=g)
    x[3, 100] = x[3, 40000] = 1e9  # a tie far apart: the first
    x[7, 5000] = math.nan
    assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))


def test_other_dtypes_and_layouts_take_torch():
    x = torch.randn(4, 10, dtype=torch.float64)
    assert torch.equal(cpu_argmax.argmax_rows(x), x.argmax(dim=-1))
    t = torch.randn(10, 4).t()  # columns not contiguous
    assert torch.equal(cpu_argmax.argmax_rows(t), t.argmax(dim=-1))
