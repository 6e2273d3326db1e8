"""The C++ CPU attention kernel (kernels/cpu_attention.cpp) against the float64 reference.

As in the Triton tests, every pool slot that is not a cached or new token holds NaN (the new
tokens' slots too until write_kv fills them) and the output is NaN-filled before each run, so a
read past a sequence's length, a wrong page, or an element left unwritten fails the comparison.
"""

from __future__ import annotations

import math
import os
import platform
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from attention_testkit import AttentionSpec, attention_ref, attention_specs, build_attention_case
from hypothesis import HealthCheck, given, settings
from kernel_testkit import rel_err
from loraplex.kernels import cpu_attention, cpu_build, torch_attention

CPU = torch.device("cpu")
TOL = 1e-5
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def ext():
    mod = cpu_attention.extension()
    if mod is None:
        reason = f"cpu_attention extension not built: {cpu_build.build_error(cpu_attention.STEM)}"
        if os.environ.get("CI") and not cpu_build.disabled():
            pytest.fail(reason)  # CI has a compiler: a build failure there is a bug, not a skip
        pytest.skip(reason)
    return mod


def decode_only(spec: AttentionSpec) -> AttentionSpec:
    return replace(spec, seqs=tuple((c, 1) for c, _ in spec.seqs))


def prefill_only(spec: AttentionSpec) -> AttentionSpec:
    return replace(spec, seqs=tuple((c, max(q, 2)) for c, q in spec.seqs))


def run_kernel(ext, spec: AttentionSpec, prefill: bool = True, scale_mult: float = 1.0,
               strided_q: bool = False) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(kernel output, float64 reference, case) on a NaN-poisoned pool and a NaN-filled output."""
    case = build_attention_case(spec, torch.float32, poison_unused=True, device=CPU)
    meta, kv, layer = case.meta, case.kv_pool, spec.layer
    torch_attention.write_kv(kv, case.k, case.v, meta, layer)
    q = case.q
    if strided_q:  # as the model passes it: a slice of a wider (fused qkv) row
        t, h, d = q.shape
        fused = torch.full((t, h + 3, d), math.nan)
        fused[:, :h] = q
        q = fused[:, :h]
    scale = case.scale * scale_mult
    out = torch.full(q.shape, math.nan)
    ext.paged_attention(out, q, kv, meta.block_tables[layer], cpu_attention.kernel_tiles(meta, spec.group, prefill), scale)
    return out, attention_ref(case.q, kv, meta, layer, scale), case


@FAST
@given(spec=attention_specs())
def test_mixed_batches_match_float64(ext, spec):
    out, ref, _ = run_kernel(ext, spec)
    assert rel_err(out, ref) < TOL


@FAST
@given(spec=attention_specs(max_ctx=70).map(decode_only))
def test_decode_only_matches_float64(ext, spec):
    out, ref, _ = run_kernel(ext, spec)
    assert rel_err(out, ref) < TOL


@FAST
@given(spec=attention_specs(max_new=40).map(prefill_only))
def test_prefill_only_matches_float64(ext, spec):
    out, ref, _ = run_kernel(ext, spec)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("head_dim", [64, 32, 128, 24])  # the unrolled head sizes and the generic loop
@pytest.mark.parametrize("group", [1, 3, 8])
def test_blocks_of_16_mid_block_and_across_blocks(ext, group, head_dim):
    """Lengths that end mid-block, on a block edge, one past it, far across blocks (several
    16-key chunks, so the running max is rescaled), a chunk starting mid-block, a 1-token context;
    q read through strides, as the model's slice of its fused qkv."""
    spec = AttentionSpec(block_size=16, kv_heads=2, group=group, head_dim=head_dim,
                         seqs=((6, 1), (15, 1), (16, 1), (0, 1), (100, 1), (21, 19), (0, 33), (130, 5)),
                         layer=1, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    out, ref, _ = run_kernel(ext, spec, strided_q=True)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("prefill_rows", [1, 16, 40, 96])  # a token a tile, by rows, and in lanes
@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_tiles_of_any_size(ext, monkeypatch, group, prefill_rows):
    """Chunks cut into tiles of several sizes (whole and partial 16-row vectors, tiles smaller and
    larger than a chunk), after contexts that end mid-block, beside decodes."""
    monkeypatch.setattr(cpu_attention, "PREFILL_ROWS", prefill_rows)
    spec = AttentionSpec(block_size=16, kv_heads=2, group=group, head_dim=64,
                         seqs=((0, 37), (9, 1), (45, 20), (16, 2), (70, 1)),
                         layer=0, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    out, ref, _ = run_kernel(ext, spec)
    assert rel_err(out, ref) < TOL


def test_large_scores_stay_finite(ext):
    """Scores in the thousands: the running max keeps every exp in range."""
    spec = AttentionSpec(block_size=4, kv_heads=1, group=3, head_dim=16, seqs=((50, 1), (9, 7), (33, 1)),
                         layer=0, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    out, ref, _ = run_kernel(ext, spec, scale_mult=300.0)
    assert rel_err(out, ref) < 1e-4  # near one-hot softmax: the scores' own fp32 rounding shows


@pytest.fixture
def torch_threads(request):
    # The kernel splits a small decode batch's sequences by keys (run_all) by the thread count: fixed here (2
    # unless a test asks for others) so that the split cases are the ones a 2-core server runs.
    before = torch.get_num_threads()
    torch.set_num_threads(getattr(request, "param", 2))
    yield
    torch.set_num_threads(before)


# Decode batches of fewer tokens than four times the threads, long enough (512 keys and up) to be cut into
# parts: 1 token in 2-4 parts, 3 and 5 tokens in 2 (a whole number of units a thread); lengths off the
# block and chunk edges, so that parts start mid-block.
SPLIT_BATCHES = [((1000, 1),), ((2047, 1),), ((700, 1), (513, 1), (1200, 1)),
                 ((511, 1), (600, 1), (530, 1), (900, 1), (64, 1))]


@pytest.mark.parametrize("seqs", SPLIT_BATCHES)
@pytest.mark.parametrize("group,head_dim", [(3, 64), (1, 24), (8, 32)])
def test_small_decode_batches_split_by_keys_match_float64(ext, torch_threads, seqs, group, head_dim):
    spec = AttentionSpec(block_size=16, kv_heads=2, group=group, head_dim=head_dim, seqs=seqs, layer=1,
                         seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    out, ref, _ = run_kernel(ext, spec, strided_q=True)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("torch_threads", [1, 2, 3], indirect=True)
def test_split_parts_merge_with_far_apart_maxima(ext, torch_threads):
    """Scores in the thousands: each part's reference max differs from the others' by far more than
    float32's exp range, and the merge rescales every part to the largest (one thread: two tokens, no
    split, the same answer). Blocks of 5 keys: parts and chunks cross pages."""
    spec = AttentionSpec(block_size=5, kv_heads=1, group=3, head_dim=16, seqs=((900, 1), (520, 1)),
                         layer=0, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    out, ref, _ = run_kernel(ext, spec, scale_mult=300.0)
    assert rel_err(out, ref) < 1e-4


def test_decode_tiles_leave_prefill_rows_untouched(ext):
    """With prefill left to the torch path, the kernel writes the decode tokens and nothing else."""
    spec = AttentionSpec(block_size=8, kv_heads=2, group=3, head_dim=40, seqs=((7, 1), (3, 6), (20, 1), (0, 4)),
                         layer=1, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    out, ref, case = run_kernel(ext, spec, prefill=False)
    decode_tok = [case.meta.query_start_host[s] for s in case.meta.decode_seqs]
    prefill_tok = [t for t in range(case.meta.num_tokens) if t not in decode_tok]
    assert rel_err(out[decode_tok], ref[decode_tok]) < TOL
    assert torch.isnan(out[prefill_tok]).all()


@pytest.mark.parametrize("prefill_in_kernel", [True, False])
def test_wrapper_matches_torch_path(ext, monkeypatch, prefill_in_kernel):
    """paged_attention: same answer as the torch path (finite pool: the torch path needs one)."""
    monkeypatch.setattr(cpu_attention, "PREFILL_IN_KERNEL", prefill_in_kernel)
    spec = AttentionSpec(block_size=4, kv_heads=3, group=3, head_dim=64, seqs=((6, 1), (0, 9), (13, 1), (5, 3)),
                         layer=0, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    case = build_attention_case(spec, torch.float32, poison_unused=False, device=CPU)
    torch_attention.write_kv(case.kv_pool, case.k, case.v, case.meta, 0)
    out = cpu_attention.paged_attention(case.q, case.kv_pool, case.meta, 0, case.scale)
    ref = attention_ref(case.q, case.kv_pool, case.meta, 0, case.scale)
    assert out.is_contiguous() and out.shape == case.q.shape
    assert rel_err(out, ref) < TOL
    assert rel_err(out, torch_attention.paged_attention(case.q, case.kv_pool, case.meta, 0, case.scale)) < TOL


def test_float16_falls_back_to_the_torch_path():
    spec = AttentionSpec(block_size=4, kv_heads=1, group=3, head_dim=16, seqs=((5, 1), (2, 3)),
                         layer=0, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    case = build_attention_case(spec, torch.float16, poison_unused=False, device=CPU)
    out = cpu_attention.paged_attention(case.q, case.kv_pool, case.meta, 0, case.scale)
    expected = torch_attention.paged_attention(case.q, case.kv_pool, case.meta, 0, case.scale)
    assert torch.equal(out, expected)


def test_without_the_extension_float32_takes_the_torch_path(monkeypatch):
    monkeypatch.setattr(cpu_attention, "extension", lambda: None)
    spec = AttentionSpec(block_size=4, kv_heads=1, group=3, head_dim=16, seqs=((5, 1), (2, 3)),
                         layer=0, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    case = build_attention_case(spec, torch.float32, poison_unused=False, device=CPU)
    out = cpu_attention.paged_attention(case.q, case.kv_pool, case.meta, 0, case.scale)
    expected = torch_attention.paged_attention(case.q, case.kv_pool, case.meta, 0, case.scale)
    assert torch.equal(out, expected)


def test_page_outside_the_pool_is_refused(ext):
    spec = AttentionSpec(block_size=4, kv_heads=1, group=1, head_dim=16, seqs=((5, 1), (2, 1)),
                         layer=0, seed=0)
    case = build_attention_case(spec, torch.float32, poison_unused=False, device=CPU)
    tables = case.meta.block_tables[0].clone()
    tables[1, 0] = case.kv_pool.shape[0]
    with pytest.raises(RuntimeError, match="outside"):
        ext.paged_attention(torch.empty_like(case.q), case.q, case.kv_pool, tables,
                            cpu_attention.kernel_tiles(case.meta, 1), case.scale)


@FAST
@given(spec=attention_specs())
def test_write_kv_matches_the_torch_path(ext, spec):
    """The new tokens' K and V land in the slots the torch path's index_copy_ puts them in, bit for bit, the
    NaN-poisoned slots around them untouched; v is a strided slice of a fused row, as in the model."""
    case = build_attention_case(spec, torch.float32, poison_unused=True, device=CPU)
    expected = case.kv_pool.clone()
    torch_attention.write_kv(expected, case.k, case.v, case.meta, spec.layer)
    real = torch_attention.write_kv
    try:  # the C++ kernel, not the torch fallback, must be what runs
        torch_attention.write_kv = lambda *a: pytest.fail("cpu_attention.write_kv fell back to the torch path")
        cpu_attention.write_kv(case.kv_pool, case.k, case.v, case.meta, spec.layer)
    finally:
        torch_attention.write_kv = real
    torch.testing.assert_close(case.kv_pool, expected, rtol=0, atol=0, equal_nan=True)


def test_write_kv_refuses_a_slot_outside_the_pool_and_writes_nothing(ext):
    spec = AttentionSpec(block_size=4, kv_heads=2, group=3, head_dim=16, seqs=((5, 1), (0, 6)), layer=0, seed=3)
    case = build_attention_case(spec, torch.float32, poison_unused=True, device=CPU)
    before = case.kv_pool.clone()
    pages = case.meta.slot_pages[0].clone()
    pages[-1] = case.kv_pool.shape[0]  # one past the last page
    with pytest.raises(RuntimeError, match="outside the pool"):
        ext.write_kv(case.kv_pool, case.k, case.v, pages, case.meta.slot_offsets)
    torch.testing.assert_close(case.kv_pool, before, rtol=0, atol=0, equal_nan=True)


# -- the AVX2 build (8-float vectors) on any x86 CPU --------------------------------------------------------
# The kernel's vector width follows the build: 16 floats with AVX-512, 8 without. The machine that runs the
# tests builds only its own, so the other width is built here too, with AVX-512 turned off (on a CPU without
# it that build is the native one, under another name).


@pytest.fixture(scope="module")
def ext_avx2(ext):
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("-mno-avx512f is an x86 flag")
    src = Path(cpu_attention.__file__).with_name(f"{cpu_attention.STEM}.cpp")
    return cpu_build.compile_source(src, "test_avx2_cpu_attention", extra_cflags=["-mno-avx512f"])


@FAST
@given(spec=attention_specs())
def test_avx2_build_mixed_batches_match_float64(ext_avx2, spec):
    out, ref, _ = run_kernel(ext_avx2, spec)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("head_dim", [64, 32, 128, 24])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_avx2_build_edge_lengths_match_float64(ext_avx2, group, head_dim):
    """test_blocks_of_16_mid_block_and_across_blocks' cases: here the key chunks are 8 long."""
    spec = AttentionSpec(block_size=16, kv_heads=2, group=group, head_dim=head_dim,
                         seqs=((6, 1), (7, 1), (8, 1), (15, 1), (16, 1), (0, 1), (100, 1), (21, 19), (0, 33),
                               (130, 5), (3, 13)),
                         layer=1, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    out, ref, _ = run_kernel(ext_avx2, spec, strided_q=True)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("seqs", SPLIT_BATCHES)
def test_avx2_build_split_decode_matches_float64(ext_avx2, torch_threads, seqs):
    spec = AttentionSpec(block_size=16, kv_heads=3, group=3, head_dim=64, seqs=seqs, layer=0,
                         seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    out, ref, _ = run_kernel(ext_avx2, spec)
    assert rel_err(out, ref) < TOL


@pytest.mark.parametrize("prefill_rows", [1, 8, 16, 40, 96])
def test_avx2_build_prefill_tiles_match_float64(ext_avx2, monkeypatch, prefill_rows):
    monkeypatch.setattr(cpu_attention, "PREFILL_ROWS", prefill_rows)
    spec = AttentionSpec(block_size=16, kv_heads=3, group=3, head_dim=64, seqs=((0, 37), (40, 17), (5, 1)),
                         layer=0, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
    out, ref, _ = run_kernel(ext_avx2, spec)
    assert rel_err(out, ref) < TOL
