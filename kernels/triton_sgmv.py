"""SGMV on the Triton path: the same four entry points as torch_sgmv, same semantics.

For each segment s of tokens sharing adapter a:  y[seg] += scale_a * (x[seg] @ A_a^T) @ B_a^T,
A_a and B_a^T read in place from the pool (see triton_sgmv_kernels.py for the addressing).

Per step, the host cuts the batch into tiles once (cached on the LoraBatch): one-token runs go to
the decode variant (BLOCK_M = 1), longer segments to tl.dot tiles of BLOCK_M tokens. Per
(layer, module) call there is no host work beyond a dict lookup and the launches: shrink writes
float32 partial sums [SPLIT, T, SR] (SPLIT > 1 splits the K loop when there are too few tiles to
fill the GPU, e.g. a decode batch of a few adapters), expand adds the partials while it loads
them, so no reduction launch and no atomics are needed.

apply_lora_group does the same for up to three modules that share x and write adjacent columns of
one fused output (the model's q | k | v and gate | up) in one shrink and one expand launch: at decode
the launches, not the bytes, cost the time. A single module is the group of one.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .metadata import LoraBatch
from .triton_launch import dot_precision, parallel_slots, pow2_divisor
from .triton_sgmv_kernels import sgmv_expand_kernel, sgmv_shrink_kernel

if TYPE_CHECKING:
    from loraplex.unified_pager import AdapterResidency

R_CHUNK = 16  # ranks per program (shrink) / per loop step (expand); >= 16 for tl.dot
DEFAULT_BLOCK_M = 32
# Widest chunk of one pool row a program loads per step (the chunk must stay inside one row of D).
MAX_BLOCK_K = 128
MAX_BLOCK_N = 128
MAX_GROUP = 3  # modules per grouped launch: the expand kernel takes two interior column bounds


@dataclass(frozen=True)
class TileTable:
    """Tiles of one variant: tile i covers tokens start[i] .. start[i] + length[i] of segment seg[i]."""

    tiles: torch.Tensor  # [3, NT] int32 on the device: seg (-1 = no adapter), start, length
    num_tiles: int
    block_m: int

    @property
    def seg(self) -> torch.Tensor:
        return self.tiles[0]

    @property
    def start(self) -> torch.Tensor:
        return self.tiles[1]

    @property
    def length(self) -> torch.Tensor:
        return self.tiles[2]


@dataclass(frozen=True)
class SgmvTiles:
    """The batch cut into tiles, once per step: decode tiles and BLOCK_M tiles."""

    single: TileTable | None  # one-token runs (decode variant)
    multi: TileTable | None  # runs of several tokens, cut into tiles of block_m tokens

    @property
    def tables(self) -> tuple[TileTable, ...]:
        return tuple(t for t in (self.single, self.multi) if t is not None)

    @property
    def num_tiles(self) -> int:
        return sum(t.num_tiles for t in self.tables)


def build_tiles(lora: LoraBatch, block_m: int, device: torch.device) -> SgmvTiles:
    """Cut tokens 0..num_tokens into runs (each segment, and each gap between segments) and the
    runs into tiles; empty segments take no tile."""
    runs: list[tuple[int, int, int]] = []  # (seg, start, length)
    pos = 0
    for i, seg in sorted(enumerate(lora.segments), key=lambda p: p[1].start):
        if seg.length == 0:
            continue
        if seg.start > pos:
            runs.append((-1, pos, seg.start - pos))
        runs.append((i, seg.start, seg.length))
        pos = seg.start + seg.length
    if lora.num_tokens > pos:
        runs.append((-1, pos, lora.num_tokens - pos))
    single: list[tuple[int, int, int]] = []
    multi: list[tuple[int, int, int]] = []
    for seg, start, length in runs:
        if length == 1:
            single.append((seg, start, 1))
            continue
        for t in range(start, start + length, block_m):
            multi.append((seg, t, min(block_m, start + length - t)))

    def table(rows: list[tuple[int, int, int]], bm: int) -> TileTable | None:
        if not rows:
            return None
        t = torch.tensor(rows, dtype=torch.int32).t().contiguous().to(device)
        return TileTable(t, len(rows), bm)

    return SgmvTiles(table(single, 1), table(multi, block_m))


def _tiles(lora: LoraBatch, block_m: int, device: torch.device) -> SgmvTiles:
    key = ("triton_tiles", block_m)
    cached = lora.plan_cache.get(key)
    if cached is None:
        cached = lora.plan_cache[key] = build_tiles(lora, block_m, device)
    return cached


# Each resident adapter's ranks as a host array [L, 7] (0 = absent), built once per adapter: the
# per-step maximum over a batch's adapters is then one numpy reduction, not a walk over every
# (segment, layer, module) in Python (57k dict lookups for 256 adapters on a 32-layer model).
_RANK_TABLES: weakref.WeakKeyDictionary[AdapterResidency, np.ndarray] = weakref.WeakKeyDictionary()


def _rank_table(res: AdapterResidency, shape: tuple[int, int]) -> np.ndarray:
    table = _RANK_TABLES.get(res)
    if table is None:
        table = np.zeros(shape, dtype=np.int32)
        for (layer, module), slot in res.slots.items():
            table[layer, module] = slot.rank
        _RANK_TABLES[res] = table
    return table


def _module_rank(lora: LoraBatch, layer: int, module: int) -> int:
    """Largest rank among the segments carrying (layer, module); 0 when none does."""
    ranks = lora.plan_cache.get("triton_module_ranks")
    if ranks is None:
        segs = [s for s in lora.segments if s.length > 0]
        if segs:
            shape = tuple(segs[0].adapter.layout.shape[:2])
            unique = {id(s.adapter): s.adapter for s in segs}.values()
            ranks = np.maximum.reduce([_rank_table(a, shape) for a in unique])
        else:
            ranks = np.zeros((0, 0), dtype=np.int32)
        lora.plan_cache["triton_module_ranks"] = ranks
    if layer >= ranks.shape[0]:
        return 0
    return int(ranks[layer, module])


def _group_rank(lora: LoraBatch, layer: int, modules: Sequence[int]) -> int:
    """Largest rank among the segments carrying any of the modules at this layer; 0 when none does."""
    return max(_module_rank(lora, layer, m) for m in modules)


def _choose_split(device: torch.device, programs: int, k_chunks: int) -> int:
    """Split the K loop until the launch has about enough programs to fill the device."""
    slots = parallel_slots(device)
    split = 1
    while programs * split < slots and split * 2 <= k_chunks // 2:
        split *= 2
    return split


@dataclass(frozen=True)
class SegmentTables:
    """The segment table's device tensors with the strides and offsets the kernels index them by."""

    layout: torch.Tensor  # [S, L, 7, 3] int32, unit last stride
    scales: torch.Tensor  # [S, L, 7] float32
    pages: torch.Tensor  # [S, P] int32
    rows_per_page: int

    @staticmethod
    def of(lora: LoraBatch) -> SegmentTables:
        key = "triton_segment_tables"
        cached = lora.plan_cache.get(key)
        if cached is None:
            dev = lora.device_tensors
            assert dev.layout.stride(3) == 1, "the kernels read rank, a_row, b_row as consecutive int32s"
            cached = lora.plan_cache[key] = SegmentTables(
                dev.layout, dev.scales, dev.pages, int(lora.segments[0].adapter.rows_per_page))
        return cached

    def layout_offset(self, layer: int, module: int) -> int:
        return layer * self.layout.stride(1) + module * self.layout.stride(2)

    def scale_offset(self, layer: int, module: int) -> int:
        return layer * self.scales.stride(1) + module * self.scales.stride(2)


def groupable(modules: Sequence[int], bounds: Sequence[int], d: int) -> bool:
    """Whether one launch can serve these modules: 1 to MAX_GROUP modules, consecutive in TARGET_MODULES
    (module g's table entries are the first one's plus g strides), each owning a multiple of D columns
    (so no BLOCK_N block, BLOCK_N dividing D, straddles two modules)."""
    assert len(bounds) == len(modules) + 1 and bounds[0] == 0, (modules, bounds)
    return (1 <= len(modules) <= MAX_GROUP
            and all(m == modules[0] + g for g, m in enumerate(modules))
            and all((hi - lo) % d == 0 and hi > lo for lo, hi in zip(bounds, bounds[1:])))


# A launch with everything bound but what changes from layer to layer: shrink (x, layout offset, scale
# offset), expand (y, layout offset). Built once per step by _GroupPlan, or per call by the entry points below.
ShrinkLaunch = Callable[[torch.Tensor, int, int], None]
ExpandLaunch = Callable[[torch.Tensor, int], None]


def _shrink_launches(partial: torch.Tensor, pool_rows: torch.Tensor, lora: LoraBatch, modules: Sequence[int],
                     K: int, dtype: torch.dtype, block_m: int) -> list[ShrinkLaunch]:
    """One launch per tile table of sgmv_shrink_kernel into partial [split, T, G * SR] (x is [T, K])."""
    split, _, width = partial.shape
    G = len(modules)
    rc_per_mod = width // G // R_CHUNK
    D = pool_rows.shape[1]
    block_k = pow2_divisor(D, MAX_BLOCK_K)
    seg = SegmentTables.of(lora)
    launches = []
    for table in _tiles(lora, block_m, partial.device).tables:
        kernel = sgmv_shrink_kernel.on(partial.device)[(table.num_tiles, split, G * rc_per_mod)]
        # The kernel's arguments in order, around the per-call ones: (x, x stride) + head + offsets + tail.
        head = (pool_rows, partial, partial.stride(0), partial.stride(1), table.seg, table.start, table.length,
                seg.layout, seg.layout.stride(0), seg.scales, seg.scales.stride(0), seg.pages, seg.pages.stride(0))
        tail = (seg.layout.stride(2), seg.scales.stride(2), rc_per_mod, seg.rows_per_page, K, -(-(K // block_k) // split))
        consts = dict(D=D, BLOCK_M=table.block_m, BLOCK_K=block_k, R_CHUNK=R_CHUNK, USE_DOT=block_k >= 16,
                      DOT_PREC=dot_precision(dtype))
        launches.append(lambda x, lay_off, sc_off, kernel=kernel, head=head, tail=tail, consts=consts: kernel(
            x, x.stride(0), *head, lay_off, sc_off, *tail, **consts))
    return launches


def _expand_launches(s: torch.Tensor, pool_rows: torch.Tensor, lora: LoraBatch, modules: Sequence[int],
                     bounds: Sequence[int], dtype: torch.dtype, block_m: int) -> list[ExpandLaunch]:
    """One launch per tile table of sgmv_expand_kernel from s [split, T, G * SR] into y [T, bounds[-1]]."""
    G, D, N = len(modules), pool_rows.shape[1], bounds[-1]
    block_n = pow2_divisor(D, MAX_BLOCK_N)  # divides D, and D each module's width: a block lies in one module
    b1, b2 = (list(bounds[1:-1]) + [N, N])[:2]
    seg = SegmentTables.of(lora)
    launches = []
    for table in _tiles(lora, block_m, s.device).tables:
        kernel = sgmv_expand_kernel.on(s.device)[(table.num_tiles, N // block_n)]
        # The kernel's arguments in order, around the per-call ones: partials + (y, y stride) + head + offset + tail.
        s_args = (s, s.stride(0), s.stride(1), s.shape[2] // G, s.shape[0])
        head = (pool_rows, table.seg, table.start, table.length, seg.layout, seg.layout.stride(0), seg.pages,
                seg.pages.stride(0))
        tail = (seg.layout.stride(2), seg.rows_per_page, b1, b2, N)
        consts = dict(D=D, BLOCK_M=table.block_m, BLOCK_N=block_n, R_CHUNK=R_CHUNK, USE_DOT=block_n >= 16,
                      DOT_PREC=dot_precision(dtype))
        launches.append(lambda y, lay_off, kernel=kernel, s_args=s_args, head=head, tail=tail, consts=consts: kernel(
            *s_args, y, y.stride(0), *head, lay_off, *tail, **consts))
    return launches


def sgmv_shrink_group_into(
    partial: torch.Tensor,  # [split, T, G * SR] float32, SR a multiple of R_CHUNK; every element written
    x: torch.Tensor,  # [T, K], unit column stride
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    modules: Sequence[int],  # G consecutive module indices (see groupable)
    block_m: int = DEFAULT_BLOCK_M,
) -> None:
    """partial[s, t, g*SR + r] = scale * sum over split s's share of K of x[t, k] * A_g[r, k] (0 past the rank)."""
    G = len(modules)
    assert x.stride(1) == 1 and pool_rows.is_contiguous() and partial.stride(2) == 1
    assert partial.shape[2] % (G * R_CHUNK) == 0 and partial.shape[1] == lora.num_tokens
    assert all(m == modules[0] + g for g, m in enumerate(modules)) and G <= MAX_GROUP, modules
    if not lora.segments:  # no adapter at all: zeros, and no segment table for the kernel to index
        partial.zero_()
        return
    seg = SegmentTables.of(lora)
    for launch in _shrink_launches(partial, pool_rows, lora, modules, x.shape[1], x.dtype, block_m):
        launch(x, seg.layout_offset(layer, modules[0]), seg.scale_offset(layer, modules[0]))


def sgmv_shrink_into(
    partial: torch.Tensor,  # [split, T, SR] float32, SR a multiple of R_CHUNK; every element written
    x: torch.Tensor,  # [T, K], unit column stride
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
    block_m: int = DEFAULT_BLOCK_M,
) -> None:
    """partial[s, t, r] = scale * sum over split s's share of K of x[t, k] * A[r, k] (0 past the rank)."""
    sgmv_shrink_group_into(partial, x, pool_rows, lora, layer, (module,), block_m)


def sgmv_expand_group_from(
    y: torch.Tensor,  # [T, bounds[-1]], unit column stride, updated in place
    s: torch.Tensor,  # [split, T, G * SR] partials (summed while loaded), module g at columns g * SR
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    modules: Sequence[int],  # G modules, groupable with bounds
    bounds: Sequence[int],  # module g owns columns bounds[g] .. bounds[g + 1] of y
    block_m: int = DEFAULT_BLOCK_M,
) -> None:
    """y[t, cols of g] += sum_r (sum_s s[s, t, g*SR + r]) * B_g^T[r] for every token t in a segment carrying
    (layer, modules[g]); the columns of a module the token's adapter lacks are untouched."""
    assert y.stride(1) == 1 and s.stride(2) == 1 and pool_rows.is_contiguous()
    D = pool_rows.shape[1]
    assert y.shape[1] == bounds[-1] and groupable(modules, bounds, D), (modules, bounds, D)
    if not lora.segments:  # no adapter at all: y unchanged
        return
    seg = SegmentTables.of(lora)
    for launch in _expand_launches(s, pool_rows, lora, modules, bounds, y.dtype, block_m):
        launch(y, seg.layout_offset(layer, modules[0]))


def sgmv_expand_from(
    y: torch.Tensor,  # [T, N], unit column stride, updated in place
    s: torch.Tensor,  # [split, T, >= rank] partials (summed while loaded)
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
    block_m: int = DEFAULT_BLOCK_M,
) -> None:
    """y[t] += sum_r (sum_s s[s, t, r]) * B^T[r] for every token t in a segment carrying (layer, module)."""
    sgmv_expand_group_from(y, s, pool_rows, lora, layer, (module,), (0, y.shape[1]), block_m)


def _split_for(lora: LoraBatch, pool_rows: torch.Tensor, K: int, programs_per_tile: int, device: torch.device) -> int:
    k_chunks = K // pow2_divisor(pool_rows.shape[1], MAX_BLOCK_K)
    return _choose_split(device, _tiles(lora, DEFAULT_BLOCK_M, device).num_tiles * programs_per_tile, k_chunks)


def lora_shrink(
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> torch.Tensor:  # [T, max_rank]; scale applied; columns beyond a segment's rank stay 0
    width = max(lora.max_rank, 1)
    out = torch.zeros(x.shape[0], width, dtype=x.dtype, device=x.device)
    rank = _module_rank(lora, layer, module)
    if rank == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    sr = -(-rank // R_CHUNK) * R_CHUNK
    split = _split_for(lora, pool_rows, x.shape[1], sr // R_CHUNK, x.device)
    partial = torch.empty(split, x.shape[0], sr, dtype=torch.float32, device=x.device)
    sgmv_shrink_into(partial, x, pool_rows, lora, layer, module)
    out[:, :rank] = partial.sum(0)[:, :rank].to(x.dtype)
    return out


def lora_expand(
    y: torch.Tensor,  # [T, out], updated in place (may be a column slice of a fused output)
    s: torch.Tensor,  # [T, max_rank] from lora_shrink
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> None:
    if _module_rank(lora, layer, module) == 0:
        return
    s = s if s.stride(1) == 1 else s.contiguous()
    _update(y, lambda t: sgmv_expand_from(t, s.unsqueeze(0), pool_rows, lora, layer, module))


def _update(y: torch.Tensor, update: Callable[[torch.Tensor], None]) -> None:
    """update(y) where y has unit column stride, as the kernels need; for a rare caller's layout, update a
    contiguous copy and write it back."""
    if y.stride(1) == 1:
        update(y)
        return
    tmp = y.contiguous()
    update(tmp)
    y.copy_(tmp)


def apply_lora(
    y: torch.Tensor,  # [T, out]
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
    *,
    split: int | None = None,  # K-split of the shrink (None: enough programs to fill the device)
) -> None:
    """y += each token's adapter delta for (layer, module); tokens without one are untouched.

    Shrink into float32 partials, then expand from them: the rank-sized intermediate is never
    rounded to the activation dtype on the decode variant (the tl.dot tiles round it, as torch does).
    The group of one module (apply_lora_group).
    """
    apply_lora_group(y, x, pool_rows, lora, layer, (module,), (0, y.shape[1]), split=split)


def apply_lora_group(
    y: torch.Tensor,  # [T, bounds[-1]], updated in place (may be a column slice of a wider output)
    x: torch.Tensor,  # [T, in], the input every module of the group shares
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    modules: Sequence[int],  # consecutive TARGET_MODULES indices, e.g. (0, 1, 2) for q/k/v
    bounds: Sequence[int],  # module g owns columns bounds[g] .. bounds[g + 1] of y; bounds[0] == 0
    *,
    split: int | None = None,  # K-split of the shrink (None: enough programs to fill the device)
) -> None:
    """apply_lora for each module on its columns of y, in one shrink and one expand launch.

    The partials are [split, T, G * SR] with SR the group's largest rank (rounded up to R_CHUNK): a
    module of lower rank leaves the tail of its band zero. Modules a launch cannot group (not
    consecutive, more than MAX_GROUP) go one by one through apply_lora.
    """
    modules, bounds = tuple(modules), tuple(bounds)
    assert y.shape[1] == bounds[-1], (tuple(y.shape), bounds)
    rank = _group_rank(lora, layer, modules)
    if rank == 0:
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    plan = _group_plan(lora, pool_rows, x, modules, bounds, rank, split)
    if plan is not None:
        _update(y, lambda t: plan.launch(t, x, layer))
        return
    # One module is always a group where its width is a multiple of D, as every projection's is.
    assert len(modules) > 1, f"module {modules} of width {bounds[-1]} is not a multiple of D"
    for m, lo, hi in zip(modules, bounds, bounds[1:]):
        apply_lora(y[:, lo:hi], x, pool_rows, lora, layer, m, split=split)


class _GroupPlan:
    """apply_lora_group's launches for one step and one group shape, built at the step's first layer and
    reused by the others: on a GPU a call's host work is all the time it costs (the H200 run: 35-65 us per
    launch eager against ~6 us replayed), and everything but the layer's offsets and the activations is
    the same at every layer. The float32 partials are one buffer for the step: each call's expand reads
    it before the next call's shrink writes it, in stream order."""

    def __init__(self, lora: LoraBatch, pool_rows: torch.Tensor, x: torch.Tensor, modules: tuple[int, ...],
                 bounds: tuple[int, ...], sr: int, split: int):
        self.seg = SegmentTables.of(lora)
        self.m0 = modules[0]
        partial = torch.empty(split, x.shape[0], len(modules) * sr, dtype=torch.float32, device=x.device)
        self.shrinks = _shrink_launches(partial, pool_rows, lora, modules, x.shape[1], x.dtype, DEFAULT_BLOCK_M)
        self.expands = _expand_launches(partial, pool_rows, lora, modules, bounds, x.dtype, DEFAULT_BLOCK_M)

    def launch(self, y: torch.Tensor, x: torch.Tensor, layer: int) -> None:  # y [T, N] += ..., x [T, K]
        self.shrink(x, layer)
        self.expand(y, layer)

    def shrink(self, x: torch.Tensor, layer: int) -> None:  # x [T, K] -> the step's partials
        lay_off, sc_off = self.seg.layout_offset(layer, self.m0), self.seg.scale_offset(layer, self.m0)
        for shrink in self.shrinks:
            shrink(x, lay_off, sc_off)

    def expand(self, y: torch.Tensor, layer: int) -> None:  # y [T, N] += the partials through B
        lay_off = self.seg.layout_offset(layer, self.m0)
        for expand in self.expands:
            expand(y, lay_off)


def _group_plan(lora: LoraBatch, pool_rows: torch.Tensor, x: torch.Tensor, modules: tuple[int, ...],
                bounds: tuple[int, ...], rank: int, split: int | None) -> _GroupPlan | None:
    """The step's cached plan for this group shape; None where one launch cannot serve the group."""
    sr = -(-rank // R_CHUNK) * R_CHUNK
    key = ("triton_group_plan", modules, bounds, x.shape[1], x.dtype, sr, split, pool_rows.data_ptr())
    plan = lora.plan_cache.get(key)
    if plan is None:
        if not groupable(modules, bounds, pool_rows.shape[1]):
            return None
        if split is None:
            split = _split_for(lora, pool_rows, x.shape[1], len(modules) * (sr // R_CHUNK), x.device)
        plan = lora.plan_cache[key] = _GroupPlan(lora, pool_rows, x, modules, bounds, sr, split)
    return plan
