"""The Triton attention kernels against a float64 reference (interpreted on the CPU, compiled on a GPU).

Every pool slot that is not a cached or new token holds NaN (so reading past a sequence's end, or
a wrong page, shows), the new tokens' slots too until write_kv fills them, and the output is
NaN-filled before each run so that an element the kernel does not write fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_testkit import (
    AttentionSpec,
    attention_ref,
    attention_specs,
    build_attention_case,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_testkit import rel_err
from loraplex.kernels import torch_attention, triton_attention

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.float16]
SLOW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def check_attention(spec: AttentionSpec, dtype: torch.dtype, splits: int | None, prefill_block_m: int) -> None:
    case = build_attention_case(spec, dtype, poison_unused=True)
    meta, kv, layer = case.meta, case.kv_pool, spec.layer

    expected = kv.clone()
    torch_attention.write_kv(expected, case.k, case.v, meta, layer)  # plain indexing: the definition
    triton_attention.write_kv(kv, case.k, case.v, meta, layer)
    torch.testing.assert_close(kv, expected, rtol=0, atol=0, equal_nan=True)

    out = torch.full_like(case.q, math.nan)
    triton_attention.paged_attention(case.q, kv, meta, layer, case.scale, out=out, decode_splits=splits,
                                     prefill_block_m=prefill_block_m)
    ref = attention_ref(case.q, expected, meta, layer, case.scale)
    assert rel_err(out.cpu(), ref) < TOL[dtype]

    default = triton_attention.paged_attention(case.q, kv, meta, layer, case.scale)
    assert rel_err(default.cpu(), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SLOW
@given(spec=attention_specs(), splits=st.sampled_from([None, 1, 2, 3]), prefill_block_m=st.sampled_from([16, 32]))
def test_paged_attention_matches_float64(dtype, spec, splits, prefill_block_m):
    check_attention(spec, dtype, splits, prefill_block_m)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 8])
def test_chunk_starting_mid_block_beside_decodes(dtype, group):
    """A prefill chunk whose first token is in the middle of a block (ctx 6, block 4), a chunk
    longer than one tile, a first chunk, and decodes at and across block boundaries."""
    spec = AttentionSpec(block_size=4, kv_heads=2, group=group, head_dim=24,
                         seqs=((6, 9), (0, 1), (7, 1), (8, 1), (0, 21), (33, 1)), layer=1,
                         seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    check_attention(spec, dtype, splits=2, prefill_block_m=16)


def test_decode_split_kv_long_context():
    """Decodes over more keys than one split, split 1..4 ways, all equal to the reference."""
    spec = AttentionSpec(block_size=8, kv_heads=1, group=3, head_dim=16, seqs=((150, 1), (97, 1), (5, 1)),
                         layer=0, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    for splits in (1, 2, 4):
        check_attention(spec, torch.float32, splits=splits, prefill_block_m=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_steps_plan_serves_every_layer(dtype):
    """The launches are planned at a step's first layer and reused at the next (the host time they save is
    what a GPU decode step waits for): each layer, split 2 ways, still matches its reference, and write_kv
    fills each layer's own pages."""
    spec = AttentionSpec(block_size=4, kv_heads=2, group=3, head_dim=16, seqs=((9, 1), (0, 6), (14, 1)), layer=0,
                         seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    case = build_attention_case(spec, dtype, poison_unused=True)
    meta, kv = case.meta, case.kv_pool
    expected = kv.clone()
    for layer in (0, 1):
        torch_attention.write_kv(expected, case.k, case.v, meta, layer)
        triton_attention.write_kv(kv, case.k, case.v, meta, layer)
        torch.testing.assert_close(kv, expected, rtol=0, atol=0, equal_nan=True)
        out = torch.full_like(case.q, math.nan)
        triton_attention.paged_attention(case.q, kv, meta, layer, case.scale, out=out, decode_splits=2)
        assert rel_err(out.cpu(), attention_ref(case.q, expected, meta, layer, case.scale)) < TOL[dtype]
    assert len([k for k in meta.plan_cache if k[0] == "triton_attn_plan"]) == 2  # decode and prefill tiles
