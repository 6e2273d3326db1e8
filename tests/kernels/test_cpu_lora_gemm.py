"""The packed GEMM with the LoRA epilogue (kernels/cpu_lora_gemm.py) against float64, on random inputs.

A projection of several modules (q/k/v-like: three column ranges) over a batch of long and short
segments on scattered pages of a NaN-poisoned pool: the fused segments must get x @ W^T + b + their
delta, every other row x @ W^T + b exactly as the plain kernel computes it, and the split must hand
the short segments and ranks the blocked kernels do not take to ops.apply_lora.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_testkit import PageDealer, rel_err
from loraplex.kernels import LoraBatch, LoraSegment, cpu_linear, cpu_lora_gemm, cpu_sgmv
from native_kernels import require_built
from sgmv_testkit import build_batch, lora_delta_ref, place, poisoned_pool, random_lora_adapter, sgmv_geometry


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_linear", cpu_linear.available(), "packed GEMM")
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")


@st.composite
def cases(draw):
    nr = cpu_linear.panel_width()
    d = nr * draw(st.sampled_from([1, 2]))
    widths = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))  # module outputs, in units of d
    n_adapters = draw(st.integers(1, 4))
    return dict(
        # 1600 + d: a K past the default model's
        d=d, widths=widths, in_features=draw(st.sampled_from([d, 3 * d, 5 * d, 1600 + d])),
        rows_per_page=2 * draw(st.integers(1, 6)),
        ranks=[[8 * draw(st.integers(1, 8)) for _ in widths] for _ in range(n_adapters)],
        lens=draw(st.lists(st.one_of(st.just(1), st.integers(2, 16), st.integers(17, 60)), min_size=1, max_size=6)),
        bias=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
    )


@dataclass
class Projection:
    """One fused projection of a random case: its inputs, the split, and the float64 reference."""

    x: torch.Tensor  # [T, in]
    packed: cpu_linear.PackedWeight
    b: torch.Tensor | None
    pool_rows: torch.Tensor
    lora: LoraBatch
    parts: cpu_lora_gemm.FusedSplit
    layer: int
    cols: cpu_lora_gemm.ModuleColumns
    ref: torch.Tensor  # [T, out] float64: x @ W^T + b + the fused segments' deltas
    fused_rows: torch.Tensor  # [T] bool


def _projection(case: dict) -> Projection:
    rng = random.Random(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    d, k = case["d"], case["in_features"]
    modules = tuple(range(len(case["widths"])))  # q, k, v, ... as TARGET_MODULES indices
    outs = [w * d for w in case["widths"]]
    bounds = [0]
    for o in outs:
        bounds.append(bounds[-1] + o)
    adapters = [random_lora_adapter(f"a{i}", rng, {m: (k, outs[m]) for m in modules}, [0, 1], ranks)
                for i, ranks in enumerate(case["ranks"])]
    # Pages for every adapter's rows: A^T's in x rank floats dominate at K = 1600 + d.
    rows = sum(-(-(k + o) * r // d) for ranks in case["ranks"] for o, r in zip(outs, ranks)) * 2  # 2 layers
    geometry = sgmv_geometry(d, case["rows_per_page"], 2, max(4000, 2 * rows // case["rows_per_page"]), torch.float32)
    pool = poisoned_pool(geometry, torch.device("cpu"))
    dealer = PageDealer(geometry.num_pages, rng)
    residencies = [place(pool, dealer, a) for a in adapters]
    assignment = case.get("assignment") or [rng.randrange(len(adapters) + 1) for _ in case["lens"]]
    req_adapter = [None if a == len(adapters) else a for a in assignment]  # the last index: no adapter
    lora, token_adapter = build_batch(residencies, case["lens"], req_adapter, False, 0, rng)
    T = lora.num_tokens
    x = torch.randn(T, k, generator=gen)
    w = torch.randn(bounds[-1], k, generator=gen) / k**0.5
    b = torch.randn(bounds[-1], generator=gen) if case["bias"] else None
    layer = rng.randrange(2)
    parts = cpu_lora_gemm.split(lora, d)
    if case.get("all_in_epilogue"):  # every segment to the epilogue, short ones too (the split sends only long ones)
        parts = cpu_lora_gemm.FusedSplit(lora, None)
    fused_rows = torch.zeros(T, dtype=torch.bool)
    for seg in parts.fused.segments if parts.fused else ():
        fused_rows[seg.start : seg.start + seg.length] = True
    ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    fused_adapter = [a if fused_rows[t] else None for t, a in enumerate(token_adapter)]
    for m in modules:
        _, delta = lora_delta_ref(x, fused_adapter, adapters, layer, m, outs[m], torch.float32)
        ref[:, bounds[m] : bounds[m + 1]] += delta
    return Projection(x, cpu_linear.pack(w), b, pool.rows(), lora, parts, layer,
                      cpu_lora_gemm.ModuleColumns(modules, tuple(bounds)), ref, fused_rows)


def _run(p: Projection) -> torch.Tensor:  # [T, out]
    return cpu_lora_gemm.linear_lora(p.x, p.packed, p.b, p.pool_rows, p.parts.fused, p.layer, p.cols)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_linear_lora_matches_float64(case):
    p = _projection(case)
    fused_ids = {id(s) for s in p.parts.fused.segments} if p.parts.fused else set()
    for seg in p.lora.segments:  # the split: long segments go to the epilogue (every rank here is a multiple of 8)
        assert (id(seg) in fused_ids) == (seg.length > cpu_sgmv.LONG_SEGMENT)
    plain = cpu_linear.linear(p.x, p.packed, p.b)
    if p.parts.fused is None:
        return
    y = _run(p)
    assert rel_err(y[p.fused_rows], p.ref[p.fused_rows]) < 1e-5
    assert torch.equal(y[~p.fused_rows], plain[~p.fused_rows])  # the plain kernel's result, bit for bit


@pytest.mark.parametrize("lens", [[40, 9, 20], [300, 5, 180, 120]], ids=["one-chunk", "many-chunks"])
def test_the_threads_split_rows_or_panels_to_the_same_sums(lens, monkeypatch):
    """linear_lora's threads split the rows, each shrinking its own chunk before its panels, where the batch has a
    chunk of rows per thread or more, else the panels after one shrink of all rows: one thread always takes the
    first way; two threads take the second for 69 rows and the first for 605 (chunks of 72-78 rows at K = 1600 + d).
    Every row's sums are the same either way, bit for bit, and the float64 reference's within float32's error.
    The shrink's scratch is poisoned, so that a row the shrink leaves unwritten fails."""
    scratch = cpu_lora_gemm._scratch
    monkeypatch.setattr(cpu_lora_gemm, "_scratch", lambda *a: (lambda s, c: (s.fill_(float("nan")), c))(*scratch(*a)))
    d = cpu_linear.panel_width()
    case = dict(d=d, widths=[2, 1, 1], in_features=1600 + d, rows_per_page=6, ranks=[[16, 8, 24], [8, 8, 8]],
                lens=lens, assignment=[0, 2, 1, 0][: len(lens)], bias=True, seed=random.randrange(2**31))
    p = _projection(case)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(p)
        torch.set_num_threads(2)
        two = _run(p)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert rel_err(one[p.fused_rows], p.ref[p.fused_rows]) < 1e-5
    plain = cpu_linear.linear(p.x, p.packed, p.b)
    assert torch.equal(one[~p.fused_rows], plain[~p.fused_rows])


@pytest.mark.parametrize("rank", [8, 16, 24])
def test_a_tokens_shrink_is_the_same_in_any_block(rank):
    """The shrink cuts a segment into blocks of up to 12 tokens (6 on AVX2) and linear_lora's rows split cuts it again
    where a thread's chunk ends, so the same token may be shrunk in a block of one or of several: its s must be the
    same bit for bit (GCC 12 on a Zen 4 compiled the one-token block without FMAs and the larger ones with them)."""
    seed = random.randrange(2**31)
    d = cpu_linear.panel_width()
    case = dict(d=d, widths=[2, 1, 1], in_features=1600 + d, rows_per_page=6, ranks=[[rank] * 3], lens=[40],
                assignment=[0], bias=False, seed=seed)
    p = _projection(case)
    adapter = p.lora.segments[0].adapter
    start = p.lora.segments[0].start
    whole = LoraBatch((LoraSegment(start, 15, adapter),), p.lora.num_tokens)
    batches = [whole] + [LoraBatch(tuple(LoraSegment(start + t, n, adapter) for t, n in cuts), p.lora.num_tokens)
                         for cuts in ([(0, 14), (14, 1)], [(0, 1), (1, 14)], [(t, 1) for t in range(15)])]
    got = [cpu_lora_gemm.shrink(p.x, p.pool_rows, b, p.layer, p.cols) for b in batches]
    for s, cols in got[1:]:
        for c in cols:
            assert torch.equal(s[start : start + 15, c : c + rank], got[0][0][start : start + 15, c : c + rank]), seed


def test_split_leaves_ranks_the_blocked_kernels_do_not_take():
    rng = random.Random(0)
    d = cpu_linear.panel_width()
    geometry = sgmv_geometry(d, 8, 1, 400, torch.float32)
    pool = poisoned_pool(geometry, torch.device("cpu"))
    dealer = PageDealer(geometry.num_pages, rng)
    odd = place(pool, dealer, random_lora_adapter("odd", rng, {0: (d, d), 1: (d, d)}, [0], [16, 12]))
    even = place(pool, dealer, random_lora_adapter("even", rng, {0: (d, d)}, [0], [16]))
    lora, _ = build_batch([odd, even], [40, 40, 3], [0, 1, 1], False, 0, rng)
    parts = cpu_lora_gemm.split(lora, d)
    assert [(s.adapter, s.length) for s in parts.fused.segments] == [(even, 40)]  # rank 16 everywhere
    assert [(s.adapter, s.length) for s in parts.rest.segments] == [(odd, 40), (even, 3)]
    assert cpu_lora_gemm.split(lora, d) is parts  # cached on the batch


def test_linear_lora_refuses_module_columns_off_the_panel_grid():
    d = cpu_linear.panel_width()
    rng = random.Random(1)
    geometry = sgmv_geometry(d, 8, 1, 400, torch.float32)
    pool = poisoned_pool(geometry, torch.device("cpu"))
    res = place(pool, PageDealer(geometry.num_pages, rng), random_lora_adapter("a", rng, {0: (d, 2 * d)}, [0], [8]))
    lora, _ = build_batch([res], [20], [0], False, 0, rng)
    packed = cpu_linear.pack(torch.randn(2 * d, d))
    with pytest.raises(RuntimeError, match="multiples of the panel width"):
        cpu_lora_gemm.linear_lora(torch.randn(20, d), packed, None, pool.rows(), lora, 0,
                                  cpu_lora_gemm.ModuleColumns((0, 1), (0, d + 8, 2 * d)))


@pytest.mark.parametrize("lens", [[3, 2, 1, 4, 2, 5, 1, 3, 40], [1] * 13 + [30, 2, 2]], ids=["mixed", "ones"])
def test_segments_shorter_than_a_block_each_get_their_own_delta(lens):
    """Segments of a few rows, adjacent, some without an adapter, sent straight to the epilogue (the split sends only
    segments longer than cpu_sgmv.LONG_SEGMENT): each adapter's delta reaches its own rows and no others, where several
    segments' rows fall within one block's worth of rows."""
    d = cpu_linear.panel_width()
    case = dict(d=d, widths=[2, 1], in_features=3 * d, rows_per_page=4, ranks=[[8, 16], [16, 8], [24, 24]],
                lens=lens, assignment=[i % 4 for i in range(len(lens))], bias=True, all_in_epilogue=True,
                seed=random.randrange(2**31))
    p = _projection(case)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            y = _run(p)
            assert rel_err(y[p.fused_rows], p.ref[p.fused_rows]) < 1e-5
            plain = cpu_linear.linear(p.x, p.packed, p.b)
            assert torch.equal(y[~p.fused_rows], plain[~p.fused_rows])
    finally:
        torch.set_num_threads(threads)
