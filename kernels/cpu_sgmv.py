"""SGMV on the CPU through the C++ kernel (cpu_sgmv.cpp): one call per (layer, module) for all segments.

Same contract as torch_sgmv.apply_lora. It reads the segment table LoraBatch.device_tensors (built
once per batch, shared with the Triton path) and the pool in place. Where the kernel does not apply
(no compiler on the machine, a dtype other than float32, ranks above its 256) it hands the call to
the torch path, so callers never need to know which one ran.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from . import torch_sgmv
from .cpu_build import load_extension
from .metadata import LoraBatch, LoraSegment

MAX_RANK = 256  # cpu_sgmv.cpp's per-token accumulator
# Segments of more tokens than this (prefill chunks) take the kernel's register-blocked path (blocks of
# 12 tokens over A^T, then over B^T) where their rank is a multiple of 8 and the pool row width one of
# the vector width (cpu_sgmv.long_ok), else BLAS GEMMs, one pair per segment. Measured on the dev CPU
# (2 threads, 16 segments of 128 tokens, rank 16, SmolLM2's 7 modules of one layer): 6.6 ms blocked,
# 9.0 ms through the token-block loops, 10.4 ms through the GEMM pairs.
LONG_SEGMENT = 16


def available() -> bool:
    return load_extension("cpu_sgmv") is not None


def long_ok(rank: int, d: int) -> bool:
    """Whether the kernel multiplies a long segment of this rank itself (pool rows of d elements)."""
    ext = load_extension("cpu_sgmv")
    return ext is not None and ext.long_ok(rank, d)


def apply_lora(
    y: torch.Tensor,  # [T, out], updated in place (may be a column slice of a fused output)
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> None:
    """y += each token's adapter delta for (layer, module); tokens without one are untouched (the torch
    path's signature: the dispatcher swaps one for the other)."""
    apply_lora_with(None, y, x, pool_rows, lora, layer, module)


def apply_lora_with(ext: ModuleType | None, y: torch.Tensor, x: torch.Tensor, pool_rows: torch.Tensor,
                    lora: LoraBatch, layer: int, module: int) -> None:
    """apply_lora through build ext of the kernel (None: this checkout's; tests and benchmarks pass other
    builds of it)."""
    ext = ext or load_extension("cpu_sgmv")
    if not _kernel_takes(ext, y, lora):
        torch_sgmv.apply_lora(y, x, pool_rows, lora, layer, module)
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    ext.apply_lora(y, x, pool_rows, *_tables(lora), layer, module, LONG_SEGMENT)
    long = _long_segments(lora, layer, module, pool_rows.shape[1], ext) if _any_long(lora) else ()
    if long:
        torch_sgmv.apply_segments(y, x, pool_rows, long, layer, module)


def apply_lora_group(
    y: torch.Tensor,  # [T, bounds[-1]], updated in place
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    modules: Sequence[int],
    bounds: Sequence[int],  # module g owns columns bounds[g] .. bounds[g + 1] of y
    ext: ModuleType | None = None,
) -> None:
    """apply_lora of each module on its columns of y (modules sharing x: q | k | v, gate | up), in one call
    of the kernel: a decode step makes 120 such calls instead of 210, each with one set of checks. ext: as
    apply_lora's."""
    ext = ext or load_extension("cpu_sgmv")
    if not _kernel_takes(ext, y, lora):
        for m, lo, hi in zip(modules, bounds, bounds[1:]):
            torch_sgmv.apply_lora(y[:, lo:hi], x, pool_rows, lora, layer, m)
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    ext.apply_lora_group(y, x, pool_rows, *_tables(lora), layer, modules, bounds, LONG_SEGMENT)
    if _any_long(lora):
        for m, lo, hi in zip(modules, bounds, bounds[1:]):
            long = _long_segments(lora, layer, m, pool_rows.shape[1], ext)
            if long:
                torch_sgmv.apply_segments(y[:, lo:hi], x, pool_rows, long, layer, m)


def _tables(lora: LoraBatch) -> tuple:
    """The kernel's segment-table arguments (seg_start, seg_len, layout, scales, pages, rows_per_page), cached
    on the batch: a decode step makes 120 calls with the same ones."""
    hit = lora.plan_cache.get("cpu_tables")
    if hit is None:
        t = lora.device_tensors
        hit = lora.plan_cache["cpu_tables"] = (t.seg_start, t.seg_len, t.layout, t.scales, t.pages,
                                               lora.segments[0].adapter.rows_per_page)
    return hit


def _any_long(lora: LoraBatch) -> bool:
    """Whether any segment is long enough that the kernel may leave it to BLAS (never in a decode step)."""
    hit = lora.plan_cache.get("cpu_any_long")
    if hit is None:
        hit = lora.plan_cache["cpu_any_long"] = any(s.length > LONG_SEGMENT for s in lora.segments)
    return hit


def _kernel_takes(ext, y: torch.Tensor, lora: LoraBatch) -> bool:
    """Whether the C++ kernel takes this call (else the torch path does)."""
    ranks_ok = lora.plan_cache.get("cpu_ranks_ok")
    if ranks_ok is None:  # once per batch: max_rank walks the segments, and a decode step makes 120 calls
        ranks_ok = lora.plan_cache["cpu_ranks_ok"] = bool(lora.segments) and lora.max_rank <= MAX_RANK
    # is_cpu, not device.type: 0.17 against 1.05 us a call here, and a decode step makes 120 (AMD EPYC Zen 3, timeit)
    return ext is not None and ranks_ok and y.dtype == torch.float32 and y.is_cpu and y.stride(1) == 1


def _long_segments(lora: LoraBatch, layer: int, module: int, d: int, ext: ModuleType) -> tuple[LoraSegment, ...]:
    """The segments build ext leaves to BLAS for (layer, module) (its long_ok: builds for other vector widths
    differ); cached on the batch, which every step of the same decode batch reuses."""
    key = ("cpu_long", ext.__name__, layer, module)
    hit = lora.plan_cache.get(key)
    if hit is None:
        hit = lora.plan_cache[key] = tuple(
            s for s in lora.segments
            if s.length > LONG_SEGMENT and (layer, module) in s.adapter.slots
            and not ext.long_ok(s.adapter.slots[(layer, module)].rank, d))
    return hit
