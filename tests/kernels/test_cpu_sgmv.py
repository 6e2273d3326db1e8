"""The C++ CPU SGMV kernel (kernels/cpu_sgmv.cpp) against float64, on the torch tests' scenarios.

Pools are NaN-poisoned outside the adapters' rows and pages are scattered, so a read through a
wrong page or past a matrix shows up as NaN. Where the kernel cannot be built the tests skip with
the build error, except under CI, where the build is part of what is tested.
"""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from kernel_testkit import rel_err
from loraplex.kernels import cpu_build, cpu_sgmv
from loraplex.kernels.cpu_build import load_extension
from native_kernels import require_built
from sgmv_testkit import SgmvSpec, build_sgmv_case, sgmv_specs, touched_tokens

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")


def _check(spec, dtype=torch.float32, tol=1e-5, column_slice=False, ext=None):
    case = build_sgmv_case(spec, dtype, device=torch.device("cpu"))
    rows, lora, layer, module = case.pool.rows(), case.lora, spec.layer, spec.module
    ref = case.y0.double() + case.delta_ref
    touched = touched_tokens(case, layer, module)
    if column_slice:  # y as the model passes it: columns of a wider fused projection output
        wide = torch.randn(case.y0.shape[0], case.y0.shape[1] + 2 * spec.d, dtype=dtype)
        y = wide[:, spec.d : spec.d + case.y0.shape[1]]
        y.copy_(case.y0)
        left, right = wide[:, : spec.d].clone(), wide[:, spec.d + case.y0.shape[1] :].clone()
    else:
        y = case.y0.clone()
    cpu_sgmv.apply_lora_with(ext, y, case.x, rows, lora, layer, module)
    assert rel_err(y, ref) < tol
    assert torch.equal(y[~touched], case.y0[~touched])
    if column_slice:
        assert torch.equal(wide[:, : spec.d], left) and torch.equal(wide[:, spec.d + case.y0.shape[1] :], right)


@FAST
@given(spec=sgmv_specs())
def test_cpu_sgmv_matches_float64(spec):
    _check(spec)


@FAST
@given(spec=sgmv_specs(max_requests=4, max_len=70))
def test_cpu_sgmv_long_segments_into_column_slices(spec):
    # Segments of many token blocks (the kernel works in blocks of 8 tokens) written into a column
    # slice of a wider output, as the fused q/k/v and gate/up projections are.
    _check(spec, column_slice=True)


@FAST
@given(spec=sgmv_specs(d_choices=(16, 32, 48, 64), max_requests=4, max_len=70, rank_step=8))
def test_cpu_sgmv_blocked_long_segments(spec):
    # Ranks that are multiples of 8 and rows as wide as a vector or more: segments longer than
    # LONG_SEGMENT take the register-blocked path (token blocks of every size up to 12, the rank in
    # chunks of 2, 1 vectors and 8 floats, column chunks of 2 vectors and of 1 where D ends).
    _check(spec, column_slice=True)


@FAST
@given(spec=sgmv_specs(d_choices=(16, 32, 48, 64), max_requests=24, max_len=6, rank_choices=(8, 16, 32, 64, 12)))
def test_cpu_sgmv_decode_items(spec):
    # Segments of a few tokens (a decode batch grouped by adapter) at the ranks the decode kernels take,
    # beside one they do not (12): items of up to 4 tokens, A^T rows that cross pages (pages of 2 rows of
    # D = 16 hold 32 floats, a rank-64 row spans three), every column-vector count of the expand.
    _check(spec, column_slice=True)


def test_decode_kernels_take_the_items_they_can():
    ext = load_extension("cpu_sgmv")
    assert all(ext.few_ok(nt, r, 64) for nt in (1, 2) for r in (8, 16, 32)) and ext.few_ok(1, 64, 64)
    assert not ext.few_ok(5, 16, 64) and not ext.few_ok(0, 16, 64) and not ext.few_ok(2, 12, 64)
    assert not ext.few_ok(1, 16, 12)  # D not a multiple of the vector width


def test_blocked_path_takes_the_long_segments_it_can():
    # Which long segments the kernel keeps (the rest go to BLAS): the rule the Python side mirrors.
    assert cpu_sgmv.long_ok(16, 64) and cpu_sgmv.long_ok(8, 64) and cpu_sgmv.long_ok(256, 48)
    assert not cpu_sgmv.long_ok(12, 64) and not cpu_sgmv.long_ok(264, 64) and not cpu_sgmv.long_ok(16, 12)


@pytest.fixture(scope="module")
def ext_avx2():
    """The kernel built for AVX2 (8-float vectors: its own decode expand, blocked tile sizes and vector rules), so
    that AVX-512 machines check that build too."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("-mno-avx512f is an x86 flag")
    src = Path(cpu_sgmv.__file__).with_name("cpu_sgmv.cpp")
    return cpu_build.compile_source(src, "test_avx2_cpu_sgmv", extra_cflags=["-mno-avx512f"])


@FAST
@given(spec=sgmv_specs(d_choices=(8, 16, 24, 64), max_requests=24, max_len=6, rank_choices=(8, 16, 32, 64, 12)))
def test_avx2_build_decode_items(ext_avx2, spec):
    # D = 8 and 24: multiples of the AVX2 vector only, which the AVX-512 build leaves to its generic loops.
    _check(spec, column_slice=True, ext=ext_avx2)


@FAST
@given(spec=sgmv_specs(d_choices=(8, 16, 24, 64), max_requests=4, max_len=70, rank_step=8))
def test_avx2_build_blocked_long_segments(ext_avx2, spec):
    _check(spec, column_slice=True, ext=ext_avx2)


@FAST
@given(spec=sgmv_specs())
def test_avx2_build_matches_float64(ext_avx2, spec):
    _check(spec, ext=ext_avx2)


@pytest.fixture(scope="module")
def ext_other_expand():
    """The AVX-512 kernel built with the decode expand this CPU's build does not pick (expand_by_rows: B^T's rows
    on AMD CPUs, column chunks on the others), and with the next item's asks where this build has none or none
    where it has them (next_item_asks: on AMD CPUs), so that each machine checks both of each."""
    cpuinfo = Path("/proc/cpuinfo")
    if " avx512f" not in (cpuinfo.read_text() if cpuinfo.exists() else ""):
        pytest.skip("the two decode expands are the AVX-512 build's; the AVX2 build has one")
    ext = load_extension("cpu_sgmv")
    force = "COLUMNS" if ext.expand_by_rows() else "ROWS"
    asks = "NO_NEXT_ITEM" if ext.next_item_asks() else "NEXT_ITEM"
    src = Path(cpu_sgmv.__file__).with_name("cpu_sgmv.cpp")
    other = cpu_build.compile_source(src, f"test_expand_{force.lower()}_{asks.lower()}_cpu_sgmv",
                                     extra_cflags=[f"-DLORAPLEX_SGMV_EXPAND_{force}", f"-DLORAPLEX_SGMV_{asks}"])
    assert other.expand_by_rows() != ext.expand_by_rows() and other.next_item_asks() != ext.next_item_asks()
    return other


@FAST
@given(spec=sgmv_specs(d_choices=(16, 32, 64), max_requests=24, max_len=6, rank_choices=(8, 16, 32, 64)))
def test_other_expand_build_decode_items(ext_other_expand, spec):
    _check(spec, column_slice=True, ext=ext_other_expand)


@pytest.fixture(scope="module")
def ext_other_l1_form():
    """The kernel built with the decode kernels' form this CPU's build does not take (l1_decode: the L1 form on AMD
    Zen 5 and Intel CPUs, the form before it on the AMD CPUs before Zen 5), so that each machine checks both."""
    ext = load_extension("cpu_sgmv")
    force = "NO_L1_FORM" if ext.l1_decode() else "L1_FORM"
    src = Path(cpu_sgmv.__file__).with_name("cpu_sgmv.cpp")
    other = cpu_build.compile_source(src, f"test_{force.lower()}_cpu_sgmv", extra_cflags=[f"-DLORAPLEX_SGMV_{force}"])
    assert other.l1_decode() != ext.l1_decode()
    return other


@FAST
@given(spec=sgmv_specs(d_choices=(16, 32, 64), max_requests=24, max_len=6, rank_choices=(8, 16, 32, 64)))
def test_other_l1_form_decode_items(ext_other_l1_form, spec):
    _check(spec, column_slice=True, ext=ext_other_l1_form)


@pytest.mark.parametrize(("d", "rows_per_page"), [(32, 2), (32, 6), (32, 10), (64, 6)])
@pytest.mark.parametrize("form", ["this", "other"])
def test_rank_8_items_across_pages(request, form, d, rows_per_page):
    # The L1 form's rank-8 shrink takes A^T 16 rows at a time and a page's last rows one at a time: pages of 8,
    # 24, 40 and 48 rows of rank 8 cut A^T's 9 * D rows into runs that end mid-block, for items of 1-4 tokens.
    ext = None if form == "this" else request.getfixturevalue("ext_other_l1_form")
    for seed in range(3):
        spec = SgmvSpec(d=d, rows_per_page=rows_per_page, in_features=9 * d, out_features=3 * d, layer=seed % 2,
                        module=0, ranks=(8, 8, 8, 8), present=(True,) * 4, req_lens=(1, 2, 3, 4),
                        popularity="distinct", no_adapter_share=0.0, sort=True, empty_segments=0, seed=seed)
        _check(spec, ext=ext)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=sgmv_specs())
def test_float16_goes_to_the_torch_path_and_still_matches(spec):
    _check(spec, dtype=torch.float16, tol=1e-2)
