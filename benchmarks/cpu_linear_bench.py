"""The base model's projections on the CPU: the packed C++ kernel against oneDNN and BLAS mm, per shape.

For each of the default model's projection shapes (qkv, o, gate/up, down, the LM head) and row counts
from a decode token to a prefill chunk, the three backends run alternately, call by call, in one
process (this CPU's speed drifts by tens of percent over minutes: only calls timed side by side
compare). The 2048-square matmul rate is measured between the shapes as the ceiling.

Writes JSON (--out) and prints a table of GFLOP/s (best of the repeats, and the median).
Usage:
    .venv/bin/python benchmarks/cpu_linear_bench.py [--rows 1 12 64 256 2048] [--out benchmarks/results/cpu_linear.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from loraplex.kernels import cpu_linear
from loraplex.models import cpu_gemm

from roofline import matmul_gflops

# SmolLM2-135M: hidden 576, 9 heads + 3 kv heads of 64, MLP 1536, vocab 49152 (in, out).
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
HEAD_MAX_ROWS = 64  # the LM head only sees the last token of each sequence


def time_shape(m: int, k: int, n: int, reps: int) -> dict[str, list[float]]:
    x, w = torch.randn(m, k), torch.randn(n, k)
    packed, onednn, w_t = cpu_linear.pack(w), cpu_gemm.pack(w, "onednn"), w.t().contiguous()
    calls = {"packed": lambda: cpu_linear.linear(x, packed, None),
             "onednn": lambda: cpu_gemm.linear(x, onednn, None, "onednn"),
             "mm": lambda: x @ w_t}
    torch.testing.assert_close(calls["packed"](), calls["mm"](), rtol=1e-4, atol=1e-3 * k**0.5)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, f in calls.items():
            f()  # the same weights were just read by the other backends: warm this one's own
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 12, 64, 256, 2048])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_linear.json"))
    args = ap.parse_args()
    if not (cpu_linear.available() and cpu_gemm.onednn_available()):
        raise SystemExit("needs the C++ kernel and oneDNN (kernels.cpu_build.build_error('cpu_linear'))")
    rows = []
    for m in args.rows:
        ceiling = matmul_gflops(2048, 3)
        for name, (k, n) in SHAPES.items():
            if name == "lm_head" and m > HEAD_MAX_ROWS:
                continue
            flops = 2 * m * n * k
            times = time_shape(m, k, n, reps=7 if flops > 3e8 else 25)
            row = {"rows": m, "shape": name, "in": k, "out": n, "ceiling_gflops": ceiling}
            for backend, ts in times.items():
                row[f"{backend}_gflops_best"] = flops / min(ts) / 1e9
                row[f"{backend}_gflops_median"] = flops / statistics.median(ts) / 1e9
            rows.append(row)
            print(f"M={m:5d} {name:8s} " + "  ".join(
                f"{b} {row[f'{b}_gflops_best']:5.0f}/{row[f'{b}_gflops_median']:5.0f}" for b in times)
                + f"  (ceiling {ceiling:.0f})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
                               "threads": torch.get_num_threads(), "rows": rows}, indent=2))
    print("\n| rows | shape | packed GFLOP/s | oneDNN | mm | packed / oneDNN | 2048^2 matmul |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['shape']} | {r['packed_gflops_best']:.0f} ({r['packed_gflops_median']:.0f}) | "
              f"{r['onednn_gflops_best']:.0f} ({r['onednn_gflops_median']:.0f}) | {r['mm_gflops_best']:.0f} "
              f"({r['mm_gflops_median']:.0f}) | {r['packed_gflops_median'] / r['onednn_gflops_median']:.2f} | "
              f"{r['ceiling_gflops']:.0f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
