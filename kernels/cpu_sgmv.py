"""SGMV on the CPU through the C++ kernel (cpu_sgmv.cpp): one call per (layer, module) for all segments.

Same contract as torch_sgmv.apply_lora. It reads the segment table LoraBatch.device_tensors (built
once per batch, shared with the Triton path) and the pool in place. Where the kernel does not apply
(no compiler on the machine, a dtype other than float32, ranks above its 256) it hands the call to
the torch path, so callers never need to know which one ran.
"""

from __future__ import annotations

import torch

from . import torch_sgmv
from .cpu_build import load_extension
from .metadata import LoraBatch, LoraSegment

MAX_RANK = 256  # cpu_sgmv.cpp's per-token accumulator
# Segments of more tokens than this (prefill chunks) go to BLAS GEMMs, one pair per segment: there the
# arithmetic outweighs the ops' fixed cost, and on the dev CPU (1 thread) MKL multiplied a 256-token
# segment 2x faster than the kernel's loops (209 vs 419 us, 576 -> 1536 at rank 16).
LONG_SEGMENT = 16


def available() -> bool:
    return load_extension("cpu_sgmv") is not None


def apply_lora(
    y: torch.Tensor,  # [T, out], updated in place (may be a column slice of a fused output)
    x: torch.Tensor,  # [T, in]
    pool_rows: torch.Tensor,  # [R, D]
    lora: LoraBatch,
    layer: int,
    module: int,
) -> None:
    """y += each token's adapter delta for (layer, module); tokens without one are untouched."""
    ext = load_extension("cpu_sgmv")
    if (ext is None or not lora.segments or y.dtype != torch.float32 or y.device.type != "cpu"
            or lora.max_rank > MAX_RANK or y.stride(1) != 1):
        torch_sgmv.apply_lora(y, x, pool_rows, lora, layer, module)
        return
    t = lora.device_tensors
    rows_per_page = lora.segments[0].adapter.rows_per_page
    x = x if x.stride(1) == 1 else x.contiguous()
    ext.apply_lora(y, x, pool_rows, t.seg_start, t.seg_len, t.layout, t.scales, t.pages, rows_per_page, layer,
                   module, LONG_SEGMENT)
    long = _long_segments(lora, layer, module)
    if long:
        torch_sgmv.apply_segments(y, x, pool_rows, long, layer, module)


def _long_segments(lora: LoraBatch, layer: int, module: int) -> tuple[LoraSegment, ...]:
    """The segments the kernel leaves to BLAS for (layer, module); cached on the batch, which every
    step of the same decode batch reuses."""
    key = ("cpu_long", layer, module)
    hit = lora.plan_cache.get(key)
    if hit is None:
        hit = lora.plan_cache[key] = tuple(s for s in lora.segments
                                           if s.length > LONG_SEGMENT and (layer, module) in s.adapter.slots)
    return hit
