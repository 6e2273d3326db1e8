"""Host time of the Triton kernels' Python wrappers (SGMV, attention), kernel launches replaced by no-ops.

On a GPU the engine's decode steps are host-bound (the H200 run of 2026-12-04: 35-65 us per SGMV launch
eager against ~6 us replayed from a CUDA graph), so the wrappers' own time per call is worth knowing apart
from Triton's launcher. SGMV: a decode batch of 64 one-token segments, each its own rank-16 adapter, on a q/k/v
group; attention: one layer's write_kv and paged_attention for 64 decoding sequences; both built by the tests'
kits (tests/kernels); runs on the CPU in seconds.

    .venv/bin/python benchmarks/triton_host_overhead.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "kernels"), str(REPO / "tests")]

import torch  # noqa: E402

from attention_testkit import AttentionSpec, build_attention_case  # noqa: E402
from loraplex.kernels import triton_attention, triton_sgmv  # noqa: E402
from loraplex.kernels import triton_attention_kernels as attention_kernels  # noqa: E402
from loraplex.kernels import triton_sgmv_kernels as kernels  # noqa: E402
from test_triton_sgmv_group import QKV, GroupSpec, build_group_case  # noqa: E402

KERNELS = (kernels.sgmv_shrink_kernel, kernels.sgmv_expand_kernel, attention_kernels.paged_attention_kernel,
           attention_kernels.attention_combine_kernel, attention_kernels.write_kv_kernel)


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args(argv)
    spec = GroupSpec(d=16, rows_per_page=4, in_features=32, modules=QKV, widths=(48, 16, 16), layer=0,
                     ranks=tuple((16, 16, 16) for _ in range(64)), req_lens=(1,) * 64, popularity="distinct",
                     no_adapter_share=0.0, sort=False, empty_segments=0, seed=1)
    case = build_group_case(spec, torch.float32)
    rows, y = case.pool.rows(), case.y0.clone()
    # A decode batch of 64 sequences at 128 tokens, split-KV 4 ways as on a GPU (the CPU would choose 1).
    att = build_attention_case(AttentionSpec(block_size=16, kv_heads=2, group=4, head_dim=64,
                                             seqs=tuple((127, 1) for _ in range(64)), layer=0, seed=1),
                               torch.float32, poison_unused=False)

    def attention_layer() -> None:
        triton_attention.write_kv(att.kv_pool, att.k, att.v, att.meta, 0)
        triton_attention.paged_attention(att.q, att.kv_pool, att.meta, 0, att.scale, decode_splits=4)

    saved = {k: k.on for k in KERNELS}
    for k in saved:
        k.on = lambda device: _NoLaunch()
    calls = {
        "apply_lora_group (q|k|v)": lambda: triton_sgmv.apply_lora_group(y, case.x, rows, case.lora, 0, QKV, spec.bounds),
        "apply_lora (q)": lambda: triton_sgmv.apply_lora(y[:, :48], case.x, rows, case.lora, 0, 0),
        "write_kv + paged_attention (4 splits)": attention_layer,
    }
    out = {}
    try:
        for name, fn in calls.items():
            for _ in range(50):
                fn()
            t = time.perf_counter()
            for _ in range(args.calls):
                fn()
            out[name] = (time.perf_counter() - t) / args.calls * 1e6
            print(f"{name}: {out[name]:.1f} us per call, launches not counted")
    finally:
        for k, on in saved.items():
            k.on = on
    return out


if __name__ == "__main__":
    main()
