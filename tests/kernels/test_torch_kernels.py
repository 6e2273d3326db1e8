"""The torch kernels (the CPU path, and the semantics the Triton path matches) against float64.

Same scenarios as the Triton tests, more of them (these run at torch speed). The torch attention
path needs finite values in unused pool slots (it multiplies them by a zero weight; the pool is
zero-filled for that reason), so its pools hold random, not NaN, garbage.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from attention_testkit import attention_ref, attention_specs, build_attention_case
from hypothesis import HealthCheck, given, settings
from kernel_testkit import rel_err
from loraplex.kernels import LoraBatch, LoraSegment, torch_attention, torch_sgmv
from loraplex.unified_pager.adapter_pages import place_adapter, plan_adapter
from sgmv_testkit import (build_sgmv_case, lora_delta_ref, poisoned_pool, random_lora_adapter, sgmv_geometry,
                          sgmv_specs, touched_tokens)

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


@pytest.mark.parametrize("length", [1, 5, torch_sgmv.SHORT_SEGMENT, torch_sgmv.SHORT_SEGMENT + 7])
def test_consecutive_pages_are_read_as_views_and_match_float64(length):
    # A fresh pool hands out consecutive pages: matrices are then multiplied where they lie (the view
    # path for long segments; embedding bags for short ones), on either side of the short-segment cut.
    rng = random.Random()
    d, rpp = 16, 4
    shapes = {0: (3 * d, 5 * d), 6: (5 * d, 3 * d)}
    geometry = sgmv_geometry(d, rpp, num_layers=1, num_pages=4096, dtype=torch.float32)
    pool = poisoned_pool(geometry)
    adapters = [random_lora_adapter(f"a{i}", rng, shapes, [0], [rng.randint(1, 40)]) for i in range(2)]
    first = 0
    residencies = []
    for a in adapters:
        plan = plan_adapter(geometry, a)
        residencies.append(place_adapter(pool, a.name, plan, np.arange(first, first + plan.num_pages)))
        first += plan.num_pages + 3  # a gap between adapters, consecutive pages within each
    t = 2 * length + 3
    segs = (LoraSegment(0, length, residencies[0]), LoraSegment(length + 3, length, residencies[1]))
    token_adapter = [0] * length + [None] * 3 + [1] * length
    for module, (in_f, out_f) in shapes.items():
        lora = LoraBatch(segs, t)
        x = torch.randn(t, in_f)
        y0 = torch.randn(t, out_f)
        _, delta = lora_delta_ref(x, token_adapter, adapters, 0, module, out_f, torch.float32)
        y = y0.clone()
        torch_sgmv.apply_lora(y, x, pool.rows(), lora, 0, module)
        assert rel_err(y, y0.double() + delta) < TOL[torch.float32]
        assert torch.equal(y[length : length + 3], y0[length : length + 3])
        if length > torch_sgmv.SHORT_SEGMENT:  # the long path found its rows consecutive: no copy
            assert residencies[0].kernel_cache[("a_first", 0, module)] >= 0
