"""Adapter weights as rows in pool pages: the packing plan, the write, and the residency record.

An adapter's matrices are packed back to back in logical rows of D elements: for each
(layer, module) present, in (layer, TARGET_MODULES) order, first A ([rank, in], row-major:
rank*in/D rows) then B transposed ([rank, out]: rank*out/D rows). Logical row L lives at physical
row ``pages[L // rows_per_page] * rows_per_page + L % rows_per_page`` of ``pool.rows()``.
So an adapter of rank r takes pages in proportion to r, wasting less than one page in all.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from loraplex.errors import AdapterError
from loraplex.lora.types import MODULE_INDEX, TARGET_MODULES, LoraAdapter, LoraModuleWeights

from .geometry import PoolGeometry
from .pool import PagePool


@dataclass(frozen=True)
class ModuleSlot:
    """Where one (layer, module) LoRA pair of a resident adapter lives, in logical rows."""

    layer: int
    module: int  # index into TARGET_MODULES
    rank: int
    scale: float
    a_row: int  # first logical row of A [rank, in]
    b_row: int  # first logical row of B^T [rank, out]
    in_features: int
    out_features: int


@dataclass(frozen=True)
class AdapterPlan:
    """Everything about an adapter's placement that does not depend on which pages it gets."""

    slots: dict[tuple[int, int], ModuleSlot]
    modules: tuple[LoraModuleWeights, ...]  # in packing order, aligned with slots' insertion order
    num_rows: int
    num_pages: int
    max_rank: int


def plan_adapter(geometry: PoolGeometry, adapter: LoraAdapter) -> AdapterPlan:
    """Validate the adapter against the geometry and assign logical rows; touches no device memory."""
    d = geometry.row_width
    ordered = sorted(adapter.modules, key=lambda m: (m.layer, MODULE_INDEX.get(m.module, len(TARGET_MODULES))))
    slots: dict[tuple[int, int], ModuleSlot] = {}
    row = 0
    for m in ordered:
        geometry.check_module(m)
        key = (m.layer, MODULE_INDEX[m.module])
        if key in slots:
            raise AdapterError(f"adapter {adapter.name!r}: layer {m.layer} {m.module} appears twice")
        in_f, out_f = int(m.a.shape[1]), int(m.b.shape[0])
        a_rows, b_rows = m.rank * in_f // d, m.rank * out_f // d
        slots[key] = ModuleSlot(m.layer, key[1], m.rank, float(m.scale), row, row + a_rows, in_f, out_f)
        row += a_rows + b_rows
    num_pages = -(-row // geometry.rows_per_page)
    max_rank = max((m.rank for m in ordered), default=0)
    return AdapterPlan(slots, tuple(ordered), row, num_pages, max_rank)


def logical_to_physical(pages: np.ndarray, rows_per_page: int, start: int, count: int) -> np.ndarray:
    """[count] int64 physical rows of logical rows start..start+count (pages: [P] int64)."""
    logical = np.arange(start, start + count, dtype=np.int64)
    return pages[logical // rows_per_page] * rows_per_page + logical % rows_per_page


@dataclass(frozen=True, eq=False)  # eq=False: identity semantics; tensors have no boolean ==
class AdapterResidency:
    """A resident adapter: its pages, per-slot rows, and the index tensors the kernels gather with.

    All tensors live on the pool's device and are read-only by convention (they are shared by
    every step that uses the adapter).
    """

    key: Hashable
    pages: torch.Tensor  # [P] int64, page ids in logical order
    slots: dict[tuple[int, int], ModuleSlot]  # keyed (layer, module index)
    layout: torch.Tensor  # [L, 7, 3] int32: rank (0 = absent), a_row, b_row (logical)
    scales: torch.Tensor  # [L, 7] float32 (0 where absent)
    max_rank: int
    num_rows: int
    nbytes: int  # pool bytes held: pages * page bytes
    rows_per_page: int
    row_index: torch.Tensor = field(repr=False)  # [num_rows] int64, physical row of each logical row
    # Per-slot views into row_index, built once at placement: the torch kernels gather through
    # these for every token batch, so they must cost a dict lookup, not a computation.
    _a_index: dict[tuple[int, int], torch.Tensor] = field(repr=False, default_factory=dict)
    _b_index: dict[tuple[int, int], torch.Tensor] = field(repr=False, default_factory=dict)

    @property
    def num_pages(self) -> int:
        return int(self.pages.shape[0])

    def physical_rows(self, logical_start: int, count: int) -> torch.Tensor:
        """[count] int64 physical rows of pool.rows() for logical rows logical_start.. (a view)."""
        if logical_start < 0 or count < 0 or logical_start + count > self.num_rows:
            raise IndexError(f"logical rows {logical_start}..{logical_start + count} outside 0..{self.num_rows}")
        return self.row_index[logical_start : logical_start + count]

    def a_index(self, layer: int, module: int) -> torch.Tensor:
        """[rank*in/D] int64 physical rows of A [rank, in] of (layer, module)."""
        return self._a_index[(layer, module)]

    def b_index(self, layer: int, module: int) -> torch.Tensor:
        """[rank*out/D] int64 physical rows of B^T [rank, out] of (layer, module)."""
        return self._b_index[(layer, module)]


def pack_rows(plan: AdapterPlan, geometry: PoolGeometry, out: torch.Tensor | None = None) -> torch.Tensor:
    """[num_rows, D] host tensor in the pool dtype: A then B^T of each slot, back to back.

    With `out` ([>= num_rows, D]), the rows are written there instead: one pass over the weights,
    no concatenation afterwards."""
    d, dtype = geometry.row_width, geometry.dtype
    if out is None:
        out = torch.empty(plan.num_rows, d, dtype=dtype)
    row = 0
    for m in plan.modules:
        for mat in (m.a, m.b.t()):  # A [rank, in]; B^T [rank, out]
            n = mat.numel() // d
            out[row : row + n].view(mat.shape).copy_(mat)  # casts to the pool dtype while copying
            row += n
    return out


def place_adapter(pool: PagePool, key: Hashable, plan: AdapterPlan, pages: np.ndarray) -> AdapterResidency:
    """Write the adapter's rows into its pages (pages: [plan.num_pages] int64) and build the record."""
    g = pool.geometry
    device = pool.device
    rpp = g.rows_per_page
    row_index_np = logical_to_physical(pages, rpp, 0, plan.num_rows)  # [num_rows] int64
    row_index = torch.from_numpy(row_index_np).to(device)
    if plan.num_rows:
        # Pack into whole pages, then scatter page by page: a few hundred large copies instead of
        # one indexed copy per D-element row (the pool is [num_pages, page_elems]).
        packed = torch.empty(len(pages) * rpp, g.row_width, dtype=g.dtype)  # [P * rows_per_page, D]
        pack_rows(plan, g, packed)
        # The unused tail of the last page must not carry garbage: the page later serves as a KV
        # block whose unwritten slots attention reads (masked, but NaN * 0 is NaN).
        packed[plan.num_rows :].zero_()
        page_ids = torch.from_numpy(pages).to(device)
        pool.tensor.index_copy_(0, page_ids, packed.view(len(pages), -1).to(device))

    layout = torch.zeros(g.num_layers, len(TARGET_MODULES), 3, dtype=torch.int32)  # [L, 7, 3]
    scales = torch.zeros(g.num_layers, len(TARGET_MODULES), dtype=torch.float32)  # [L, 7]
    a_index: dict[tuple[int, int], torch.Tensor] = {}
    b_index: dict[tuple[int, int], torch.Tensor] = {}
    d = g.row_width
    layout_np = layout.numpy()  # filled through numpy: one small torch op per slot costs more than the copy
    scales_np = scales.numpy()
    for (layer, module), s in plan.slots.items():
        layout_np[layer, module] = (s.rank, s.a_row, s.b_row)
        scales_np[layer, module] = s.scale
        a_index[(layer, module)] = row_index[s.a_row : s.a_row + s.rank * s.in_features // d]
        b_index[(layer, module)] = row_index[s.b_row : s.b_row + s.rank * s.out_features // d]
    return AdapterResidency(
        key=key,
        pages=torch.from_numpy(pages.copy()).to(device),
        slots=dict(plan.slots),
        layout=layout.to(device),
        scales=scales.to(device),
        max_rank=plan.max_rank,
        num_rows=plan.num_rows,
        nbytes=len(pages) * g.page_bytes,
        rows_per_page=rpp,
        row_index=row_index,
        _a_index=a_index,
        _b_index=b_index,
    )
