"""The base model's projections on the CPU: oneDNN with each weight prepacked once, or BLAS mm.

Why oneDNN: torch's float32 CPU matmul calls MKL's sgemm, which repacks the weight into its panel
layout on every call; at decode batch sizes that repacking is a large part of the call. oneDNN's
linear takes a weight reordered once, when the model loads, into the blocked layout its kernel reads.
Measured on an AMD EPYC (Zen, AVX2, 2 threads, float32, x [64, K] at SmolLM2's shapes; the machine's
own speed drifts by up to 1.4x over minutes, so each pair was timed back to back):
gate/up 576 -> 3072: 58 vs 30 GFLOP/s; the LM head 576 -> 49152: 63 vs 22-30 GFLOP/s; the other
projections 4-15% faster (/tmp script, see benchmarks/RESULTS.md for the engine-level figures).

The packed weight is an opaque mkldnn tensor: only `linear` below reads it. Where torch was built
without oneDNN (or its linear fails the self-check) "auto" falls back to mm.
"""

from __future__ import annotations

import functools

import torch

from loraplex.errors import ConfigError

GEMM_CHOICES = ("auto", "onednn", "mm")


@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    """Whether oneDNN's prepacked float32 linear runs here and agrees with mm on a small case."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(24, 40, generator=g)  # [out, in]
        x = torch.randn(5, 40, generator=g)
        b = torch.randn(24, generator=g)
        y = linear(x, pack(w), b)
        return bool(torch.allclose(y, torch.addmm(b, x, w.t()), rtol=1e-4, atol=1e-4))
    except (RuntimeError, AttributeError):  # an op missing from this build
        return False


def choose(gemm: str, device: torch.device, dtype: torch.dtype) -> bool:
    """True where the model should prepack its weights for oneDNN; ConfigError where "onednn" cannot run."""
    if gemm not in GEMM_CHOICES:
        raise ConfigError(f"gemm {gemm!r} is not one of {', '.join(GEMM_CHOICES)}")
    applies = device.type == "cpu" and dtype == torch.float32
    if gemm == "onednn" and not (applies and onednn_available()):
        raise ConfigError("gemm 'onednn' was asked for, but it runs only on the CPU in float32 with a torch "
                          f"built with oneDNN (here: device {device}, {dtype}, oneDNN usable: {onednn_available()})")
    return gemm != "mm" and applies and onednn_available()


def pack(w: torch.Tensor) -> torch.Tensor:  # w [out, in] float32 -> opaque packed weight
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def linear(
    x: torch.Tensor,  # [T, in], any row stride
    w: torch.Tensor,  # packed by pack()
    b: torch.Tensor | None,  # [out]
) -> torch.Tensor:  # [T, out]
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
