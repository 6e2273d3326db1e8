"""The base model's projections on the CPU: the packed C++ kernel against oneDNN and BLAS mm, per shape.

For each of the default model's projection shapes (qkv, o, gate/up, down, the LM head) and row counts
from a decode token to a prefill chunk, the three backends run alternately, call by call, in one
process (this CPU's speed drifts by tens of percent over minutes: only calls timed side by side
compare). The 2048-square matmul rate is measured between the shapes as the ceiling.

Per shape, the weights were just read by the call before: they come from the caches. --stream instead runs
what a forward pass runs: all layers' projections (each its own weights, 538 MB with the LM head, read from
memory) and the LM head, once per backend in turn, and reports the whole pass. The packed kernel's weights then
lie in one buffer on 2 MiB pages, as the engine holds them (cpu_gemm.on_huge_pages); --small-pages leaves each in
an allocation of its own, as this benchmark held them before the thirty-eighth session. On an Intel Xeon (model
167) that placement alone took a pass at 1 / 8 / 16 rows from 23.5 / 31.1 / 37.5 to 20.2 / 26.3 / 32.1 ms (a /tmp
script, the two alternating; RESULTS.md, thirty-eighth session), so figures for the kernel that leave it out
misstate what a decode step spends.

Writes JSON (--out) and prints a table of GFLOP/s (best of the repeats, and the median).
Usage:
    .venv/bin/python benchmarks/cpu_linear_bench.py [--rows 1 12 64 256 2048] [--out benchmarks/results/cpu_linear.json]
    .venv/bin/python benchmarks/cpu_linear_bench.py --stream [--rows 64 2048] [--layers 30] [--reps 5] [--small-pages]

--baseline-source FILE adds a backend "baseline": FILE (an earlier cpu_linear.cpp, e.g. from `git show
REV:kernels/cpu_linear.cpp > /tmp/old.cpp`) built beside the current kernel and timed alternating with it
in the same process (the same weights packed once serve both: the panel layout must not have changed).
Across processes this CPU's speed moves by as much as a kernel change gains.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from loraplex.kernels import cpu_build, cpu_linear
from loraplex.models import cpu_gemm

from rounds import round_order
from roofline import matmul_gflops

# SmolLM2-135M: hidden 576, 9 heads + 3 kv heads of 64, MLP 1536, vocab 49152 (in, out).
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
HEAD_MAX_ROWS = 64  # the LM head only sees the last token of each sequence
LAYERS = 30

# Each backend: how it holds a weight [out, in] once, and how it multiplies x [M, in] by the held weight.
PACKS = {"packed": cpu_linear.pack, "onednn": lambda w: cpu_gemm.pack(w, "onednn"), "mm": lambda w: w.t().contiguous()}
CALLS = {"packed": lambda x, w: cpu_linear.linear(x, w, None),
         "onednn": lambda x, w: cpu_gemm.linear(x, w, None, "onednn"), "mm": lambda x, w: x @ w}


def hold(pack_one, baseline=None) -> tuple[dict, dict]:
    """(held weights, CALLS) by backend: pack_one(pack) packs the case's weights one backend's way; the baseline
    build, where given, multiplies by the current kernel's packed weights (the same copy, not another)."""
    held = {b: pack_one(pack) for b, pack in PACKS.items()}
    if baseline is None:
        return held, CALLS
    held["baseline"] = held["packed"]
    # Through cpu_linear.linear as the kernel is, so that the two differ by their builds alone.
    return held, {**CALLS, "baseline": lambda x, w: cpu_linear.linear(x, w, None, baseline)}


def time_shape(m: int, k: int, n: int, reps: int, baseline=None) -> dict[str, list[float]]:
    x, w = torch.randn(m, k), torch.randn(n, k)
    held, fns = hold(lambda pack: pack(w), baseline)
    calls = {b: (lambda f=f, h=held[b]: f(x, h)) for b, f in fns.items()}
    torch.testing.assert_close(calls["packed"](), calls["mm"](), rtol=1e-4, atol=1e-3 * k**0.5)
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, f in calls.items():
            f()  # the same weights were just read by the other backends: warm this one's own
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return times


def on_huge_pages(held: tuple[list[list], object]) -> tuple[list[list], object]:
    """The packed kernel's (layers' weights, LM head) moved into one buffer on 2 MiB pages, in the engine's order
    (models/llama.py: every layer's weights, then the head)."""
    layer_ws, head = held
    moved = cpu_gemm.on_huge_pages([w for ws in layer_ws for w in ws] + [head])
    per = len(layer_ws[0]) if layer_ws else 0
    return [moved[i * per:(i + 1) * per] for i in range(len(layer_ws))], moved[-1]


def time_stream(m: int, layers: int, reps: int, baseline=None,
                huge_pages: bool = True) -> tuple[float, dict[str, list[float]], float | None]:
    """One forward pass's projections at m rows (the LM head at up to HEAD_MAX_ROWS), every layer its own
    weights: (FLOPs of the pass, seconds per pass by backend, the baseline's largest difference from the
    kernel on the first layer). The backends alternate pass by pass. huge_pages: the packed kernel's weights
    (which the baseline shares) on 2 MiB pages, as the engine holds them."""
    g = torch.Generator().manual_seed(m)
    per_layer = [(name, k, n) for name, (k, n) in SHAPES.items() if name != "lm_head"]
    weights = [[torch.randn(n, k, generator=g) for _, k, n in per_layer] for _ in range(layers)]
    head_k, head_n = SHAPES["lm_head"]
    head = torch.randn(head_n, head_k, generator=g)
    xs = [torch.randn(m, k, generator=g) for _, k, _ in per_layer]
    xh = torch.randn(min(m, HEAD_MAX_ROWS), head_k, generator=g)
    flops = 2.0 * m * layers * sum(k * n for _, k, n in per_layer) + 2.0 * xh.shape[0] * head_k * head_n
    held, calls = hold(lambda pack: ([[pack(w) for w in layer] for layer in weights], pack(head)), baseline)
    if huge_pages:
        held["packed"] = on_huge_pages(held["packed"])
        if baseline is not None:
            held["baseline"] = held["packed"]
    torch.testing.assert_close(calls["packed"](xh, held["packed"][1]), calls["mm"](xh, held["mm"][1]),
                               rtol=1e-4, atol=1e-3 * head_k**0.5)
    diff = None
    if baseline is not None:  # how far the baseline's sums are from the kernel's (0.0: bit for bit)
        diff = max(float((calls["baseline"](x, w) - calls["packed"](x, w)).abs().max())
                   for x, w in zip(xs, held["packed"][0][0]))
    times: dict[str, list[float]] = {b: [] for b in calls}
    for rep in range(reps + 1):  # the first round warms up (page faults, oneDNN's primitive cache)
        for b, call in round_order(calls, rep):  # reversed every other round: no backend always follows another
            layer_ws, head_w = held[b]
            t = time.perf_counter()
            for ws in layer_ws:
                for x, w in zip(xs, ws):
                    call(x, w)
            call(xh, head_w)
            times[b].append(time.perf_counter() - t)
    return flops, {b: ts[1:] for b, ts in times.items()}, diff


def stream(args) -> None:
    rows = []
    for m in args.rows:
        ceiling = matmul_gflops(2048, 3)
        flops, times, diff = time_stream(m, args.layers, reps=args.reps, baseline=args.baseline,
                                         huge_pages=not args.small_pages)
        row = {"rows": m, "layers": args.layers, "gflop": flops / 1e9, "ceiling_gflops": ceiling,
               "baseline_max_abs_diff": diff, "packed_on_huge_pages": not args.small_pages}
        if args.baseline is not None:  # the passes of one round ran side by side: their differences compare
            pairs = [b - p for b, p in zip(times["baseline"], times["packed"])]
            row["baseline_minus_packed_ms_paired_median"] = statistics.median(pairs) * 1e3
            row["packed_faster_rounds"] = sum(d > 0 for d in pairs)
        for b, ts in times.items():
            row[f"{b}_ms_median"] = statistics.median(ts) * 1e3
            row[f"{b}_gflops_median"] = flops / statistics.median(ts) / 1e9
        rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__,
                               "threads": torch.get_num_threads(), "mode": "stream", "rows": rows}, indent=2))
    backends = ["packed", "onednn", "mm"] + (["baseline"] if args.baseline is not None else [])
    print(f"\n| rows | layers | {' | '.join(f'{b} ms (GFLOP/s)' for b in backends)} | 2048^2 matmul GFLOP/s |")
    print("|---|---|" + "---|" * len(backends) + "---|")
    for r in rows:
        print(f"| {r['rows']} | {r['layers']} | " + " | ".join(
            f"{r[f'{b}_ms_median']:.1f} ({r[f'{b}_gflops_median']:.0f})" for b in backends)
            + f" | {r['ceiling_gflops']:.0f} |")
    if args.baseline is not None:
        print("baseline against the kernel, largest difference: "
              + ", ".join(f"{r['rows']} rows {r['baseline_max_abs_diff']:.3g}" for r in rows))
        print("baseline - kernel, paired median ms (rounds the kernel was faster): " + ", ".join(
            f"{r['rows']} rows {r['baseline_minus_packed_ms_paired_median']:+.2f} ({r['packed_faster_rounds']}/"
            f"{args.reps})" for r in rows))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 12, 64, 256, 2048])
    ap.add_argument("--out", default=None, help="JSON path (default results/cpu_linear.json, --stream: "
                    "results/cpu_linear_stream.json)")
    ap.add_argument("--stream", action="store_true", help="whole passes, every layer its own weights")
    ap.add_argument("--layers", type=int, default=LAYERS, help="--stream: layers of the pass")
    ap.add_argument("--reps", type=int, default=5, help="--stream: timed passes of each backend (after one warm-up)")
    ap.add_argument("--small-pages", action="store_true",
                    help="--stream: the packed weights each in an allocation of its own, not on 2 MiB pages")
    ap.add_argument("--baseline-source", default=None, help="another cpu_linear.cpp, timed as backend 'baseline'")
    args = ap.parse_args()
    if not (cpu_linear.available() and cpu_gemm.onednn_available()):
        raise SystemExit("needs the C++ kernel and oneDNN (kernels.cpu_build.build_error('cpu_linear'))")
    args.baseline = None
    if args.baseline_source:
        args.baseline = cpu_build.compile_source(Path(args.baseline_source), "baseline_cpu_linear")
        if args.baseline.panel_width() != cpu_linear.panel_width():
            raise SystemExit("the baseline packs panels of another width: it cannot share the packed weights")
    args.out = args.out or str(Path(__file__).parent / "results" /
                               ("cpu_linear_stream.json" if args.stream else "cpu_linear.json"))
    if args.stream:
        stream(args)
        return
    rows = []
    for m in args.rows:
        ceiling = matmul_gflops(2048, 3)
        for name, (k, n) in SHAPES.items():
            if name == "lm_head" and m > HEAD_MAX_ROWS:
                continue
            flops = 2 * m * n * k
            times = time_shape(m, k, n, reps=7 if flops > 3e8 else 25, baseline=args.baseline)
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
