"""The MLP activation silu(gate) * up on the CPU in float32 through the C++ kernel (cpu_swiglu.cpp).

The model uses it where `available()` (CPU, float32, the extension builds); elsewhere torch's silu and product.
"""

from __future__ import annotations

import torch

from .cpu_build import load_extension

STEM = "cpu_swiglu"


def available() -> bool:
    return load_extension(STEM) is not None


def swiglu(
    gu: torch.Tensor,  # [T, 2I] float32: gate | up, rows may be strided
    inter: int,  # I
) -> torch.Tensor:  # [T, I] silu(gate) * up, contiguous
    return load_extension(STEM).swiglu(gu, inter)
