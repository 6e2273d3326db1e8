"""Kernel launches per decode step on the GPU path, counted on the CPU: the same Python code a CUDA step runs
(bf16, the Triton kernel set, the model's GPU weight layout), with every Triton launch counted instead of run.

On an H200 the engine's decode step was host-bound (29.6 ms at batch 64 for weights that stream in 0.75 ms),
and a step's host time grows with its launches: each torch op that runs a kernel and each Triton launch costs
the host microseconds, the kernels themselves next to nothing at that size. This counts both kinds per step
(torch ops by the profiler: top-level aten ops that are not views or allocations), with the Triton path's own
RMSNorm / RoPE / SwiGLU kernels and with the model's torch formulas in their place, and times the steps'
host work here (CPU matmuls included, Triton kernels not), alternating the two sets.

    .venv/bin/python benchmarks/step_launches.py [--layers 28] [--batch 64] [--adapters 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "benchmarks")]

import torch  # noqa: E402

from e2e.workload import write_random_adapter  # noqa: E402
from factories import make_tiny_model  # noqa: E402
from loraplex.config import EngineConfig  # noqa: E402
from loraplex.engine import EngineCore, SamplingParams  # noqa: E402
from loraplex.kernels import triton_attention_kernels, triton_pointwise_kernels, triton_sgmv_kernels  # noqa: E402
from loraplex.models import llama  # noqa: E402

KERNELS = (triton_sgmv_kernels.sgmv_shrink_kernel, triton_sgmv_kernels.sgmv_expand_kernel,
           triton_attention_kernels.paged_attention_kernel, triton_attention_kernels.attention_combine_kernel,
           triton_attention_kernels.write_kv_kernel, triton_pointwise_kernels.rms_norm_kernel,
           triton_pointwise_kernels.rope_kernel, triton_pointwise_kernels.swiglu_kernel)
# aten ops that launch no kernel on a GPU: views, allocations, metadata.
NO_LAUNCH = {"aten::view", "aten::slice", "aten::select", "aten::as_strided", "aten::reshape", "aten::unsqueeze",
             "aten::expand", "aten::t", "aten::transpose", "aten::detach", "aten::detach_", "aten::alias",
             "aten::empty", "aten::empty_strided", "aten::empty_like", "aten::_unsafe_view", "aten::lift_fresh",
             "aten::resolve_conj", "aten::resolve_neg", "aten::contiguous", "aten::result_type", "aten::split",
             "aten::split_with_sizes", "aten::chunk", "aten::narrow", "aten::squeeze", "aten::permute",
             "aten::_reshape_alias", "aten::new_empty", "aten::set_"}


class _Counted:
    """A Triton kernel's launcher that counts launches instead of running them."""

    def __init__(self, name: str, counts: Counter):
        self.name, self.counts = name, counts

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            self.counts[self.name] += 1

        return launch


def _model(work: Path, layers: int) -> Path:
    """A Qwen2-family model (qkv bias, tied head) with Qwen2.5-1.5B's layer structure at a width the CPU runs in
    microseconds: the count of launches depends on the layers, not the widths."""
    return make_tiny_model(work / "model", "qwen2", seed=0, hidden_size=128, intermediate_size=256,
                           num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)


def _torch_launches(engine: EngineCore, steps: int) -> tuple[float, dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    ops: Counter = Counter()
    for e in prof.events():
        parent = e.cpu_parent
        if e.name.startswith("aten::") and e.name not in NO_LAUNCH and (parent is None or not parent.name.startswith("aten::")):
            ops[e.name] += 1
    return sum(ops.values()) / steps, {k: v / steps for k, v in ops.most_common()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen2.5-1.5B has 28)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--adapters", type=int, default=0, help="distinct rank-16 adapters over the batch")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per kernel set and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    counts: Counter = Counter()
    saved = {k: k.__dict__.get("on") for k in KERNELS}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host time of one thread driving the steps, as a GPU's host does
    for k in KERNELS:
        k.on = lambda device, name=k.__name__: _Counted(name, counts)
    try:
        work = Path(tempfile.mkdtemp(prefix="lp-launches-"))
        # The GPU's weight layout ([out, in], F.linear) and bf16: the model then runs the torch formulas a GPU
        # would where the kernel set brings none.
        llama_in_out = llama.WEIGHTS_IN_OUT_ON_CPU
        llama.WEIGHTS_IN_OUT_ON_CPU = False
        try:
            engine = EngineCore(EngineConfig(model=str(_model(work, args.layers)), dtype="bfloat16", device="cpu",
                                             kernels="triton", gemm="mm", pool_bytes=256 << 20, max_lora_rank=16,
                                             max_num_seqs=args.batch))
        finally:
            llama.WEIGHTS_IN_OUT_ON_CPU = llama_in_out
        names = []
        for i in range(args.adapters):
            engine.load_adapter(f"a{i}", write_random_adapter(work / f"a{i}", engine.model_config, 16, seed=i))
            names.append(f"a{i}")
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=args.steps * args.rounds * 4 + 64, temperature=0.0, ignore_eos=True)
        reqs = [engine.add_request(torch.randint(3, 1000, (args.context,), generator=g).tolist(), params,
                                   names[i % len(names)] if names else None) for i in range(args.batch)]
        while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in reqs):
            engine.step()
        sets = {"kernels": engine.runner.ops, "torch": dataclasses.replace(engine.runner.ops, pointwise=None)}
        result: dict = {"layers": args.layers, "batch": args.batch, "adapters": args.adapters,
                        "layout": engine.model.layout, "torch": torch.__version__, "sets": {}}
        for name, ops in sets.items():
            engine.runner.ops = ops
            engine.step()
            counts.clear()
            torch_per_step, by_op = _torch_launches(engine, 3)
            result["sets"][name] = {"torch_launches_per_step": torch_per_step,
                                    "triton_launches_per_step": sum(counts.values()) / 3,
                                    "triton_by_kernel": {k: v / 3 for k, v in counts.items()}, "torch_by_op": by_op,
                                    "host_ms": []}
        for _ in range(args.rounds):  # alternating, so both sets see the same minutes
            for name, ops in sets.items():
                engine.runner.ops = ops
                for _ in range(args.steps):
                    t = time.perf_counter()
                    engine.step()
                    result["sets"][name]["host_ms"].append((time.perf_counter() - t) * 1e3)
        engine.runner.ops = sets["kernels"]
    finally:
        torch.set_num_threads(threads)
        for k, on in saved.items():
            if on is None:
                k.__dict__.pop("on", None)
            else:
                k.on = on
    print(f"decode step, {args.layers} layers, batch {args.batch}, {args.adapters} adapters (bf16, GPU layout "
          f"{result['layout']}, Triton launches counted, not run)")
    print("| RMSNorm / RoPE / SwiGLU | torch launches | Triton launches | all | host ms (median, CPU) |\n|---|---|---|---|---|")
    for name, r in result["sets"].items():
        r["launches_per_step"] = r["torch_launches_per_step"] + r["triton_launches_per_step"]
        r["host_ms_median"] = statistics.median(r["host_ms"])
        label = "Triton kernels" if name == "kernels" else "torch formulas"
        print(f"| {label} | {r['torch_launches_per_step']:.0f} | {r['triton_launches_per_step']:.0f} | "
              f"{r['launches_per_step']:.0f} | {r['host_ms_median']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
