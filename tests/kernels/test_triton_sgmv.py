"""The Triton SGMV kernels against a float64 reference (interpreted on the CPU, compiled on a GPU).

Adapters sit on scattered pages of a pool whose other rows hold NaN; the shrink output is
NaN-filled before each run, so an element that is not written, or a row read from the wrong page,
fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_testkit import DEVICE, rel_err
from loraplex.kernels import triton_sgmv
from sgmv_testkit import (
    POPULARITY,
    SgmvSpec,
    build_sgmv_case,
    sgmv_specs,
    touched_tokens,
)

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.float16]
SLOW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check_all_entry_points(spec: SgmvSpec, dtype: torch.dtype, split: int, block_m: int) -> None:
    case = build_sgmv_case(spec, dtype)
    rows, lora, layer, module = case.pool.rows(), case.lora, spec.layer, spec.module
    tol = TOL[dtype]
    T = lora.num_tokens
    touched = touched_tokens(case, layer, module).to(DEVICE)
    sr = -(-max(spec.ranks) // triton_sgmv.R_CHUNK) * triton_sgmv.R_CHUNK

    # Shrink into NaN-filled partials: every element must be written (zeros past the rank).
    partial = torch.full((split, T, sr), math.nan, dtype=torch.float32, device=DEVICE)
    triton_sgmv.sgmv_shrink_into(partial, case.x, rows, lora, layer, module, block_m=block_m)
    s = partial.sum(0)
    assert rel_err(s.cpu(), case.shrink_ref[:, :sr]) < tol  # including exact zeros past each rank
    assert torch.all(s[~touched] == 0)

    # Expand from those partials into a column slice of a wider output (as the model's fused qkv).
    pad = spec.d
    wide = torch.randn(T, spec.out_features + 2 * pad, device=DEVICE).to(dtype)
    y = wide[:, pad : pad + spec.out_features]
    y.copy_(case.y0)
    before = wide.clone()
    triton_sgmv.sgmv_expand_from(y, partial, rows, lora, layer, module, block_m=block_m)
    ref = case.y0.double().cpu() + case.delta_ref
    assert rel_err(y.cpu(), ref) < tol
    assert torch.equal(y[~touched], case.y0[~touched]), "a token without this module's adapter was changed"
    assert torch.equal(wide[:, :pad], before[:, :pad]) and torch.equal(wide[:, pad + spec.out_features :], before[:, pad + spec.out_features :])

    # The entry points the model calls (their own tile sizes and split).
    y2 = case.y0.clone()
    triton_sgmv.apply_lora(y2, case.x, rows, lora, layer, module)
    assert rel_err(y2.cpu(), ref) < tol
    assert torch.equal(y2[~touched], case.y0[~touched])
    s2 = triton_sgmv.lora_shrink(case.x, rows, lora, layer, module)
    assert s2.shape == (T, max(lora.max_rank, 1)) and s2.dtype == dtype
    assert rel_err(s2.cpu(), case.shrink_ref[:, : s2.shape[1]]) < tol
    y3 = case.y0.clone()
    triton_sgmv.lora_expand(y3, s2, rows, lora, layer, module)
    assert rel_err(y3.cpu(), ref) < tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SLOW
@given(spec=sgmv_specs(), split=st.integers(1, 3), block_m=st.sampled_from([16, 32]))
def test_sgmv_matches_float64(dtype, spec, split, block_m):
    check_all_entry_points(spec, dtype, split, block_m)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("popularity", POPULARITY)
def test_decode_batch_by_adapter_popularity(dtype, popularity):
    """Punica's cases: a decode batch (one token per request) whose adapters are identical,
    distinct, uniform, zipf or skewed; ranks 8/16/64 and a rank-3 one mixed; widths 5*16 and 7*16."""
    spec = SgmvSpec(d=16, rows_per_page=6, in_features=80, out_features=112, layer=1, module=4,
                    ranks=(8, 16, 64, 3), present=(True, True, True, True), req_lens=(1,) * 12,
                    popularity=popularity, no_adapter_share=0.0, sort=True, empty_segments=0,
                    seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    check_all_entry_points(spec, dtype, split=2, block_m=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_prefill_chunks_with_max_rank(dtype):
    """Long segments (several BLOCK_M tiles each) at rank 128 next to rank 1, one adapter without the module."""
    spec = SgmvSpec(d=16, rows_per_page=4, in_features=48, out_features=80, layer=0, module=6,
                    ranks=(128, 1, 33), present=(True, True, False), req_lens=(40, 1, 23, 17, 1),
                    popularity="distinct", no_adapter_share=0.0, sort=False, empty_segments=1,
                    seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    check_all_entry_points(spec, dtype, split=1, block_m=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [8, 16], ids=lambda d: f"d{d}")
def test_ranks_at_the_shrink_branch_bounds(dtype, d):
    """The shrink loads A by one of three branches, chosen per segment by its rank: 16-byte runs (rank 8, the
    multiples of 16), one page per k (ranks dividing D), one per element. Ranks on each side of every bound,
    on two-row pages so that runs sit at page edges: 24 and 40 (multiples of 8 whose runs of 16 ranks can cross
    a row; at D = 8 the wide branch once read their second run from the wrong page), 8, 16, 32, 48, 4, 12, 1."""
    spec = SgmvSpec(d=d, rows_per_page=2, in_features=5 * d, out_features=3 * d, layer=1, module=2,
                    ranks=(24, 40, 8, 16, 32, 48, 4, 12, 1), present=(True,) * 9, req_lens=(1, 1, 3, 1, 2, 1, 1, 5, 1, 1, 1, 18),
                    popularity="distinct", no_adapter_share=0.0, sort=True, empty_segments=0,
                    seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    check_all_entry_points(spec, dtype, split=2, block_m=16)
