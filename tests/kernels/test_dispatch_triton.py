"""The Triton kernel set behind the dispatcher: same signatures as the torch path, chosen as asked,
and runnable on a CPU whatever imported triton first."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
import textwrap

import torch
from loraplex.kernels import select_kernels
from loraplex.kernels import cpu_sgmv
from loraplex.kernels.dispatch import CPU_OPS, TORCH_OPS

OPS = ("write_kv", "paged_attention", "lora_shrink", "lora_expand", "apply_lora", "apply_lora_group")


def test_triton_is_selected_when_asked_and_matches_torch_signatures():
    triton_ops = select_kernels(torch.device("cpu"), "triton")
    assert triton_ops.name == "triton"
    assert select_kernels(torch.device("cpu"), "auto") is (CPU_OPS if cpu_sgmv.available() else TORCH_OPS)
    for op in OPS:
        ours = inspect.signature(getattr(triton_ops, op)).parameters
        theirs = inspect.signature(getattr(TORCH_OPS, op)).parameters
        # The Triton entry points may add keyword-only options after the shared parameters.
        shared = [p for p in ours.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
        assert [p.name for p in shared] == list(theirs), op
        assert all(p.default is not inspect.Parameter.empty for p in ours.values() if p.kind is inspect.Parameter.KEYWORD_ONLY)


def test_interpreted_launch_after_triton_was_imported_in_compiled_mode(tmp_path):
    """peft imports triton; a process that imported it first, without TRITON_INTERPRET, still runs
    the kernels on CPU tensors (in the interpreter), and leaves triton.language unpatched after."""
    code = textwrap.dedent("""
        import triton, triton.language as tl
        from triton.runtime.jit import JITFunction
        before = {name: getattr(tl.core, name) for name in ("load", "store", "arange")}
        import torch
        from loraplex.kernels import triton_attention
        from loraplex.kernels.metadata import AttentionMetadata
        kv = torch.zeros(3, 2, 2, 1, 16)
        k, v = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
        meta = AttentionMetadata(
            block_size=2, positions=torch.tensor([0, 1]), query_start=torch.tensor([0, 2], dtype=torch.int32),
            seq_lens=torch.tensor([2], dtype=torch.int32), block_tables=torch.tensor([[[2]]], dtype=torch.int32),
            slot_pages=torch.tensor([[2, 2]]), slot_offsets=torch.tensor([0, 1]),
            query_lens_host=(2,), seq_lens_host=(2,))
        triton_attention.write_kv(kv, k, v, meta, 0)
        assert torch.equal(kv[2, 0, :, 0], k[:, 0]) and torch.equal(kv[2, 1, :, 0], v[:, 0])
        out = triton_attention.paged_attention(torch.randn(2, 1, 16), kv, meta, 0, 0.25)
        assert torch.allclose(out[0, 0], v[0, 0], atol=1e-6)  # the first token sees only itself
        assert all(getattr(tl.core, n) is f for n, f in before.items()), "triton.language left patched"
        assert isinstance(tl.zeros, JITFunction)
        print("ok")
    """)
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
