"""The C++ CPU linear kernel (kernels/cpu_linear.cpp, y = x @ W^T + b with W packed in panels) against float64.

Every call draws fresh random inputs (the parametrized sweeps from torch's unseeded generator, with
the seed in the failure message; the hypothesis cases from a seed hypothesis draws and can replay).
The error of each output element is measured against the float32 summation bound for that element,
sum_k |x_mk w_nk| + |b_n|, not against |y|: a sum of random-sign terms can cancel to nearly zero,
and a relative error against it would then be noise, not a kernel fault. Dropping or doubling one
product, or reading a wrong row, column or panel, gives an error near 1/K of the bound or more,
far above the tolerance.

Shapes are chosen around the kernel's blocking: MR rows per register block (12 on AVX-512, 6 on
AVX2, balanced blocks of at most MR), NR output columns per panel (32 or 16; the last panel
zero-padded), and chunks of x rows of about 512 KB (84 rows at K = 1536). Where the kernel cannot
be built the tests skip with the build error, except under CI, where the build is part of what is
tested.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from loraplex.kernels import cpu_build, cpu_linear
from loraplex.kernels.cpu_build import load_extension
from native_kernels import require_built

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TOL = 1e-5  # of the per-element summation bound; float32 accumulation is ~1e-7 of it at these K

ODD_K = [1, 5, 33, 577, 1536]  # 576 and 1536 are SmolLM2's; these are multiples of nothing useful
X_LAYOUTS = ["contiguous", "column_slice", "transposed", "broadcast_row"]


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_linear", cpu_linear.available(), "linear kernel")


@pytest.fixture(scope="module")
def nr() -> int:  # output columns per panel in this build: 2 vectors, 32 on AVX-512, 16 on AVX2
    return load_extension("cpu_linear").panel_width()


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF


def _make_x(m: int, k: int, layout: str, gen: torch.Generator) -> torch.Tensor:  # [M, K] float32
    if layout == "contiguous":
        return torch.randn(m, k, generator=gen)
    if layout == "column_slice":  # rows strided, columns contiguous: how the model passes qkv/attention views
        wide = torch.randn(m, k + 7, generator=gen)
        return wide[:, 3 : 3 + k]
    if layout == "transposed":  # columns strided: the wrapper must make it contiguous
        return torch.randn(k, m, generator=gen).t()
    if layout == "broadcast_row":  # row stride 0: every row the same memory
        return torch.randn(k, generator=gen).expand(m, k)
    raise AssertionError(layout)


def _make_w(n: int, k: int, transposed: bool, gen: torch.Generator) -> torch.Tensor:  # [N, K] float32
    return torch.randn(k, n, generator=gen).t() if transposed else torch.randn(n, k, generator=gen)


def _check_linear(m: int, k: int, n: int, bias: bool, x_layout: str, seed: int, w_transposed: bool = False,
                  ext=None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    what = f"M={m} K={k} N={n} bias={bias} x={x_layout} w_transposed={w_transposed} seed={seed}"
    x = _make_x(m, k, x_layout, gen)
    w = _make_w(n, k, w_transposed, gen)
    b = torch.randn(n, generator=gen) if bias else None
    w_before, x_before = w.clone(), x.clone()

    packed = cpu_linear.pack(w)
    assert torch.equal(w, w_before), f"pack changed its source weight ({what})"
    y = cpu_linear.linear(x, packed, b, ext=ext)

    assert torch.equal(x, x_before), f"linear changed x ({what})"
    assert y.shape == (m, n), f"y shape {tuple(y.shape)} ({what})"
    assert y.dtype == torch.float32 and y.is_contiguous(), what
    xd, wd = x.double(), w.double()
    ref = xd @ wd.t()
    bound = xd.abs() @ wd.abs().t()
    if b is not None:
        ref = ref + b.double()
        bound = bound + b.double().abs()
    if m == 0 or n == 0:
        return y
    assert torch.isfinite(y).all(), f"non-finite output ({what})"
    err = (y.double() - ref).abs()
    bad = err > TOL * bound
    if bad.any():
        i, j = (int(v) for v in bad.nonzero()[0])
        worst = (err / bound.clamp_min(1e-300)).max().item()
        raise AssertionError(
            f"{int(bad.sum())} of {m * n} outputs off ({what}); first at [{i}, {j}]: got {y[i, j].item()!r}, "
            f"float64 {ref[i, j].item()!r}, bound {bound[i, j].item():.3g}; worst error / bound {worst:.3g}"
        )
    return y


# -- sweeps over the blocking edges -------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 5, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_every_row_count_and_panel_edge(k, bias, nr):
    # M 0..40 covers 1, every block count and balanced split up to 3-7 blocks, and MR - 1, MR, MR + 1
    # on both AVX2 (6) and AVX-512 (12); 63..65 and 70 the decode batch sizes around 64. N: a lone
    # column, partial first panels, exact panels, and one column into a new panel.
    ms = list(range(0, 41)) + [63, 64, 65, 70]
    ns = [1, 3, 47, 65, nr - 1, nr, nr + 1, 2 * nr, 3 * nr + 1]
    for m in ms:
        for n in ns:
            _check_linear(m, k, n, bias, "column_slice" if (m + n) % 2 else "contiguous", _fresh_seed())


@pytest.mark.parametrize("k", [577, 1536])
def test_long_rows_at_the_block_edges(k, nr):
    # The model's K: the same blocking edges, fewer combinations (the float64 reference dominates).
    for m in [1, 5, 6, 7, 11, 12, 13, 23, 24, 25, 64, 65, 70]:
        for n in [3, nr, nr + 1, 65]:
            _check_linear(m, k, n, (m + n) % 2 == 1, "column_slice" if m % 2 else "contiguous", _fresh_seed())


@pytest.mark.parametrize("m", [83, 84, 85, 168, 169, 200])
def test_rows_across_x_chunks(m):
    # At K = 1536 a chunk of x is 84 rows (512 KB): rows past it start a new chunk on every panel.
    _check_linear(m, 1536, 65, True, "column_slice", _fresh_seed())


@pytest.mark.parametrize("k", [1537, 2048, 2100, 4096])
def test_k_past_the_default_models(k, nr):
    # Larger models' K (Qwen2.5-0.5B's MLP is 4864 wide): a chunk of x is then a block or two of rows (24 rows
    # at K = 4096, 60 at 2048), so these row counts cross several chunks on every panel.
    for m in [1, 12, 13, 64, 257]:
        for n in [3, nr, nr + 1]:
            _check_linear(m, k, n, (m + n) % 2 == 1, "column_slice" if m % 2 else "contiguous", _fresh_seed())


@pytest.mark.parametrize("x_layout", X_LAYOUTS)
def test_x_strides(x_layout):
    for m, k, n in [(1, 577, 47), (12, 33, 65), (13, 1536, 96), (64, 5, 3)]:
        _check_linear(m, k, n, True, x_layout, _fresh_seed())


def test_one_or_no_input_features_with_a_column_stride():
    # x [M, 1] (or [M, 0]) whose column stride is not 1, a transposed [1, M]: torch counts it
    # contiguous, so the wrapper's x.contiguous() hands it over as is and the kernel must take it.
    for m in (1, 3, 13, 64):
        _check_linear(m, 1, 47, True, "transposed", _fresh_seed())
    x = torch.randn(0, 3).t()  # [3, 0], strides (1, 3)
    y = cpu_linear.linear(x, cpu_linear.pack(torch.empty(4, 0)), None)
    assert torch.equal(y, torch.zeros(3, 4))


@pytest.fixture(scope="module")
def ext_other_split():
    """The kernel built with the plain GEMM's split between the threads that this CPU's build does not take at 2048
    rows (plain_rows_split: the rows on an AMD Zen 5 from 1536 rows on, the panels elsewhere), so that each machine
    checks both."""
    ext = load_extension("cpu_linear")
    force = "PLAIN_PANELS" if ext.plain_rows_split(2048) else "PLAIN_ROWS"
    src = Path(cpu_linear.__file__).with_name("cpu_linear.cpp")
    other = cpu_build.compile_source(src, f"test_{force.lower()}_cpu_linear",
                                     extra_cflags=[f"-DLORAPLEX_LINEAR_{force}"])
    assert other.plain_rows_split(2048) != ext.plain_rows_split(2048)
    return other


@pytest.mark.parametrize(("m", "k"), [(1536, 576), (2018, 576), (700, 1536), (169, 1536)])
def test_plain_gemm_rows_or_panels_split_to_the_same_sums(ext_other_split, m, k):
    # Rows cut into chunks per thread, or panels per thread: each output is the same sum in the same order.
    seed = _fresh_seed()
    y = _check_linear(m, k, 200, True, "column_slice", seed)
    y_other = _check_linear(m, k, 200, True, "column_slice", seed, ext=ext_other_split)
    assert torch.equal(y, y_other), f"M={m} K={k} seed={seed}"


def test_many_panels_split_across_threads(nr):
    # N of ~50 panels: at::parallel_for splits the panels between threads, each prefetching the next
    # panel of its own range only.
    for m in (1, 7, 64):
        _check_linear(m, 96, 50 * nr - 5, True, "contiguous", _fresh_seed())


def test_zero_input_features_give_the_bias():
    for bias in (False, True):
        _check_linear(5, 0, 47, bias, "contiguous", _fresh_seed())
    y = cpu_linear.linear(torch.empty(3, 0), cpu_linear.pack(torch.empty(4, 0)), None)
    assert torch.equal(y, torch.zeros(3, 4))


# -- random shapes ------------------------------------------------------------------------------------


@st.composite
def linear_cases(draw):
    m = draw(st.one_of(st.integers(0, 70), st.sampled_from([1, 11, 12, 13, 64, 65])))
    k = draw(st.one_of(st.sampled_from(ODD_K + [2, 576]), st.integers(1, 130)))
    n = draw(st.one_of(st.sampled_from([1, 3, 47, 65, 16, 32, 64, 96, 128, 257]), st.integers(1, 200)))
    return dict(m=m, k=k, n=n, bias=draw(st.booleans()), x_layout=draw(st.sampled_from(X_LAYOUTS)),
                w_transposed=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


@FAST
@given(case=linear_cases())
def test_linear_matches_float64(case):
    _check_linear(**case)


# -- packing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 47, 65, 64, 96])
@pytest.mark.parametrize("k", [1, 33, 577])
def test_pack_pads_panels_and_keeps_the_weight(n, k, nr):
    w = torch.randn(n, k)
    before = w.clone()
    packed = cpu_linear.pack(w)
    assert torch.equal(w, before)
    p = -(-n // nr)
    assert packed.out_features == n
    assert packed.panels.shape == (p, k, nr)
    assert packed.panels.dtype == torch.float32 and packed.panels.is_contiguous()
    rows = packed.panels.transpose(1, 2).reshape(p * nr, k)  # back to [P * NR, K]: weight rows, then padding
    assert torch.equal(rows[:n], w)
    assert not rows[n:].any(), "the padding columns of the last panel must be zero"
    assert packed.panels.data_ptr() != w.data_ptr()


# -- refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "w", [torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4).half(), torch.randn(8), torch.randn(2, 8, 4)],
    ids=["float64", "float16", "1-D", "3-D"],
)
def test_pack_refuses_a_weight_it_cannot_hold(w):
    with pytest.raises(ValueError, match="2-D float32 CPU weight"):
        cpu_linear.pack(w)


def test_linear_refuses_mismatched_inputs():
    packed = cpu_linear.pack(torch.randn(10, 24))  # [out 10, in 24]
    with pytest.raises(RuntimeError, match="x has 23 features, the packed weight 24"):
        cpu_linear.linear(torch.randn(4, 23), packed, None)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32"):
        cpu_linear.linear(torch.randn(4, 24, dtype=torch.float64), packed, None)
    with pytest.raises(RuntimeError, match="x must be a 2-D float32"):
        cpu_linear.linear(torch.randn(2, 4, 24), packed, None)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[10\]"):
        cpu_linear.linear(torch.randn(4, 24), packed, torch.randn(11))
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[10\]"):
        cpu_linear.linear(torch.randn(4, 24), packed, torch.randn(10, dtype=torch.float64))
