"""Every Triton kernel compiles for a Hopper GPU (sm_90) at the shapes the engine launches, without one.

The interpreter accepts programs the compiler refuses (tl.dot below 16 in a dimension, mismatched
loop-carried types, ...), so the CPU suite also compiles each kernel ahead of time with the ptxas
that ships inside Triton's wheel: bf16 (the engine's GPU dtype) and fp32 (exact dot products).
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from loraplex.kernels import triton_attention, triton_sgmv
from loraplex.kernels.triton_attention_kernels import (
    attention_combine_kernel,
    paged_attention_kernel,
    write_kv_kernel,
)
from loraplex.kernels.triton_launch import DualKernel
from loraplex.kernels.triton_pointwise_kernels import rms_norm_kernel, rope_kernel, swiglu_kernel
from loraplex.kernels.triton_sgmv_kernels import sgmv_expand_kernel, sgmv_shrink_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(kernel: DualKernel, pointers: dict[str, str], constexprs: dict, num_warps: int = 4) -> None:
    fn = kernel.compiled
    names = fn.arg_names
    # Unnamed arguments are 32-bit integers (strides, sizes) or, in the signature below, floats.
    signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in names}
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    triton.compile(src, target=HOPPER, options={"num_warps": num_warps})


def sgmv_pointers(dt: str) -> dict[str, str]:
    return {"x_ptr": f"*{dt}", "pool_ptr": f"*{dt}", "out_ptr": "*fp32", "s_ptr": "*fp32", "y_ptr": f"*{dt}",
            "tile_seg_ptr": "*i32", "tile_start_ptr": "*i32", "tile_len_ptr": "*i32", "layout_ptr": "*i32",
            "scales_ptr": "*fp32", "pages_ptr": "*i32"}


def attention_pointers(dt: str) -> dict[str, str]:
    return {"q_ptr": f"*{dt}", "kv_ptr": f"*{dt}", "out_ptr": f"*{dt}", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
            "part_acc_ptr": "*fp32", "tables_ptr": "*i32", "query_start_ptr": "*i32", "seq_lens_ptr": "*i32",
            "tile_seq_ptr": "*i32", "tile_start_ptr": "*i32", "tile_len_ptr": "*i32", "qk_scale": "fp32",
            "k_ptr": f"*{dt}", "v_ptr": f"*{dt}", "slot_pages_ptr": "*i64", "slot_offsets_ptr": "*i64"}


@pytest.mark.parametrize("dt", ["bf16", "fp32"])
def test_kernels_compile_for_sm90(dt):
    prec = "ieee" if dt == "fp32" else "tf32"
    p = sgmv_pointers(dt)
    # D = 128 (Llama-3-8B's row width): decode and dot tiles; D = 8: the broadcast-sum fallback. The SGMV
    # kernels are the grouped ones (apply_lora_group): the group's size, bounds and module strides are
    # runtime arguments (i32 here), so one compile covers a single module and the q|k|v and gate|up groups.
    assert {"lay_mstride", "sc_mstride", "rc_per_mod"} <= set(sgmv_shrink_kernel.compiled.arg_names)
    assert {"lay_mstride", "stride_sg", "b1", "b2"} <= set(sgmv_expand_kernel.compiled.arg_names)
    # rows_per_page is a compile-time constant: a power of two (8192: a 2 MB page of 128 bf16 rows) and not (12).
    for d, block, rpp in ((128, triton_sgmv.MAX_BLOCK_K, 8192), (8, 8, 12)):
        for bm in (1, triton_sgmv.DEFAULT_BLOCK_M):
            common = dict(D=d, BLOCK_M=bm, R_CHUNK=triton_sgmv.R_CHUNK, USE_DOT=block >= 16, DOT_PREC=prec,
                          rows_per_page=rpp)
            compile_for_hopper(sgmv_shrink_kernel, p, dict(common, BLOCK_K=block))
            compile_for_hopper(sgmv_expand_kernel, p, dict(common, BLOCK_N=block))
    a = attention_pointers(dt)
    common = dict(GROUP=4, BLOCK_SIZE=16, BLOCK_D=128, DOT_PREC=prec)
    for splits in (1, 4):
        compile_for_hopper(paged_attention_kernel, a, dict(common, BLOCK_M=16, BLOCK_N=triton_attention.DECODE_BLOCK_N,
                                                          NUM_SPLITS=splits), triton_attention.DECODE_WARPS)
    compile_for_hopper(paged_attention_kernel, a, dict(common, BLOCK_M=triton_attention.PREFILL_BLOCK_M,
                                                      BLOCK_N=triton_attention.PREFILL_BLOCK_N, NUM_SPLITS=1),
                       triton_attention.PREFILL_WARPS)
    compile_for_hopper(attention_combine_kernel, a, dict(GROUP=4, BLOCK_M=16, BLOCK_D=128, NUM_SPLITS=4))
    compile_for_hopper(write_kv_kernel, a, dict(BLOCK_H=8, BLOCK_D=128))
    # The elementwise steps, at Qwen2.5-1.5B's widths (hidden 1536 in one row, 14 q + 2 k heads of 128, MLP 8960).
    pw = {"h_ptr": f"*{dt}", "d_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}", "x_ptr": f"*{dt}",
          "cos_ptr": f"*{dt}", "sin_ptr": f"*{dt}", "gu_ptr": f"*{dt}", "eps": "fp32"}
    for has_d in (False, True):
        compile_for_hopper(rms_norm_kernel, pw, dict(HAS_D=has_d, ROWS=2, BLOCK_H=2048))
    compile_for_hopper(rope_kernel, pw, dict(HD=128, BLOCK_NH=16, BLOCK_HALF=64))
    compile_for_hopper(swiglu_kernel, pw, dict(ROWS=4, BLOCK_I=1024))
