"""Prefill LoRA inside the packed GEMM on the CPU (cpu_linear.linear_lora): the shrink of each chunk of rows
(cpu_lora_shrink.h) just before the GEMM's panels run over it, the expand in their epilogue, both reading the
adapters in place from the pool.

Why: a separate SGMV pass over a prefill chunk reads and writes every output row a second time, and
at 2048 tokens those rows no longer sit in L2 (qkv and gate/up of one layer are 9 and 25 MB). In the
epilogue the delta joins the accumulators before the one store, and the expand costs rank more steps
of the K loop (16 beside 576). The shrink of the modules that share an input (q, k, v; gate, up) is
one pass over it.

Which segments: those longer than cpu_sgmv.LONG_SEGMENT whose every rank the blocked shrink takes
(cpu_sgmv.long_ok); the rest of the batch (decode tokens, other ranks) stays with ops.apply_lora.
Which models: a pool row width D and module boundaries that are multiples of the GEMM's panel width
(a panel then lies in one module and its B^T columns in one pool row), `applies` below.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from . import cpu_linear, cpu_sgmv
from .cpu_build import load_extension
from .metadata import LoraBatch


@dataclass(frozen=True)
class FusedSplit:
    """One step's adapter segments, split between the GEMM epilogue and ops.apply_lora."""

    fused: LoraBatch | None  # long segments whose every rank the blocked kernels take
    rest: LoraBatch | None  # everything else (None: nothing)


@dataclass(frozen=True)
class ModuleColumns:
    """Which output columns of a fused projection (qkv, gate_up, ...) belong to which LoRA module."""

    modules: tuple[int, ...]  # TARGET_MODULES indices
    bounds: tuple[int, ...]  # module i owns columns [bounds[i], bounds[i + 1])


def applies(d: int, projections: tuple[ModuleColumns, ...]) -> bool:
    """Whether a model with pool rows of d elements and these projections can take the epilogue here."""
    if not (cpu_linear.available() and cpu_sgmv.available()):
        return False
    nr = cpu_linear.panel_width()
    return d % nr == 0 and all(b % nr == 0 for p in projections for b in p.bounds)


def split(lora: LoraBatch, d: int) -> FusedSplit:
    """The step's split; cached on the batch (every layer asks)."""
    hit = lora.plan_cache.get("cpu_fused_split")
    if hit is not None:
        return hit
    fused, rest = [], []
    for seg in lora.segments:
        (fused if seg.length > cpu_sgmv.LONG_SEGMENT and _blocked_ranks(seg.adapter, d) else rest).append(seg)
    if not fused:  # a decode step: the batch as it is, with the tables and plans it has built
        out = FusedSplit(None, lora)
    else:
        out = FusedSplit(LoraBatch(tuple(fused), lora.num_tokens),
                         LoraBatch(tuple(rest), lora.num_tokens) if rest else None)
    lora.plan_cache["cpu_fused_split"] = out
    return out


def _blocked_ranks(adapter, d: int) -> bool:
    """Whether every rank of a resident adapter is one the blocked kernels take; cached on its residency
    (it depends only on its modules), not asked of the kernel for each of its 210 slots every step."""
    key = ("cpu_blocked_ranks", d)
    hit = adapter.kernel_cache.get(key)
    if hit is None:
        hit = adapter.kernel_cache[key] = all(cpu_sgmv.long_ok(slot.rank, d) for slot in adapter.slots.values())
    return hit


def linear_lora(
    x: torch.Tensor,  # [T, in] float32
    w: cpu_linear.PackedWeight,
    b: torch.Tensor | None,  # [out]
    pool_rows: torch.Tensor,  # [R, D]
    fused: LoraBatch,  # FusedSplit.fused
    layer: int,
    cols: ModuleColumns,
    ext: ModuleType | None = None,
) -> torch.Tensor:  # [T, out] = x @ W^T + b + each fused segment's LoRA delta
    """The shrink and the GEMM with the expand in its epilogue, in one call of the kernel: where the batch has a
    chunk of rows per thread its threads split the rows, each shrinking its chunk just before its panels run over
    it; below that, the shrink over all rows, then the panels split (cpu_linear.cpp, run()).
    ext: the cpu_linear build to run (default: this checkout's; benchmarks pass an earlier one's, and a build from
    before the shrink moved inside gets it from cpu_sgmv.shrink first, as the engine then did)."""
    x = x if x.stride(1) == 1 else x.contiguous()
    ext = ext or load_extension("cpu_linear")
    if getattr(ext, "SHRINKS_INSIDE", False):
        s, s_cols = _scratch(x, fused, cols)
    else:
        s, s_cols = shrink(x, pool_rows, fused, layer, cols)
    t = fused.device_tensors
    return ext.linear_lora(x, w.panels, b, w.out_features, s, pool_rows, t.seg_start, t.seg_len, t.layout, t.scales,
                           t.pages, fused.segments[0].adapter.rows_per_page, layer, list(cols.modules),
                           list(cols.bounds), s_cols)


def _scratch(x: torch.Tensor, fused: LoraBatch, cols: ModuleColumns) -> tuple[torch.Tensor, list[int]]:
    """s [T, max_rank * modules] for the shrink's outputs, each module in a column band of max_rank (a segment of
    lower rank leaves its band's tail unread), and the bands' starts. Rows outside the segments: unread."""
    r = fused.max_rank
    return torch.empty(x.shape[0], r * len(cols.modules), dtype=x.dtype), [i * r for i in range(len(cols.modules))]


def shrink(
    x: torch.Tensor,  # [T, in] float32, rows contiguous
    pool_rows: torch.Tensor,  # [R, D]
    fused: LoraBatch,
    layer: int,
    cols: ModuleColumns,
    ext: ModuleType | None = None,
) -> tuple[torch.Tensor, list[int]]:  # s [T, max_rank * modules] = scale * x @ A^T per module; its band starts
    """The fused segments' x @ A^T for every module of the projection (one pass over x; the same sums as
    linear_lora's own shrink): for the benchmarks, which time it alone, and for cpu_linear builds from before the
    shrink moved inside. ext: the cpu_sgmv build to run (default: this checkout's; benchmarks pass an earlier
    one's)."""
    s, s_cols = _scratch(x, fused, cols)
    t = fused.device_tensors
    (ext or load_extension("cpu_sgmv")).shrink(s, x, pool_rows, t.seg_start, t.seg_len, t.layout, t.scales, t.pages,
                                               fused.segments[0].adapter.rows_per_page, layer, list(cols.modules),
                                               s_cols)
    return s, s_cols
