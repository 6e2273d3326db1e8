"""The decoder layer's elementwise steps as one kernel set: RMSNorm, the residual add with the next RMSNorm,
RoPE on the fused qkv output, SwiGLU. The model takes the set of its kernel backend where that has one (the
Triton path), else the C++ kernels on a CPU in float32, else torch's formulas (models/llama.py); each is
checked against the torch formula it replaces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cpu_norm, cpu_rope, cpu_swiglu


@dataclass(frozen=True)
class PointwiseOps:
    name: str
    rms_norm: Callable  # (x [T, H], weight [H], eps) -> [T, H]
    # (h [T, H], d [T, H], weight [H], eps) -> (h + d, rms_norm(h + d)); h may be updated in place
    add_rms_norm: Callable
    # (qkv [T, W], (nh, nkv, head_dim), cos [T, hd], sin [T, hd]) -> (q [T, nh, hd], k [T, nkv, hd]), rotated;
    # q and k heads are adjacent from column 0 of qkv, which may be rotated in place
    rope: Callable
    swiglu: Callable  # (gu [T, 2I] gate | up, I) -> [T, I] silu(gate) * up


def _cpu_add_rms_norm(h: torch.Tensor, d: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # h [T, H] updated in place
    return h, cpu_norm.add_rms_norm(h, d, weight, eps)


def _cpu_rope(qkv: torch.Tensor, heads: tuple[int, int, int], cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # qkv [T, W] rotated in place
    nh, nkv, hd = heads
    T, ke = qkv.shape[0], (nh + nkv) * hd
    cpu_rope.rope_(qkv, ke, cos, sin)
    return qkv[:, : nh * hd].view(T, nh, hd), qkv[:, nh * hd : ke].view(T, nkv, hd)


def cpu_pointwise(fallback: PointwiseOps) -> PointwiseOps:
    """The C++ kernels (CPU, float32) where each builds, fallback's functions where not."""
    return PointwiseOps(
        name="cpu",
        rms_norm=cpu_norm.rms_norm if cpu_norm.available() else fallback.rms_norm,
        add_rms_norm=_cpu_add_rms_norm if cpu_norm.available() else fallback.add_rms_norm,
        rope=_cpu_rope if cpu_rope.available() else fallback.rope,
        swiglu=cpu_swiglu.swiglu if cpu_swiglu.available() else fallback.swiglu,
    )
