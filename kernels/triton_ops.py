"""The Triton kernel set, with exactly the torch path's signatures (see dispatch.KernelOps).

Importing this module needs triton installed but no GPU: kernels launched on CPU tensors run in
Triton's interpreter (see triton_launch.py), which is how the CPU test suite checks them.
"""

from __future__ import annotations

from . import triton_attention, triton_sgmv
from .dispatch import KernelOps
from .triton_pointwise import TRITON_POINTWISE

TRITON_OPS = KernelOps(
    name="triton",
    write_kv=triton_attention.write_kv,
    paged_attention=triton_attention.paged_attention,
    lora_shrink=triton_sgmv.lora_shrink,
    lora_expand=triton_sgmv.lora_expand,
    apply_lora=triton_sgmv.apply_lora,
    apply_lora_group=triton_sgmv.apply_lora_group,  # one shrink and one expand launch per group
    compiles_at_first_launch=True,
    pointwise=TRITON_POINTWISE,  # one launch for each norm, RoPE and SwiGLU, not 3 to 8 torch ops
)
