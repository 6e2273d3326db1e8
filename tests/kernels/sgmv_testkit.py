"""Pools, adapters, batches and float64 references for the SGMV tests (everything in-process).

Adapters are placed on randomly chosen, scattered pages of a pool whose other pages hold NaN, so a
kernel that reads one row outside an adapter's pages (or past a matrix) turns its output into NaN.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from kernel_testkit import DEVICE, PageDealer
from loraplex.kernels import LoraBatch, LoraSegment
from loraplex.lora.types import TARGET_MODULES, LoraAdapter, LoraModuleWeights
from loraplex.unified_pager.adapter_pages import (
    AdapterResidency,
    place_adapter,
    plan_adapter,
)
from loraplex.unified_pager.geometry import PoolGeometry
from loraplex.unified_pager.pool import PagePool

POPULARITY = ("identical", "distinct", "uniform", "zipf", "skewed")
MAX_TEST_RANK = 128  # shrink references are this wide, zeros past each rank


def sgmv_geometry(d: int, rows_per_page: int, num_layers: int, num_pages: int, dtype: torch.dtype) -> PoolGeometry:
    """A pool of rows_per_page rows of D per page (rows_per_page even: a page is also a KV block
    of rows_per_page/2 tokens of one head of width D)."""
    assert rows_per_page % 2 == 0
    return PoolGeometry(num_pages=num_pages, row_width=d, rows_per_page=rows_per_page,
                        block_size=rows_per_page // 2, num_layers=num_layers, num_kv_heads=1, head_dim=d, dtype=dtype)


def poisoned_pool(geometry: PoolGeometry, device: torch.device = DEVICE) -> PagePool:
    pool = PagePool(geometry, device)
    pool.tensor.fill_(float("nan"))
    return pool


def random_lora_adapter(
    name: str,
    rng: random.Random,
    shapes: dict[int, tuple[int, int]],  # module index -> (in, out)
    layers: list[int],
    ranks: list[int],  # one rank per (layer, module), cycled
) -> LoraAdapter:
    gen = torch.Generator().manual_seed(rng.getrandbits(31))
    mods = []
    i = 0
    for layer in layers:
        for m, (in_f, out_f) in sorted(shapes.items()):
            r = ranks[i % len(ranks)]
            i += 1
            # Scaled so that the delta is O(scale) and stays far from float16's range at any rank.
            a = torch.randn(r, in_f, generator=gen) / math.sqrt(in_f)
            b = torch.randn(out_f, r, generator=gen) / math.sqrt(r)
            mods.append(LoraModuleWeights(layer, TARGET_MODULES[m], r, rng.uniform(0.25, 4.0), a, b))
    return LoraAdapter(name=name, modules=tuple(mods), max_rank=max(m.rank for m in mods))


def place(pool: PagePool, dealer: PageDealer, adapter: LoraAdapter) -> AdapterResidency:
    plan = plan_adapter(pool.geometry, adapter)
    return place_adapter(pool, adapter.name, plan, dealer.take(plan.num_pages))


def popularity_assignment(kind: str, n: int, num_adapters: int, rng: random.Random) -> list[int]:
    """Adapter index of each of n requests, as Punica's tests draw them."""
    if kind == "identical":
        return [0] * n
    if kind == "distinct":
        return [i % num_adapters for i in range(n)]
    if kind == "uniform":
        return [rng.randrange(num_adapters) for _ in range(n)]
    if kind == "zipf":
        weights = [1.0 / (i + 1) ** 1.5 for i in range(num_adapters)]
        return rng.choices(range(num_adapters), weights=weights, k=n)
    if kind == "skewed":  # one hot adapter, the rest rare
        return [0 if rng.random() < 0.8 else rng.randrange(num_adapters) for _ in range(n)]
    raise ValueError(kind)


def build_batch(
    residencies: list[AdapterResidency],
    req_lens: list[int],
    req_adapter: list[int | None],  # index into residencies, None = no adapter
    sort: bool,
    empty_segments: int,
    rng: random.Random,
) -> tuple[LoraBatch, list[int | None]]:
    """Requests laid out one after another (sorted by adapter as the runner does, or not), one
    segment per run of consecutive tokens of one adapter, plus some zero-length segments."""
    order = list(range(len(req_lens)))
    if sort:
        order.sort(key=lambda i: (req_adapter[i] is not None, req_adapter[i] if req_adapter[i] is not None else -1))
    segments: list[LoraSegment] = []
    token_adapter: list[int | None] = []
    for i in order:
        start = len(token_adapter)
        token_adapter.extend([req_adapter[i]] * req_lens[i])
        if req_adapter[i] is None or req_lens[i] == 0:
            continue
        res = residencies[req_adapter[i]]
        prev = segments[-1] if segments else None
        if sort and prev is not None and prev.adapter is res and prev.start + prev.length == start:
            segments[-1] = LoraSegment(prev.start, prev.length + req_lens[i], res)
        else:
            segments.append(LoraSegment(start, req_lens[i], res))
    for _ in range(empty_segments):
        segments.insert(rng.randrange(len(segments) + 1),
                        LoraSegment(rng.randrange(len(token_adapter) + 1), 0, rng.choice(residencies)))
    return LoraBatch(tuple(segments), len(token_adapter)), token_adapter


def lora_delta_ref(
    x: torch.Tensor,  # [T, in]
    token_adapter: list[int | None],
    adapters: list[LoraAdapter],
    layer: int,
    module: int,
    out_features: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # (shrink [T, MAX_TEST_RANK], delta [T, out]) in float64
    """scale * (x @ A^T) and its expansion @ B^T per token, from the host weights rounded to the
    pool dtype (what the pool holds), computed in float64 on the host."""
    mods = [{(m.layer, m.module): m for m in a.modules} for a in adapters]
    name = TARGET_MODULES[module]
    xs = x.double().cpu()
    shrink = torch.zeros(x.shape[0], MAX_TEST_RANK, dtype=torch.float64)
    delta = torch.zeros(x.shape[0], out_features, dtype=torch.float64)
    for t, ai in enumerate(token_adapter):
        if ai is None:
            continue
        m = mods[ai].get((layer, name))
        if m is None:
            continue
        a = m.a.to(dtype).double()
        b = m.b.to(dtype).double()
        s = (a @ xs[t]) * m.scale
        shrink[t, : m.rank] = s
        delta[t] = b @ s
    return shrink, delta


@dataclass(frozen=True)
class SgmvSpec:
    """One SGMV scenario, drawn by hypothesis; tensors are made from it with a seeded generator."""

    d: int  # pool row width
    rows_per_page: int
    in_features: int
    out_features: int
    layer: int  # of 2
    module: int  # TARGET_MODULES index under test
    ranks: tuple[int, ...]  # rank of the tested (layer, module) per adapter
    present: tuple[bool, ...]  # whether each adapter carries the tested module at all
    req_lens: tuple[int, ...]
    popularity: str
    no_adapter_share: float  # share of requests that use the base model only
    sort: bool  # group requests by adapter as the runner does (one segment per adapter)
    empty_segments: int
    seed: int

    @property
    def num_tokens(self) -> int:
        return sum(self.req_lens)


@st.composite
def sgmv_specs(draw, d_choices=(8, 16, 24), max_rank: int = 128, max_requests: int = 8, max_len: int = 24,
               rank_step: int = 1, rank_choices: tuple[int, ...] | None = None) -> SgmvSpec:
    """rank_step: ranks are multiples of it (the C++ kernel's blocked path takes multiples of 8);
    rank_choices: ranks drawn from these instead."""
    d = draw(st.sampled_from(d_choices))
    num_adapters = draw(st.integers(1, 6))
    mode = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    n = draw(st.integers(1, max_requests))
    if mode == "decode":
        lens = [1] * n
    elif mode == "prefill":
        lens = draw(st.lists(st.integers(2, max_len), min_size=n, max_size=n))
    else:
        lens = draw(st.lists(st.one_of(st.just(1), st.integers(2, max_len)), min_size=n, max_size=n))
    return SgmvSpec(
        d=d,
        rows_per_page=draw(st.integers(1, 8)) * 2,
        in_features=d * draw(st.sampled_from([1, 3, 5, 7, 9])),
        out_features=d * draw(st.sampled_from([1, 3, 5, 7, 9])),
        layer=draw(st.integers(0, 1)),
        module=draw(st.integers(0, len(TARGET_MODULES) - 1)),
        ranks=tuple(draw(st.lists(st.sampled_from(rank_choices) if rank_choices else
                                  st.integers(1, max_rank // rank_step).map(lambda r: r * rank_step),
                                  min_size=num_adapters, max_size=num_adapters))),
        present=tuple(draw(st.lists(st.booleans(), min_size=num_adapters, max_size=num_adapters))),
        req_lens=tuple(lens),
        popularity=draw(st.sampled_from(POPULARITY)),
        no_adapter_share=draw(st.sampled_from([0.0, 0.0, 0.25])),
        sort=draw(st.booleans()),
        empty_segments=draw(st.integers(0, 2)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@dataclass
class SgmvCase:
    lora: LoraBatch
    adapters: list[LoraAdapter]
    token_adapter: list[int | None]
    pool: PagePool
    x: torch.Tensor  # [T, in]
    y0: torch.Tensor  # [T, out]
    shrink_ref: torch.Tensor  # [T, MAX_TEST_RANK] float64
    delta_ref: torch.Tensor  # [T, out] float64


def build_sgmv_case(spec: SgmvSpec, dtype: torch.dtype, device: torch.device = DEVICE) -> SgmvCase:
    rng = random.Random(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    other = (spec.module + 1 + rng.randrange(len(TARGET_MODULES) - 1)) % len(TARGET_MODULES)
    adapters = []
    for i, (rank, present) in enumerate(zip(spec.ranks, spec.present)):
        # Another module beside the tested one moves its rows off the adapter's first row.
        shapes = {other: (spec.d * 3, spec.d * 5)}
        if present or i == 0:
            shapes[spec.module] = (spec.in_features, spec.out_features)
        ranks = [rank if m == spec.module else rng.randint(1, 40) for _ in (0, 1) for m in sorted(shapes)]
        adapters.append(random_lora_adapter(f"a{i}", rng, shapes, [0, 1], ranks))
    pages_needed = sum(-(-plan_adapter(_probe_geometry(spec, dtype), a).num_rows // spec.rows_per_page) for a in adapters)
    geometry = sgmv_geometry(spec.d, spec.rows_per_page, 2, pages_needed + 8, dtype)
    pool = poisoned_pool(geometry, device)
    dealer = PageDealer(geometry.num_pages, rng)
    residencies = [place(pool, dealer, a) for a in adapters]
    assignment: list[int | None] = list(popularity_assignment(spec.popularity, len(spec.req_lens), len(adapters), rng))
    for i in range(len(assignment)):
        if rng.random() < spec.no_adapter_share:
            assignment[i] = None
    lora, token_adapter = build_batch(residencies, list(spec.req_lens), assignment, spec.sort, spec.empty_segments, rng)
    T = lora.num_tokens
    x = torch.randn(T, spec.in_features, generator=gen).to(dtype).to(device)
    y0 = torch.randn(T, spec.out_features, generator=gen).to(dtype).to(device)
    shrink_ref, delta_ref = lora_delta_ref(x, token_adapter, adapters, spec.layer, spec.module, spec.out_features, dtype)
    return SgmvCase(lora, adapters, token_adapter, pool, x, y0, shrink_ref, delta_ref)


def _probe_geometry(spec: SgmvSpec, dtype: torch.dtype) -> PoolGeometry:
    return sgmv_geometry(spec.d, spec.rows_per_page, 2, 1, dtype)


def touched_tokens(case: SgmvCase, layer: int, module: int) -> torch.Tensor:
    """[T] bool: tokens whose adapter carries (layer, module); every other row of y must stay as it was."""
    name = TARGET_MODULES[module]
    out = torch.zeros(case.lora.num_tokens, dtype=torch.bool)
    for t, ai in enumerate(case.token_adapter):
        if ai is not None and any(m.layer == layer and m.module == name for m in case.adapters[ai].modules):
            out[t] = True
    return out
