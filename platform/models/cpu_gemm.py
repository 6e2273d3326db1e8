"""The base model's projections on the CPU: our C++ kernel or oneDNN, each weight prepacked once, or BLAS mm.

Why prepacked: torch's float32 CPU matmul calls MKL's sgemm, which repacks the weight into its panel
layout on every call; at decode batch sizes that repacking is a large part of the call. oneDNN's
linear takes a weight reordered once, when the model loads (on an AMD EPYC, x [64, K]: gate/up 58
vs 30 GFLOP/s for mm, the LM head 63 vs 22-30). Our kernel goes further at decode sizes: on the
Intel dev CPU, a decode step of the default model took 34.5 / 54.1 / 137.5 ms at batch 1 / 12 / 64
against oneDNN's 44.5 / 75.2 / 151.0 (two engines alternating steps); at prefill sizes (256-2048
rows) it is 5-13% slower per shape (benchmarks/cpu_linear_bench.py, RESULTS.md).

"packed" (kernels/cpu_linear.cpp) holds each weight in panels of the kernel's vector width; "onednn"
holds an opaque mkldnn tensor. Only `linear` below reads either. "auto" takes the first of packed,
oneDNN and mm that runs here (a machine without a compiler, a torch without oneDNN).
"""

from __future__ import annotations

import functools

import torch

from loraplex.errors import ConfigError
from loraplex.kernels import cpu_linear
from loraplex.unified_pager.huge_pages import huge_page_buffer

GEMM_CHOICES = ("auto", "packed", "onednn", "mm")
PACKED_LAYOUTS = ("packed", "onednn")  # LlamaModel.layout values whose weights pack() prepares


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
        y = _onednn_linear(x, _onednn_pack(w), b)
        return bool(torch.allclose(y, torch.addmm(b, x, w.t()), rtol=1e-4, atol=1e-4))
    except (RuntimeError, AttributeError):  # an op missing from this build
        return False


def choose(gemm: str, device: torch.device, dtype: torch.dtype) -> str | None:
    """The prepacked layout the model should hold its projections in ("packed" | "onednn"), or None for
    plain tensors (mm); ConfigError where the backend asked for cannot run."""
    if gemm not in GEMM_CHOICES:
        raise ConfigError(f"gemm {gemm!r} is not one of {', '.join(GEMM_CHOICES)}")
    applies = device.type == "cpu" and dtype == torch.float32
    usable = {"packed": applies and cpu_linear.available(), "onednn": applies and onednn_available()}
    if gemm in usable and not usable[gemm]:
        raise ConfigError(f"gemm {gemm!r} was asked for, but it runs only on the CPU in float32 "
                          + ("with a torch built with oneDNN" if gemm == "onednn" else "where the C++ kernel builds")
                          + f" (here: device {device}, {dtype}, usable: {usable[gemm]})")
    if gemm == "auto":
        return next((name for name in PACKED_LAYOUTS if usable[name]), None)
    return gemm if gemm in usable else None


def pack(w: torch.Tensor, layout: str):  # w [out, in] float32 -> the layout's packed weight
    return cpu_linear.pack(w) if layout == "packed" else _onednn_pack(w)


def on_huge_pages(ws: list[cpu_linear.PackedWeight]) -> list[cpu_linear.PackedWeight]:
    """The packed weights copied, in order, into one buffer backed by 2 MiB pages (huge_page_buffer).

    Why: a decode step streams every weight from memory, and the kernel's prefetches run through one
    4 KiB page translation after another; with each weight in its own allocation (1-7 MB at the default
    model's shapes) few of them held a whole aligned 2 MiB page. Two engines of the default model stepping
    in turn (AMD EPYC Zen 5, decode at 128 tokens of context), this one's step over the other's, two runs:
    batch 1 0.970 / 0.977, 8 0.966 / 0.955, 12 0.962 / 0.977, 16 0.952 / 0.929, 20 0.968 / 1.011, 32 0.977 /
    0.984 (RESULTS.md, twenty-ninth session). The copy holds every packed weight twice while it runs."""
    buf = huge_page_buffer(sum(w.panels.numel() for w in ws), torch.float32)
    out, at = [], 0
    for w in ws:
        n = w.panels.numel()
        panels = buf[at:at + n].view(w.panels.shape)
        panels.copy_(w.panels)
        out.append(cpu_linear.PackedWeight(panels, w.out_features))
        at += n
    return out


def linear(
    x: torch.Tensor,  # [T, in], any row stride
    w,  # packed by pack(w, layout)
    b: torch.Tensor | None,  # [out]
    layout: str,
) -> torch.Tensor:  # [T, out]
    return cpu_linear.linear(x, w, b) if layout == "packed" else _onednn_linear(x, w, b)


def _onednn_pack(w: torch.Tensor) -> torch.Tensor:  # w [out, in] float32 -> opaque packed weight
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
