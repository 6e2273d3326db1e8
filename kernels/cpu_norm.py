"""RMSNorm (and the residual add before it) on the CPU in float32 through the C++ kernel (cpu_norm.cpp).

The model uses it where `available()` (CPU, float32, the extension builds); elsewhere torch's rms_norm.
"""

from __future__ import annotations

import torch

from .cpu_build import load_extension

STEM = "cpu_norm"


def available() -> bool:
    return load_extension(STEM) is not None


def rms_norm(
    x: torch.Tensor,  # [T, H] float32, rows may be strided
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H], contiguous
    return load_extension(STEM).rms_norm(x, weight, eps)


def add_rms_norm(
    h: torch.Tensor,  # [T, H] float32, updated in place: h += d
    d: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H] rms_norm(h + d), contiguous
    return load_extension(STEM).add_rms_norm(h, d, weight, eps)
