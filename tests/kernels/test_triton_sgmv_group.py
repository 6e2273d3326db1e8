"""The grouped Triton SGMV (several modules sharing x, one fused output, one launch pair) against a
float64 reference built from the adapters' weights (interpreted on the CPU, compiled on a GPU).

y is updated in place, so instead of poisoning the output the tests check that the columns of a
module a token's adapter lacks, the columns of tokens without an adapter, and the columns beside the
fused output's slice stay bit-identical; the pool's rows outside the adapters hold NaN and the shrink
partials are NaN-filled first, so a wrong page or an unwritten element fails the comparison.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kernel_testkit import DEVICE, PageDealer, rel_err
from loraplex.kernels import triton_sgmv
from loraplex.kernels.dispatch import TORCH_OPS, per_module
from loraplex.kernels.metadata import LoraBatch
from loraplex.lora.types import TARGET_MODULES, LoraAdapter
from loraplex.unified_pager.adapter_pages import plan_adapter
from loraplex.unified_pager.pool import PagePool
from sgmv_testkit import (
    POPULARITY,
    build_batch,
    lora_delta_ref,
    place,
    poisoned_pool,
    popularity_assignment,
    random_lora_adapter,
    sgmv_geometry,
)

TOL = {torch.float32: 1e-5, torch.float16: 1e-2}
DTYPES = [torch.float32, torch.float16]
SLOW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
QKV, GATE_UP = (0, 1, 2), (4, 5)


@dataclass(frozen=True)
class GroupSpec:
    """One grouped scenario; tensors are made from it with a seeded generator."""

    d: int  # pool row width
    rows_per_page: int
    in_features: int
    modules: tuple[int, ...]  # TARGET_MODULES indices of the group
    widths: tuple[int, ...]  # output columns of each module
    layer: int  # of 2
    ranks: tuple[tuple[int, ...], ...]  # per adapter, per module of the group; 0: the adapter lacks it
    req_lens: tuple[int, ...]
    popularity: str
    no_adapter_share: float
    sort: bool
    empty_segments: int
    seed: int

    @property
    def bounds(self) -> tuple[int, ...]:
        out = [0]
        for w in self.widths:
            out.append(out[-1] + w)
        return tuple(out)


@dataclass
class GroupCase:
    lora: LoraBatch
    pool: PagePool
    x: torch.Tensor  # [T, in]
    y0: torch.Tensor  # [T, N]
    shrink_ref: list[torch.Tensor]  # per module [T, MAX_TEST_RANK] float64
    delta_ref: torch.Tensor  # [T, N] float64
    touched: torch.Tensor  # [T, G] bool: the token's adapter carries module g at the layer


def group_adapter(spec: GroupSpec, i: int, rng: random.Random) -> LoraAdapter:
    """Adapter i: the group's modules it has a rank for, plus a module outside the group (whose rows
    move the group's off the adapter's first row, and which keeps an adapter lacking them all valid)."""
    other = (max(spec.modules) + 1) % len(TARGET_MODULES)
    shapes = {other: (spec.d * 3, spec.d * 5)}
    rank_of = {other: rng.randint(1, 40)}
    for m, w, r in zip(spec.modules, spec.widths, spec.ranks[i]):
        if r > 0:
            shapes[m] = (spec.in_features, w)
            rank_of[m] = r
    # random_lora_adapter cycles the ranks over (layer, module) in this order.
    ranks = [rank_of[m] for _ in (0, 1) for m in sorted(shapes)]
    return random_lora_adapter(f"a{i}", rng, shapes, [0, 1], ranks)


def build_group_case(spec: GroupSpec, dtype: torch.dtype) -> GroupCase:
    rng = random.Random(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    adapters = [group_adapter(spec, i, rng) for i in range(len(spec.ranks))]
    probe = sgmv_geometry(spec.d, spec.rows_per_page, 2, 1, dtype)
    pages = sum(-(-plan_adapter(probe, a).num_rows // spec.rows_per_page) for a in adapters)
    geometry = sgmv_geometry(spec.d, spec.rows_per_page, 2, pages + 8, dtype)
    pool = poisoned_pool(geometry, DEVICE)
    dealer = PageDealer(geometry.num_pages, rng)
    residencies = [place(pool, dealer, a) for a in adapters]
    assignment: list[int | None] = list(popularity_assignment(spec.popularity, len(spec.req_lens), len(adapters), rng))
    for i in range(len(assignment)):
        if rng.random() < spec.no_adapter_share:
            assignment[i] = None
    lora, token_adapter = build_batch(residencies, list(spec.req_lens), assignment, spec.sort, spec.empty_segments, rng)
    T, N = lora.num_tokens, spec.bounds[-1]
    x = torch.randn(T, spec.in_features, generator=gen).to(dtype).to(DEVICE)
    y0 = torch.randn(T, N, generator=gen).to(dtype).to(DEVICE)
    refs = [lora_delta_ref(x, token_adapter, adapters, spec.layer, m, w, dtype) for m, w in zip(spec.modules, spec.widths)]
    touched = torch.tensor([[ai is not None and spec.ranks[ai][g] > 0 for g in range(len(spec.modules))]
                            for ai in token_adapter], dtype=torch.bool).view(T, len(spec.modules))
    return GroupCase(lora, pool, x, y0, [s for s, _ in refs], torch.cat([d for _, d in refs], dim=1), touched)


def assert_untouched_kept(spec: GroupSpec, case: GroupCase, y: torch.Tensor) -> None:
    """Each module's columns of tokens whose adapter lacks it (or that have none) are as they were."""
    for g, (lo, hi) in enumerate(zip(spec.bounds, spec.bounds[1:])):
        keep = (~case.touched[:, g]).to(y.device)
        assert torch.equal(y[keep, lo:hi], case.y0[keep, lo:hi]), f"module {spec.modules[g]}: a token without it was changed"


def in_wide_output(spec: GroupSpec, case: GroupCase) -> tuple[torch.Tensor, torch.Tensor, int]:
    """y0 copied into the middle of a wider random tensor: (wide, y as a column slice of it, pad)."""
    pad, T, N = spec.d, case.lora.num_tokens, spec.bounds[-1]
    wide = torch.randn(T, N + 2 * pad, device=DEVICE).to(case.y0.dtype)
    y = wide[:, pad : pad + N]
    y.copy_(case.y0)
    return wide, y, pad


def check_group(spec: GroupSpec, dtype: torch.dtype, split: int, block_m: int) -> None:
    case = build_group_case(spec, dtype)
    rows, lora, layer, mods, bounds = case.pool.rows(), case.lora, spec.layer, spec.modules, spec.bounds
    tol, T, G, N = TOL[dtype], lora.num_tokens, len(mods), bounds[-1]
    ref = case.y0.double().cpu() + case.delta_ref
    max_rank = max((r for rs in spec.ranks for r in rs), default=0)
    sr = max(-(-max_rank // triton_sgmv.R_CHUNK) * triton_sgmv.R_CHUNK, triton_sgmv.R_CHUNK)

    if triton_sgmv.groupable(mods, bounds, spec.d):
        # The two launches: every partial written (zeros past each rank and for absent modules).
        partial = torch.full((split, T, G * sr), math.nan, dtype=torch.float32, device=DEVICE)
        triton_sgmv.sgmv_shrink_group_into(partial, case.x, rows, lora, layer, mods, block_m=block_m)
        s = partial.sum(0).cpu()
        for g in range(G):
            assert rel_err(s[:, g * sr : (g + 1) * sr], case.shrink_ref[g][:, :sr]) < tol, f"shrink of module {mods[g]}"
        wide, y, pad = in_wide_output(spec, case)
        before = wide.clone()
        triton_sgmv.sgmv_expand_group_from(y, partial, rows, lora, layer, mods, bounds, block_m=block_m)
        assert rel_err(y.cpu(), ref) < tol
        assert_untouched_kept(spec, case, y)
        assert torch.equal(wide[:, :pad], before[:, :pad]) and torch.equal(wide[:, pad + N :], before[:, pad + N :])

    # The entry point the model calls, on a column slice of a wider output.
    wide, y, pad = in_wide_output(spec, case)
    before = wide.clone()
    triton_sgmv.apply_lora_group(y, case.x, rows, lora, layer, mods, bounds, split=split)
    assert rel_err(y.cpu(), ref) < tol
    assert_untouched_kept(spec, case, y)
    assert torch.equal(wide[:, :pad], before[:, :pad]) and torch.equal(wide[:, pad + N :], before[:, pad + N :])

    # The same as one apply_lora per module.
    y_mod = case.y0.clone()
    for m, lo, hi in zip(mods, bounds, bounds[1:]):
        triton_sgmv.apply_lora(y_mod[:, lo:hi], case.x, rows, lora, layer, m, split=split)
    assert rel_err(y.cpu(), y_mod.double().cpu()) < tol


@st.composite
def group_specs(draw, d_choices=(8, 16)) -> GroupSpec:
    d = draw(st.sampled_from(d_choices))
    kind = draw(st.sampled_from(["qkv", "gate_up", "o", "down"]))
    if kind == "qkv":
        q, kv = d * draw(st.sampled_from([1, 3, 5])), d * draw(st.sampled_from([1, 3]))
        modules, widths = QKV, (q, kv, kv)
    elif kind == "gate_up":
        inter = d * draw(st.sampled_from([1, 3, 5]))
        modules, widths = GATE_UP, (inter, inter)
    else:
        modules, widths = ((3,) if kind == "o" else (6,)), (d * draw(st.sampled_from([1, 3, 5])),)
    num_adapters = draw(st.integers(1, 5))
    # A fifth of the (adapter, module) pairs absent: the adapter lacks that module of the group.
    rank = st.tuples(st.integers(0, 4), st.integers(1, 64)).map(lambda p: p[1] if p[0] else 0)
    ranks = tuple(tuple(draw(rank) for _ in modules) for _ in range(num_adapters))
    mode = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    n = draw(st.integers(1, 6))
    if mode == "decode":
        lens = [1] * n
    elif mode == "prefill":
        lens = draw(st.lists(st.integers(2, 40), min_size=n, max_size=n))
    else:
        lens = draw(st.lists(st.one_of(st.just(1), st.integers(2, 40)), min_size=n, max_size=n))
    return GroupSpec(
        d=d, rows_per_page=draw(st.integers(1, 6)) * 2, in_features=d * draw(st.sampled_from([1, 3, 5])),
        modules=modules, widths=widths, layer=draw(st.integers(0, 1)), ranks=ranks, req_lens=tuple(lens),
        popularity=draw(st.sampled_from(POPULARITY)), no_adapter_share=draw(st.sampled_from([0.0, 0.25])),
        sort=draw(st.booleans()), empty_segments=draw(st.integers(0, 2)), seed=draw(st.integers(0, 2**31 - 1)))


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@SLOW
@given(spec=group_specs(), split=st.integers(1, 3), block_m=st.sampled_from([16, 32]))
def test_group_matches_float64(dtype, spec, split, block_m):
    check_group(spec, dtype, split, block_m)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [1, 2])
def test_qkv_decode_mixed_ranks(dtype, split):
    """Llama's q | k | v at hidden 48, KV 16 (D 16): a decode batch of ranks 1 to 64, one adapter without
    k, one without q and v, tokens without an adapter and empty segments."""
    spec = GroupSpec(d=16, rows_per_page=6, in_features=48, modules=QKV, widths=(48, 16, 16), layer=1,
                     ranks=((1, 1, 1), (8, 0, 8), (16, 33, 64), (0, 7, 0), (64, 64, 64)), req_lens=(1,) * 10,
                     popularity="uniform", no_adapter_share=0.25, sort=False, empty_segments=2, seed=fresh_seed())
    check_group(spec, dtype, split, block_m=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("split", [1, 3])
def test_gate_up_long_segments(dtype, split):
    """gate | up at I = 80 (D 16): segments of several BLOCK_M tiles next to one-token ones, one adapter
    without up, mixed ranks."""
    spec = GroupSpec(d=16, rows_per_page=4, in_features=48, modules=GATE_UP, widths=(80, 80), layer=0,
                     ranks=((64, 3), (17, 0), (1, 48)), req_lens=(40, 1, 23, 1, 17),
                     popularity="distinct", no_adapter_share=0.0, sort=False, empty_segments=1, seed=fresh_seed())
    check_group(spec, dtype, split, block_m=16)


@pytest.mark.parametrize("module", [3, 6])
def test_one_module_is_apply_lora(module):
    """A group of one module is apply_lora: the same kernel with G = 1, bit for bit."""
    spec = GroupSpec(d=8, rows_per_page=4, in_features=40, modules=(module,), widths=(24,), layer=0,
                     ranks=((5,), (0,), (20,)), req_lens=(1, 9, 1, 3), popularity="distinct",
                     no_adapter_share=0.0, sort=True, empty_segments=1, seed=fresh_seed())
    check_group(spec, torch.float32, split=2, block_m=16)
    case = build_group_case(spec, torch.float32)
    rows = case.pool.rows()
    y1, y2 = case.y0.clone(), case.y0.clone()
    triton_sgmv.apply_lora_group(y1, case.x, rows, case.lora, 0, (module,), spec.bounds, split=2)
    triton_sgmv.apply_lora(y2, case.x, rows, case.lora, 0, module, split=2)
    assert torch.equal(y1, y2)


def test_no_segment_carries_the_group():
    """Every adapter lacks every module of the group: nothing is launched and y is unchanged."""
    spec = GroupSpec(d=8, rows_per_page=4, in_features=24, modules=GATE_UP, widths=(24, 24), layer=1,
                     ranks=((0, 0), (0, 0)), req_lens=(1, 5), popularity="distinct", no_adapter_share=0.0,
                     sort=False, empty_segments=0, seed=fresh_seed())
    case = build_group_case(spec, torch.float32)
    y = case.y0.clone()
    triton_sgmv.apply_lora_group(y, case.x, case.pool.rows(), case.lora, 1, GATE_UP, spec.bounds)
    assert torch.equal(y, case.y0)


def test_a_batch_without_any_adapter():
    """No request of the batch has an adapter (no segment at all): the launches' entry points write zero
    partials and leave y alone, with no segment table to index (the hypothesis test found them indexing one)."""
    spec = GroupSpec(d=8, rows_per_page=4, in_features=24, modules=QKV, widths=(16, 8, 8), layer=1,
                     ranks=((4, 8, 16),), req_lens=(1, 3), popularity="distinct", no_adapter_share=1.0,
                     sort=False, empty_segments=0, seed=fresh_seed())
    check_group(spec, torch.float32, split=2, block_m=16)


def test_modules_that_cannot_share_a_launch_go_one_by_one():
    """q and v without k are not consecutive: apply_lora_group falls back to one apply_lora each."""
    spec = GroupSpec(d=8, rows_per_page=4, in_features=24, modules=(0, 2), widths=(24, 8), layer=0,
                     ranks=((4, 9), (12, 0)), req_lens=(1, 6, 1), popularity="distinct", no_adapter_share=0.0,
                     sort=False, empty_segments=0, seed=fresh_seed())
    assert not triton_sgmv.groupable(spec.modules, spec.bounds, spec.d)
    check_group(spec, torch.float32, split=1, block_m=16)


def test_torch_backend_loops_over_modules_and_agrees():
    """The torch backend's apply_lora_group (one apply_lora per module) agrees with the Triton one
    (their signatures are compared in test_dispatch_triton.py)."""
    spec = GroupSpec(d=16, rows_per_page=4, in_features=32, modules=QKV, widths=(48, 16, 16), layer=0,
                     ranks=((8, 0, 3), (16, 16, 16)), req_lens=(1, 4, 1), popularity="distinct",
                     no_adapter_share=0.0, sort=False, empty_segments=0, seed=fresh_seed())
    case = build_group_case(spec, torch.float32)
    rows = case.pool.rows()
    y_torch, y_triton = case.y0.clone(), case.y0.clone()
    TORCH_OPS.apply_lora_group(y_torch, case.x, rows, case.lora, 0, QKV, spec.bounds)
    triton_sgmv.apply_lora_group(y_triton, case.x, rows, case.lora, 0, QKV, spec.bounds)
    ref = case.y0.double().cpu() + case.delta_ref
    assert rel_err(y_torch.cpu(), ref) < TOL[torch.float32] and rel_err(y_triton.cpu(), ref) < TOL[torch.float32]
    assert_untouched_kept(spec, case, y_torch)
    calls = []
    per_module(lambda *a: calls.append((a[0].shape[1], a[5])))(y_torch, case.x, rows, case.lora, 0, QKV, spec.bounds)
    assert calls == [(48, 0), (16, 1), (16, 2)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_steps_plan_is_built_once_and_serves_every_layer(dtype):
    """The launches of a group are planned at a step's first call and reused at the next layer (the host
    work the plan saves is what a GPU step waits for): each layer's result still matches its reference, and
    the step holds one plan for the group's shape."""
    seed = fresh_seed()
    specs = [GroupSpec(d=16, rows_per_page=4, in_features=32, modules=QKV, widths=(48, 16, 16), layer=layer,
                       ranks=((8, 16, 3), (16, 0, 16), (4, 4, 4)), req_lens=(1, 5, 1, 3), popularity="distinct",
                       no_adapter_share=0.0, sort=False, empty_segments=0, seed=seed) for layer in (0, 1)]
    cases = [build_group_case(s, dtype) for s in specs]  # the same adapters, batch and inputs; layers 0 and 1
    lora, rows = cases[0].lora, cases[0].pool.rows()
    for spec, case in zip(specs, cases):
        y = case.y0.clone()
        triton_sgmv.apply_lora_group(y, case.x, rows, lora, spec.layer, QKV, spec.bounds)
        assert rel_err(y.cpu(), case.y0.double().cpu() + case.delta_ref) < TOL[dtype]
        assert_untouched_kept(spec, case, y)
    assert len([k for k in lora.plan_cache if k[0] == "triton_group_plan"]) == 1
