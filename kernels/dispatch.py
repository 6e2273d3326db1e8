"""One dispatcher for every kernel the model calls: the torch path, the C++ CPU path or the Triton path.

The choice is made once, when the engine starts, from the engine config (which reads
LORAPLEX_KERNELS), never per call: "auto" takes Triton for CUDA tensors, and on the CPU the C++
kernels where they build on this machine (cpu_build.py), the torch path otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from loraplex.errors import ConfigError

from . import cpu_attention, cpu_sgmv, torch_attention, torch_sgmv
from .cpu_build import build_all, build_error
from .metadata import LoraBatch
from .pointwise import PointwiseOps

KERNEL_CHOICES = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class KernelOps:
    """The kernel set the model runs with; every backend provides the same signatures."""

    name: str
    write_kv: Callable  # (kv_pool, k, v, attn_meta, layer) -> None
    paged_attention: Callable  # (q, kv_pool, attn_meta, layer, scale) -> out
    lora_shrink: Callable  # (x, pool_rows, lora_batch, layer, module) -> s
    lora_expand: Callable  # (y, s, pool_rows, lora_batch, layer, module) -> None
    apply_lora: Callable  # (y, x, pool_rows, lora_batch, layer, module) -> None
    # (y, x, pool_rows, lora_batch, layer, modules, bounds) -> None: apply_lora of modules[g] on y's columns
    # bounds[g] .. bounds[g + 1], for modules that share x and one fused output (q | k | v, gate | up).
    apply_lora_group: Callable
    # Whether the model may hand long segments' LoRA to the packed GEMM's epilogue (cpu_lora_gemm: C++,
    # CPU, float32); the other backends keep every segment in apply_lora.
    gemm_lora: bool = False
    # Whether each kernel variant compiles at its first launch (Triton): the engine's warm-up then also runs
    # the LoRA path, so that no request waits for those compiles.
    compiles_at_first_launch: bool = False
    # The backend's own RMSNorm / RoPE / SwiGLU kernels (the Triton path's); None: the model picks (C++ on a
    # CPU in float32, torch's formulas elsewhere).
    pointwise: PointwiseOps | None = None


def per_module(apply_lora: Callable) -> Callable:
    """apply_lora_group as a loop over apply_lora: for the backends whose per-call cost is not a kernel
    launch (the Triton path groups the modules into one launch instead)."""

    def apply_lora_group(
        y: torch.Tensor,  # [T, bounds[-1]], updated in place
        x: torch.Tensor,  # [T, in]
        pool_rows: torch.Tensor,  # [R, D]
        lora: LoraBatch,
        layer: int,
        modules: Sequence[int],
        bounds: Sequence[int],  # module g owns columns bounds[g] .. bounds[g + 1] of y
    ) -> None:
        for m, lo, hi in zip(modules, bounds, bounds[1:]):
            apply_lora(y[:, lo:hi], x, pool_rows, lora, layer, m)

    return apply_lora_group


TORCH_OPS = KernelOps(
    name="torch",
    write_kv=torch_attention.write_kv,
    paged_attention=torch_attention.paged_attention,
    lora_shrink=torch_sgmv.lora_shrink,
    lora_expand=torch_sgmv.lora_expand,
    apply_lora=torch_sgmv.apply_lora,
    apply_lora_group=per_module(torch_sgmv.apply_lora),
)

# The C++ kernels replace what measured faster in C++ on the CPU; the rest is the torch path's (the
# shrink and expand halves are only called by tests and the Triton path's own fused calls).
CPU_OPS = KernelOps(
    name="cpu",
    write_kv=cpu_attention.write_kv,
    paged_attention=cpu_attention.paged_attention,
    lora_shrink=torch_sgmv.lora_shrink,
    lora_expand=torch_sgmv.lora_expand,
    apply_lora=cpu_sgmv.apply_lora,
    apply_lora_group=cpu_sgmv.apply_lora_group,
    gemm_lora=True,
)


def _cpu_ops() -> KernelOps | None:
    """The C++ CPU kernel set, or None where it does not build here (the reason is logged once).
    Every kernel (the SGMV and attention of this set, the packer, the model's projections, norms, RoPE,
    SwiGLU and argmax) is built, side by side, or loaded from the cache here, when the engine starts, not in
    its first step; where only the attention kernel fails, its wrapper hands each call to the torch path."""
    build_all()
    if not cpu_sgmv.available():
        return None
    return CPU_OPS


def _triton_ops() -> KernelOps | None:
    """The Triton kernel set, or None where Triton or its kernels are not available."""
    try:
        from . import triton_ops  # noqa: F401  (arrives with the Triton kernels)
    except ImportError:
        return None
    return triton_ops.TRITON_OPS


def select_kernels(device: torch.device, choice: str = "auto") -> KernelOps:
    if choice not in KERNEL_CHOICES:
        raise ConfigError(f"kernel backend {choice!r} is not one of {', '.join(KERNEL_CHOICES)}")
    if choice == "torch":
        return TORCH_OPS
    if choice == "cpu":
        cpu = _cpu_ops()
        if cpu is None:
            raise ConfigError(f"kernel backend 'cpu' was asked for but the C++ CPU kernels did not build: "
                              f"{build_error('cpu_sgmv')}")
        return cpu
    triton = _triton_ops()
    if choice == "triton":
        if triton is None:
            raise ConfigError("kernel backend 'triton' was asked for but the Triton kernels are not available")
        return triton
    if device.type == "cuda":
        return triton if triton is not None else TORCH_OPS
    return (_cpu_ops() or TORCH_OPS) if device.type == "cpu" else TORCH_OPS
