"""RoPE on the CPU in float32 through the C++ kernel (cpu_rope.cpp), in place on the fused qkv output.

The model uses it where `available()` (CPU, float32, the extension builds); elsewhere
models.rope.RotaryEmbedding.rotate (torch).
"""

from __future__ import annotations

import torch

from .cpu_build import load_extension

STEM = "cpu_rope"


def available() -> bool:
    return load_extension(STEM) is not None


def rope_(
    x: torch.Tensor,  # [T, W] float32, rows may be strided; columns [0, ncols) are q and k heads
    ncols: int,
    cos: torch.Tensor,  # [T, head_dim] float32, contiguous (RotaryEmbedding.cos_sin)
    sin: torch.Tensor,  # [T, head_dim]
) -> None:
    load_extension(STEM).rope_(x, ncols, cos, sin)
