"""The model's elementwise steps on the Triton path (kernels in triton_pointwise_kernels.py): the signatures of
pointwise.PointwiseOps, one launch each.

Wrappers are kept to a grid and a launch: the model calls them 4 times per layer per step, and on a GPU a
decode step's time is the host's.
"""

from __future__ import annotations

import torch

from .pointwise import PointwiseOps
from .triton_pointwise_kernels import rms_norm_kernel, rope_kernel, swiglu_kernel, triton

# Elements a program holds: rows per program for the norm and SwiGLU are chosen so a program's tile is about
# this size (one row of a wide model, several of a narrow one; the interpreter on the CPU then runs a few
# programs for a test model's whole batch, not one per token).
TILE = 4096
MAX_ROWS = 16


def _rows(width: int) -> int:
    return max(1, min(MAX_ROWS, TILE // width))


def _warps(elements: int) -> int:
    return 8 if elements >= 8192 else 4


def _norm(h: torch.Tensor, d: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    T, H = h.shape
    out = torch.empty(T, H, dtype=h.dtype, device=h.device)
    if T == 0:
        return out
    block_h = triton.next_power_of_2(H)
    rows = _rows(block_h)
    dd = h if d is None else d
    rms_norm_kernel.on(h.device)[(triton.cdiv(T, rows),)](
        h, h.stride(0), dd, dd.stride(0), weight, out, T, H, eps,
        HAS_D=d is not None, ROWS=rows, BLOCK_H=block_h, num_warps=_warps(rows * block_h))
    return out


def rms_norm(
    x: torch.Tensor,  # [T, H] unit column stride
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H] contiguous
    assert x.stride(1) == 1
    return _norm(x, None, weight, eps)


def add_rms_norm(
    h: torch.Tensor,  # [T, H] the residual stream, unit column stride: updated in place, h += d
    d: torch.Tensor,  # [T, H] unit column stride
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (h, rms_norm(h)) after the add
    assert h.stride(1) == 1 and d.stride(1) == 1 and h.shape == d.shape
    return h, _norm(h, d, weight, eps)


def rope(
    qkv: torch.Tensor,  # [T, W] unit column stride: nh q heads, then nkv k heads, from column 0
    heads: tuple[int, int, int],  # (nh, nkv, head_dim)
    cos: torch.Tensor,  # [T, head_dim] contiguous, in qkv's dtype
    sin: torch.Tensor,  # [T, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:  # (q [T, nh, hd], k [T, nkv, hd]): views of qkv, rotated in place
    nh, nkv, hd = heads
    T = qkv.shape[0]
    assert qkv.stride(1) == 1 and hd % 2 == 0 and cos.is_contiguous() and sin.is_contiguous()
    if T > 0:
        n = nh + nkv
        rope_kernel.on(qkv.device)[(T,)](qkv, qkv.stride(0), cos, sin, n, HD=hd,
                                         BLOCK_NH=triton.next_power_of_2(n), BLOCK_HALF=triton.next_power_of_2(hd // 2))
    ke = (nh + nkv) * hd
    return qkv[:, : nh * hd].view(T, nh, hd), qkv[:, nh * hd : ke].view(T, nkv, hd)


def swiglu(
    gu: torch.Tensor,  # [T, 2I] unit column stride: gate | up
    inter: int,  # I
) -> torch.Tensor:  # [T, I] silu(gate) * up, contiguous
    assert gu.stride(1) == 1 and gu.shape[1] == 2 * inter
    T = gu.shape[0]
    out = torch.empty(T, inter, dtype=gu.dtype, device=gu.device)
    if T == 0:
        return out
    block_i = min(triton.next_power_of_2(inter), 1024)
    rows = _rows(block_i)
    swiglu_kernel.on(gu.device)[(triton.cdiv(T, rows), triton.cdiv(inter, block_i))](
        gu, gu.stride(0), out, T, inter, ROWS=rows, BLOCK_I=block_i)
    return out


TRITON_POINTWISE = PointwiseOps(name="triton", rms_norm=rms_norm, add_rms_norm=add_rms_norm, rope=rope, swiglu=swiglu)
