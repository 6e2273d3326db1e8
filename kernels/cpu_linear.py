"""The base model's float32 projections on the CPU through the C++ kernel (cpu_linear.cpp).

The weight is packed once, at model load, into panels of the kernel's width (PackedWeight); `linear`
then reads it in place. Where the kernel cannot be built, `available()` is False and the model keeps
oneDNN or mm (models/cpu_gemm.choose).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from .cpu_build import load_extension

STEM = "cpu_linear"


@dataclass(frozen=True)
class PackedWeight:
    panels: torch.Tensor  # [P, in, NR] float32: panel p holds output columns p*NR .. p*NR + NR - 1
    out_features: int


def available() -> bool:
    return load_extension(STEM) is not None


def panel_width() -> int:
    """NR, the output columns of one panel in this machine's build (32 with AVX-512, 16 with AVX2)."""
    ext = load_extension(STEM)
    if ext is None:
        raise RuntimeError("the C++ linear kernel is not built here (kernels.cpu_build.build_error('cpu_linear'))")
    return ext.panel_width()


def pack(w: torch.Tensor) -> PackedWeight:  # w [out, in] float32 on the CPU
    nr = panel_width()  # raises where the kernel is not built
    if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
        raise ValueError(f"pack takes a 2-D float32 CPU weight, got {tuple(w.shape)} {w.dtype} on {w.device}")
    out, k = w.shape
    p = -(-out // nr)
    padded = torch.zeros(p * nr, k, dtype=w.dtype)
    padded[:out] = w
    # [P*NR, K] -> [P, NR, K] -> [P, K, NR]: a panel's row k is the NR weights that input k feeds.
    return PackedWeight(padded.view(p, nr, k).transpose(1, 2).contiguous(), out)


def linear(
    x: torch.Tensor,  # [T, in] float32, any row stride
    w: PackedWeight,
    b: torch.Tensor | None,  # [out]
    ext: ModuleType | None = None,
) -> torch.Tensor:  # [T, out], contiguous
    """x @ W^T + b. ext: the cpu_linear build to run (default: this checkout's; benchmarks pass an earlier one's,
    which must pack panels of the same width)."""
    ext = ext or load_extension(STEM)
    x = x if x.stride(-1) == 1 else x.contiguous()
    return ext.linear(x, w.panels, b, w.out_features)
