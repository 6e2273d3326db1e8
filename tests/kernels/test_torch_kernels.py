"""The torch kernels (the CPU path, and the semantics the Triton path matches) against float64.

Same scenarios as the Triton tests, more of them (these run at torch speed). The torch attention
path needs finite values in unused pool slots (it multiplies them by a zero weight; the pool is
zero-filled for that reason), so its pools hold random, not NaN, garbage.
"""

from __future__ import annotations

import pytest
import torch
from attention_testkit import attention_ref, attention_specs, build_attention_case
from hypothesis import HealthCheck, given, settings
from kernel_testkit import rel_err
from loraplex.kernels import torch_attention, torch_sgmv
from sgmv_testkit import build_sgmv_case, sgmv_specs, touched_tokens

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.float16]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@FAST
@given(spec=sgmv_specs())
def test_torch_sgmv_matches_float64(dtype, spec):
    case = build_sgmv_case(spec, dtype, device=torch.device("cpu"))
    rows, lora, layer, module = case.pool.rows(), case.lora, spec.layer, spec.module
    tol = TOL[dtype]
    touched = touched_tokens(case, layer, module)
    ref = case.y0.double() + case.delta_ref

    y = case.y0.clone()
    torch_sgmv.apply_lora(y, case.x, rows, lora, layer, module)
    assert rel_err(y, ref) < tol
    assert torch.equal(y[~touched], case.y0[~touched])

    s = torch_sgmv.lora_shrink(case.x, rows, lora, layer, module)
    assert s.shape == (lora.num_tokens, max(lora.max_rank, 1))
    assert rel_err(s, case.shrink_ref[:, : s.shape[1]]) < tol
    y2 = case.y0.clone()
    torch_sgmv.lora_expand(y2, s, rows, lora, layer, module)
    assert rel_err(y2, ref) < tol


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@FAST
@given(spec=attention_specs())
def test_torch_attention_matches_float64(dtype, spec):
    case = build_attention_case(spec, dtype, poison_unused=False, device=torch.device("cpu"))
    torch_attention.write_kv(case.kv_pool, case.k, case.v, case.meta, spec.layer)
    out = torch_attention.paged_attention(case.q, case.kv_pool, case.meta, spec.layer, case.scale)
    ref = attention_ref(case.q, case.kv_pool, case.meta, spec.layer, case.scale)
    assert rel_err(out, ref) < TOL[dtype]
