"""Row-wise argmax (greedy sampling) on the CPU in float32 through the C++ kernel (cpu_argmax.cpp).

Same answer as torch.argmax(dim=-1) (first index of the maximum; the first NaN where a row has one); the
torch op where the kernel does not apply (another device or dtype, no compiler, an empty row).
"""

from __future__ import annotations

import torch

from .cpu_build import load_extension

STEM = "cpu_argmax"


def available() -> bool:
    return load_extension(STEM) is not None


def argmax_rows(
    x: torch.Tensor,  # [N, V]
) -> torch.Tensor:  # [N] int64
    if x.dim() != 2 or not x.is_cpu or x.dtype != torch.float32 or x.shape[1] == 0 or x.stride(1) != 1:
        return x.argmax(dim=-1)
    ext = load_extension(STEM)
    return ext.argmax_rows(x) if ext is not None else x.argmax(dim=-1)
