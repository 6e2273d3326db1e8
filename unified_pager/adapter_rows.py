"""An adapter as logical rows of D elements, on the host: which rows each matrix gets, and the copy.

For each (layer, module) present, in (layer, TARGET_MODULES) order: first A transposed
([in, rank], row-major: rank*in/D rows), then B transposed ([rank, out]: rank*out/D rows), back
to back. Both are stored as the right-hand operand of x @ A^T @ B^T, so that a kernel that reads
them in place sums whole weight rows scaled by an activation (torch's CPU path does exactly that
with embedding_bag, see kernels/torch_sgmv.py).
This depends only on the pool's RowLayout (D and dtype; layers and shapes are checked), never on
the page size: adapter_pages.py cuts the rows into pages, packed_rows.py packs them ahead of time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from loraplex.errors import AdapterError
from loraplex.lora.finite import first_nonfinite
from loraplex.lora.types import MODULE_INDEX, TARGET_MODULES, LoraModuleWeights

from .geometry import RowLayout


@dataclass(frozen=True)
class ModuleSlot:
    """Where one (layer, module) LoRA pair of a resident adapter lives, in logical rows."""

    layer: int
    module: int  # index into TARGET_MODULES
    rank: int
    scale: float
    a_row: int  # first logical row of A^T [in, rank]
    b_row: int  # first logical row of B^T [rank, out]
    in_features: int
    out_features: int


class RowAssignment(NamedTuple):
    """Logical rows of each (layer, module) of an adapter, and the per-slot tables the kernels read."""

    slots: dict[tuple[int, int], ModuleSlot]
    modules: Sequence[LoraModuleWeights]  # in packing order, aligned with slots' insertion order
    num_rows: int
    max_rank: int
    layout: np.ndarray  # [L, 7, 3] int32: rank (0 = absent), a_row, b_row
    scales: np.ndarray  # [L, 7] float32 (0 where absent)


def assign_rows(layout: RowLayout, name: str, modules: Sequence[LoraModuleWeights]) -> RowAssignment:
    """Check every module against the layout and give it logical rows (A, then B^T, back to back,
    in (layer, TARGET_MODULES) order); AdapterError naming the first module that does not fit."""
    d = layout.row_width
    ordered = sorted(modules, key=lambda m: (m.layer, MODULE_INDEX.get(m.module, len(TARGET_MODULES))))
    slots: dict[tuple[int, int], ModuleSlot] = {}
    table = np.zeros((layout.num_layers, len(TARGET_MODULES), 3), dtype=np.int32)  # [L, 7, 3]
    scales = np.zeros((layout.num_layers, len(TARGET_MODULES)), dtype=np.float32)  # [L, 7]
    row = 0
    for m in ordered:
        layout.check_module(m)
        key = (m.layer, MODULE_INDEX[m.module])
        if key in slots:
            raise AdapterError(f"adapter {name!r}: layer {m.layer} {m.module} appears twice")
        in_f, out_f = int(m.a.shape[1]), int(m.b.shape[0])
        a_rows, b_rows = m.rank * in_f // d, m.rank * out_f // d
        slots[key] = ModuleSlot(m.layer, key[1], m.rank, float(m.scale), row, row + a_rows, in_f, out_f)
        table[key] = (m.rank, row, row + a_rows)
        scales[key] = m.scale
        row += a_rows + b_rows
    max_rank = max((m.rank for m in ordered), default=0)
    return RowAssignment(slots, tuple(ordered), row, max_rank, table, scales)


def write_rows(modules: Sequence[LoraModuleWeights], row_width: int, out: torch.Tensor,
               check_finite: bool = False) -> int | None:
    """Write A^T [in, rank] then B^T [rank, out] of each module (in packing order) into out
    ([>= num_rows, D]) back to back, casting to out's dtype. With check_finite: the index, in
    [A_0, B_0, A_1, B_1, ...], of the first matrix whose written copy holds a NaN or an Inf (all
    are written regardless), else None; without it, None."""
    found = _write_rows_cpp(modules, out, check_finite)
    if found is not None:
        return found if found >= 0 else None
    row = 0
    spans = []  # [first row, end row) of each written matrix, for the check
    for m in modules:
        for w in (m.a, m.b):
            n = w.numel() // row_width
            _copy(out[row : row + n].view(w.shape[1], w.shape[0]), w, transpose=True)
            spans.append((row, row + n))
            row += n
    if not check_finite:
        return None
    return first_nonfinite([out[lo:hi] for lo, hi in spans])


# All exponent bits set (an Inf or a NaN) in each float format: the C++ packer's check.
_EXPONENT_MASK = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000,
                  torch.float64: 0x7FF0000000000000}


def _write_rows_cpp(modules: Sequence[LoraModuleWeights], out: torch.Tensor, check_finite: bool) -> int | None:
    """write_rows in one call of the C++ packer (kernels/cpu_pack.cpp), where it applies: a
    contiguous CPU output and sources of its dtype (no cast). None where it did nothing, else the
    packer's answer: the index of the first matrix holding a NaN or an Inf, or -1."""
    if out.device.type != "cpu" or not out.is_contiguous() or out.dtype not in _EXPONENT_MASK:
        return None
    srcs = [t for m in modules for t in (m.a, m.b)]
    if any(t.dtype != out.dtype or t.device.type != "cpu" for t in srcs):
        return None
    from loraplex.kernels.cpu_build import load_extension  # lazily: the pager never needs the kernels

    ext = load_extension("cpu_pack")
    if ext is None:
        return None
    sizes = torch.tensor([t.numel() for t in srcs], dtype=torch.int64)  # [2M]
    offsets = sizes.cumsum(0) - sizes  # [2M] first element of each matrix: back to back, as below
    return ext.transpose_into(srcs, out.view(-1), offsets, _EXPONENT_MASK[out.dtype] if check_finite else 0)


# numpy's transposing copy against torch's (dev CPU, float32, 1 thread): about 2x faster for
# A [rank, in] -> [in, rank] at every rank from 8 to 128 and for the tall, narrow B [out, rank] of
# ranks under 32, slower for B above. Only without a cast: numpy has no bfloat16 and its casts may
# warn where torch's do not (adapters arrive in the pool dtype anyway).
_NUMPY_FLOATS = (torch.float16, torch.float32, torch.float64)
_NUMPY_MAX_RANK_TALL = 31


def _copy(dst: torch.Tensor, src: torch.Tensor, transpose: bool) -> None:
    """dst <- src, transposed when asked (A [rank, in] -> [in, rank], B [out, rank] -> [rank, out]);
    cast to dst's dtype; both on the host."""
    tall_and_wide = src.shape[0] > src.shape[1] > _NUMPY_MAX_RANK_TALL
    if (src.dtype == dst.dtype and dst.dtype in _NUMPY_FLOATS and src.device.type == dst.device.type == "cpu"
            and not (transpose and tall_and_wide)):
        s = src.detach().numpy()
        np.copyto(dst.numpy(), s.T if transpose else s)
    else:
        dst.copy_(src.t() if transpose else src)
