"""Prefill LoRA on the CPU: one layer of the default model's projections over a prefill chunk, four ways.

For a batch of `--segments` prefill segments of `--tokens` tokens, each with its own adapter (rank `--rank`,
every module), placed on the unified pool's pages, one layer's four projections (qkv, o, gate/up, down) run:
- base: the packed GEMMs alone (what the adapters add is measured against it);
- blas: the GEMMs, then the LoRA of each segment as a BLAS GEMM pair (torch_sgmv.apply_segments);
- sgmv: the GEMMs, then the C++ SGMV kernel's register-blocked long-segment path (cpu_sgmv.apply_lora);
- fused: the GEMMs with each chunk of rows shrunk just before the panels run over it and the expand in their
  epilogue (cpu_lora_gemm.linear_lora), the engine's path;
- shrink: the same shrink as a pass of its own over the batch (cpu_lora_gemm.shrink), as the engine ran it before
  the thirty-seventh session (with --shrink-baseline-source, other cpu_sgmv.cpp builds' shrinks beside it, as
  shrink:<name>).
With --one-segment each fused path also runs as '<name>:one' on the same tokens as one segment of the first
adapter: what the segments themselves cost (their adapters' rows, the rows cut into pieces) is then paired by round.
With --layers L (the default model has 30), each layer has its own packed weights and its own rows of every
adapter, and each path runs all L layers as a step does: weights and adapters then come from memory or L3, not
from L2 as in one layer repeated. --lengths and --ranks give the segments of a real step (the e2e quick trace's
first prefill chunk: `--lengths 792 201 68 53 18 256 192 32 59 256 42 49 --ranks 8 8 8 8 8 8 8 16 8 16 8 8`).
The paths alternate, call by call, in one process (this CPU's speed drifts over minutes); the table gives the
25th-percentile time of each and what it adds to base, beside the LoRA's FLOPs at the 2048-square matmul rate
measured in the same run (the floor); what a path adds is the median over rounds of its time minus base's
in the same round. With --cold each layer's call is timed alone, after a 64 MB write that leaves nothing of the
path before it in the caches, the paths' order turning layer by layer; a step is then the sum over layers of each
layer's median (and what a path adds, of each layer's paired median): on a noisy 2-core VM a burst of noise moves
a few calls, where it moved whole steps by hundreds of ms (thirty-seventh session). Writes JSON (--out).

Usage:
    .venv/bin/python benchmarks/cpu_lora_prefill_bench.py [--segments 16] [--tokens 128] [--rank 16]
                                                          [--layers 1] [--lengths N ...] [--ranks R ...]
                                                          [--paths base fused shrink ...] [--cold]
                                                          [--baseline-source OLD.cpp ...]
                                                          [--shrink-baseline-source OLD_SGMV.cpp ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from loraplex.kernels import LoraBatch, LoraSegment, cpu_linear, cpu_lora_gemm, cpu_sgmv, torch_sgmv
from loraplex.kernels.cpu_build import baseline_builds
from loraplex.lora.types import TARGET_MODULES, LoraAdapter, LoraModuleWeights
from loraplex.unified_pager.adapter_pages import place_adapter, plan_adapter
from loraplex.unified_pager.geometry import PoolGeometry
from loraplex.unified_pager.pool import PagePool

from rounds import round_order
from roofline import matmul_gflops

H, KV, INTER, D = 576, 192, 1536, 64  # SmolLM2-135M: hidden, kv width, MLP width, pool row width
SHAPES = {0: (H, H), 1: (H, KV), 2: (H, KV), 3: (H, H), 4: (H, INTER), 5: (H, INTER), 6: (INTER, H)}  # (in, out)
# (modules, their column bounds in the fused output, input width): qkv, o, gate_up, down
PROJECTIONS = [((0, 1, 2), (0, H, H + KV, H + 2 * KV), H), ((3,), (0, H), H), ((4, 5), (0, INTER, 2 * INTER), H),
               ((6,), (0, H), INTER)]
ROWS_PER_PAGE = 96  # the engine's page for this model: a KV block of 16 tokens x 3 heads x (K, V)
FLUSH_BYTES = 64 << 20  # --cold: written before each call, twice the largest L3 of these machines (32 MB)


def random_adapter(name: str, rank: int, gen: torch.Generator, layers: int = 1) -> LoraAdapter:
    """rank on every module of every layer; weights scaled so that the deltas stay of order one."""
    mods = [LoraModuleWeights(layer, TARGET_MODULES[m], rank, 2.0, torch.randn(rank, i, generator=gen) / i**0.5,
                              torch.randn(o, rank, generator=gen) / rank**0.5)
            for layer in range(layers) for m, (i, o) in SHAPES.items()]
    return LoraAdapter(name=name, modules=tuple(mods), max_rank=rank)


def place_segments(adapters: list[LoraAdapter], lengths: list[int], layers: int, scatter: bool = False,
                   spare_pages: int = 0) -> tuple[PagePool, list[LoraSegment]]:
    """A pool of the default model's geometry holding `adapters` (and spare_pages more), and one segment of
    lengths[i] tokens per adapter, back to back from token 0. Each adapter on a run of consecutive pages, as a pool
    with free runs places it, or (scatter) on pages in random order."""
    geo = PoolGeometry(num_pages=1, row_width=D, rows_per_page=ROWS_PER_PAGE, block_size=16, num_layers=layers,
                       num_kv_heads=3, head_dim=64, dtype=torch.float32,
                       module_shapes=tuple(SHAPES[m] for m in range(len(TARGET_MODULES))))
    plans = [plan_adapter(geo, a) for a in adapters]
    pool = PagePool(dataclasses.replace(geo, num_pages=sum(p.num_pages for p in plans) + spare_pages),
                    torch.device("cpu"))
    free = list(range(pool.geometry.num_pages))
    if scatter:
        random.Random(0).shuffle(free)
    segments, start = [], 0
    for adapter, plan, n in zip(adapters, plans, lengths):
        pages, free = np.array(free[: plan.num_pages]), free[plan.num_pages:]
        segments.append(LoraSegment(start, n, place_adapter(pool, adapter.name, plan, pages)))
        start += n
    return pool, segments


def _alone(path: str) -> bool:
    """Whether a path runs without the GEMMs (the shrinks): what it adds is its own time."""
    return path == "shrink" or path.startswith("shrink:")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--segments", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128, help="tokens per segment")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--layers", type=int, default=1,
                    help="layers, each with its own weights and adapter rows, run per call (30: a step's)")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="each segment's tokens (instead of --segments x --tokens)")
    ap.add_argument("--ranks", type=int, nargs="+", default=None,
                    help="segment i's adapter has ranks[i %% len(ranks)] (default: --rank)")
    ap.add_argument("--paths", nargs="+", default=None,
                    help="which of base, blas, sgmv, fused, shrink to time (default: all; base always)")
    ap.add_argument("--scatter", action="store_true",
                    help="adapters on pages in random order (default: each on a run of consecutive pages, as a "
                         "pool with free runs places them)")
    ap.add_argument("--cold", action="store_true",
                    help="time each layer's call alone after a 64 MB write, as a step meets weights, adapters and x "
                         "(not left in cache by the path before it); the paths turn order layer by layer, and a "
                         "step's time is the sum over layers of each layer's median")
    ap.add_argument("--baseline-source", nargs="+", default=[],
                    help="other cpu_linear.cpp files (e.g. `git show REV:kernels/cpu_linear.cpp`): fused with each "
                         "one's GEMM and epilogue (a build from before the shrink moved inside it runs "
                         "cpu_sgmv.shrink first), timed as path 'baseline' (one file) or by file name in the same "
                         "rounds")
    ap.add_argument("--shrink-baseline-source", nargs="+", default=[],
                    help="other cpu_sgmv.cpp files: the shrink alone through each one's build, timed as path "
                         "'shrink:baseline' (one file) or 'shrink:<file name>' in the same rounds")
    ap.add_argument("--one-segment", action="store_true",
                    help="beside each fused path (fused and every --baseline-source build), '<name>:one': the same "
                         "tokens as one segment of the first adapter, in the same rounds, so that what the "
                         "segments cost (more adapters' rows, more pieces of rows) is a paired difference")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_lora_prefill.json"))
    args = ap.parse_args(argv)
    if not (cpu_linear.available() and cpu_sgmv.available()):
        raise SystemExit("needs the C++ kernels (kernels.cpu_build.build_error('cpu_linear' / 'cpu_sgmv'))")
    lengths = args.lengths or [args.tokens] * args.segments
    rank_cycle = args.ranks or [args.rank]
    ranks = [rank_cycle[i % len(rank_cycle)] for i in range(len(lengths))]
    if args.layers < 1 or min(lengths) < 1:
        ap.error("--layers and every segment length must be at least 1")
    gen = torch.Generator().manual_seed(0)
    adapters = [random_adapter(f"a{i}", r, gen, args.layers) for i, r in enumerate(ranks)]
    pool, segments = place_segments(adapters, lengths, args.layers, args.scatter, spare_pages=16)
    rows = pool.tensor.view(-1, D)
    T = sum(lengths)
    layers = range(args.layers)
    # [layer][projection]: the fused projection's weight [out, in], packed
    weights = [[cpu_linear.pack(torch.randn(b[-1], k, generator=gen) / k**0.5) for _, b, k in PROJECTIONS]
               for _ in layers]
    xs = [torch.randn(T, k, generator=gen) for _, _, k in PROJECTIONS]

    # Each path: one layer's projections, f(lora, layer); a step runs every layer.
    def base(lora: LoraBatch, layer: int) -> None:
        for w, x in zip(weights[layer], xs):
            cpu_linear.linear(x, w, None)

    def then_apply(apply):
        def run(lora: LoraBatch, layer: int) -> None:
            for (mods, b, _), w, x in zip(PROJECTIONS, weights[layer], xs):
                y = cpu_linear.linear(x, w, None)
                for m, lo, hi in zip(mods, b, b[1:]):
                    apply(y[:, lo:hi], x, layer, m, lora)
        return run

    def shrink_with(ext):  # the shrink as a pass of its own, from build ext
        def run(lora: LoraBatch, layer: int) -> None:
            parts = cpu_lora_gemm.split(lora, D)
            for (mods, b, _), x in zip(PROJECTIONS, xs):
                cpu_lora_gemm.shrink(x, rows, parts.fused, layer, cpu_lora_gemm.ModuleColumns(mods, b), ext)
        return run

    def fused_with(ext):  # the engine's path, with the GEMM and its epilogue from build ext (None: this checkout's)
        def run(lora: LoraBatch, layer: int) -> None:
            parts = cpu_lora_gemm.split(lora, D)
            for (mods, b, _), w, x in zip(PROJECTIONS, weights[layer], xs):
                cpu_lora_gemm.linear_lora(x, w, None, rows, parts.fused, layer, cpu_lora_gemm.ModuleColumns(mods, b),
                                          ext)
        return run

    calls = {"base": base,
             "blas": then_apply(lambda y, x, layer, m, lora: torch_sgmv.apply_segments(y, x, rows, lora.segments,
                                                                                        layer, m)),
             "sgmv": then_apply(lambda y, x, layer, m, lora: cpu_sgmv.apply_lora(y, x, rows, lora, layer, m)),
             "fused": fused_with(None),
             "shrink": shrink_with(None)}
    if args.paths is not None:
        unknown = set(args.paths) - set(calls)
        if unknown:
            ap.error(f"unknown paths {sorted(unknown)}: choose from {sorted(calls)}")
        calls = {name: f for name, f in calls.items() if name == "base" or name in args.paths}
    for name, ext in baseline_builds(args.baseline_source, "baseline_cpu_linear").items():
        calls[name] = fused_with(ext)
    for name, ext in baseline_builds(args.shrink_baseline_source, "baseline_cpu_sgmv").items():
        calls[f"shrink:{name}"] = shrink_with(ext)
    if args.one_segment:  # the fused paths again, every token in one segment of the first adapter
        one = LoraBatch((LoraSegment(0, T, segments[0].adapter),), T)
        for name in [n for n in calls if n not in ("base", "blas", "sgmv") and not _alone(n)]:  # fused, baselines
            calls[f"{name}:one"] = (lambda f: lambda lora, layer: f(one, layer))(calls[name])
    ceiling = matmul_gflops(2048, 3)
    # times[name][round][layer]: seconds. A round runs every path over every layer: a step at a time, the paths in
    # round_order; or (--cold) a layer at a time, each path's call after a flush, the paths' order turning by one
    # from layer to layer.
    times: dict[str, list[list[float]]] = {name: [] for name in calls}
    flush = torch.empty(FLUSH_BYTES // 4) if args.cold else None
    for rep in range(args.reps + 1):
        lora = LoraBatch(tuple(segments), T)  # per-step tables built outside the timing, as the runner does
        _ = lora.device_tensors
        parts = cpu_lora_gemm.split(lora, D)
        _ = parts.fused.device_tensors if parts.fused is not None else None
        took = {name: [0.0] * args.layers for name in calls}
        if args.cold:
            for layer in layers:
                order = list(calls)
                for name in order[layer % len(order):] + order[: layer % len(order)]:
                    flush.fill_(rep)
                    t = time.perf_counter()
                    calls[name](lora, layer)
                    took[name][layer] = time.perf_counter() - t
        else:
            for name, f in round_order(calls, rep):
                t = time.perf_counter()
                for layer in layers:
                    f(lora, layer)
                took[name][0] = time.perf_counter() - t  # the step as one time
        if rep:  # the first round warms every path
            for name in calls:
                times[name].append(took[name])
    step_s = {name: [sum(r) for r in rounds] for name, rounds in times.items()}
    q1 = {name: sorted(ts)[len(ts) // 4] for name, ts in step_s.items()}
    lora_flops = 2 * sum(n * r for n, r in zip(lengths, ranks)) * sum(i + o for i, o in SHAPES.values()) * args.layers
    floor_s = lora_flops / (ceiling * 1e9)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "scatter": args.scatter, "segments": len(lengths), "total_tokens": T, "lengths": lengths, "ranks": ranks,
              "layers": args.layers, "cold": args.cold,
              "ceiling_gflops": ceiling,
              "lora_gflop": lora_flops / 1e9, "floor_ms": floor_s * 1e3,
              "ms_q1": {k: v * 1e3 for k, v in q1.items()},
              "added_ms": {k: (v - (0 if _alone(k) else q1["base"])) * 1e3 for k, v in q1.items() if k != "base"},
              # each call against the base call of its own round: a drift between rounds cancels
              # shrink runs without the GEMMs: what it adds is its own time
              "added_paired_median_ms": {k: statistics.median(t - (0 if _alone(k) else b)
                                                              for t, b in zip(ts, step_s["base"])) * 1e3
                                         for k, ts in step_s.items() if k != "base"},
              "all_ms": {k: [t * 1e3 for t in ts] for k, ts in step_s.items()}}
    if args.cold:
        # Per layer the median over rounds, summed over the layers: a burst of noise moves a few calls, not a step.
        result["cold_step_ms"] = {k: sum(statistics.median(r[layer] for r in rounds) for layer in layers) * 1e3
                                  for k, rounds in times.items()}
        result["cold_added_ms"] = {k: sum(statistics.median(r[layer] - (0 if _alone(k) else rb[layer])
                                                            for r, rb in zip(rounds, times["base"]))
                                          for layer in layers) * 1e3
                                   for k, rounds in times.items() if k != "base"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{len(lengths)} segments, {T} tokens, ranks {sorted(set(ranks))}, {args.layers} layer(s) (7 modules each); "
          f"LoRA {lora_flops / 1e9:.2f} GFLOP = {floor_s * 1e3:.2f} ms at {ceiling:.0f} GFLOP/s")
    if args.cold:
        step_ms, added_ms = result["cold_step_ms"], result["cold_added_ms"]
        print("| path | ms a step (per layer the median, summed) | added to base, ms (per layer the median of "
              "same-round pairs, summed) | added / floor |")
    else:
        step_ms, added_ms = result["ms_q1"], result["added_paired_median_ms"]
        print("| path | ms (25th pct) | added to base, ms (median of same-round pairs) | added / floor |")
    print("|---|---|---|---|")
    for name, t in step_ms.items():
        if name == "base":
            print(f"| base | {t:.2f} | | |")
            continue
        print(f"| {name} | {t:.2f} | {added_ms[name]:.2f} | {added_ms[name] / (floor_s * 1e3):.2f} |")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
