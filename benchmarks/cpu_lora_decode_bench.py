"""Decode LoRA on the CPU: one decode step's adapter work on the default model's 30 layers, against the read floor.

A decode batch of `--batch` tokens over `--adapters` adapters (ranks from `--ranks`, in turn; tokens dealt to
the adapters in turn, so each segment holds batch / adapters tokens or one more; or `--lengths`, each adapter's
tokens as a step of the engine's held them), every adapter on all 7
modules of all 30 layers, placed on the unified pool's pages. One step is what the engine's decode step calls
for LoRA: per layer, cpu_sgmv.apply_lora_group on the qkv, o, gate/up and down projections' outputs. The
step's floor is the adapter bytes it reads (every A^T and B^T once) over the read bandwidth measured in the
same run (a sum over a 512 MiB tensor); a second reference is a plain read of the same pool pages
(torch.sum over them), which pays the pool's page layout and nothing else.

With --with-gemm the step also runs as the engine's decode step runs it: each projection's packed GEMM
(cpu_linear, random weights of the layer's shapes, every layer its own, so that they stream from memory as the
model's do) and then its LoRA, as path 'gemm+sgmv', beside the GEMMs alone ('gemm'). What gemm+sgmv adds to
gemm (the median of same-round differences) is the LoRA's cost inside a step: the GEMMs' weight stream takes the
cache and the memory's bandwidth from it, where 'sgmv' alone runs after other steps of its own.

With --baseline-source (other cpu_sgmv.cpp files, e.g. `git show REV:kernels/cpu_sgmv.cpp`) their builds run
the same step as path 'baseline' (or each under its file name). The paths alternate, step by step, in one
process (this CPU's speed drifts over minutes), and the table gives each one's 25th-percentile step time.
Writes JSON (--out).

Usage:
    .venv/bin/python benchmarks/cpu_lora_decode_bench.py [--batch 64] [--adapters 30 | --lengths 1 1 2 7 ...]
                                                       [--ranks 8 16] [--reps 30]
                                                       [--threads N] [--with-gemm] [--baseline-source OLD.cpp ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from loraplex.kernels import LoraBatch, cpu_linear, cpu_sgmv
from loraplex.kernels.cpu_build import baseline_builds

from cpu_lora_prefill_bench import D, PROJECTIONS, SHAPES, place_segments, random_adapter
from rounds import round_order
from roofline import measure_roofline

LAYERS = 30  # SmolLM2-135M (--layers: fewer, so that the adapters fit in cache and the arithmetic shows)


def segment_lengths(batch: int, adapters: int) -> list[int]:
    """Tokens per adapter when batch tokens are dealt to the adapters in turn (an adapter may get none)."""
    return [batch // adapters + (1 if i < batch % adapters else 0) for i in range(adapters)]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=30)
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16], help="adapter i has ranks[i %% len(ranks)]")
    ap.add_argument("--lengths", type=int, nargs="+", default=None,
                    help="tokens of each adapter's segment (a step as the engine met it; e.g. the scaling runs' "
                         "uneven popularity), instead of --batch dealt to --adapters")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--with-gemm", action="store_true",
                    help="also time each layer's packed GEMMs, alone and each followed by its LoRA")
    ap.add_argument("--baseline-source", nargs="+", default=[],
                    help="other cpu_sgmv.cpp files: the same step through each one's build, as path 'baseline' "
                         "(one file) or by file name")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_lora_decode.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_sgmv.available():
        raise SystemExit("needs the C++ kernel (kernels.cpu_build.build_error('cpu_sgmv'))")
    if args.with_gemm and not cpu_linear.available():
        raise SystemExit("--with-gemm needs the packed GEMM (kernels.cpu_build.build_error('cpu_linear'))")
    gen = torch.Generator().manual_seed(int(time.time()))
    if args.lengths is not None:
        if min(args.lengths) < 1:
            ap.error("--lengths: every segment holds a token or more")
        args.batch, args.adapters = sum(args.lengths), len(args.lengths)
    lengths = args.lengths or [n for n in segment_lengths(args.batch, args.adapters) if n]
    adapters = [random_adapter(f"a{i}", args.ranks[i % len(args.ranks)], gen, args.layers) for i in range(len(lengths))]
    pool, segments = place_segments(adapters, lengths, args.layers)  # each on a run of pages, as a fresh pool places it
    rows = pool.tensor.view(-1, D)
    adapter_bytes = sum(a.max_rank * sum(i + o for i, o in SHAPES.values()) * args.layers * 4 for a in adapters)
    lora = LoraBatch(tuple(segments), args.batch)
    _ = lora.device_tensors
    xs = {k: torch.randn(args.batch, k, generator=gen) for k in {k for _, _, k in PROJECTIONS}}
    ys = [torch.zeros(args.batch, b[-1]) for _, b, _ in PROJECTIONS]

    def step_with(ext):
        def run() -> None:
            for layer in range(args.layers):
                for (mods, b, k), y in zip(PROJECTIONS, ys):
                    cpu_sgmv.apply_lora_group(y, xs[k], rows, lora, layer, mods, b, ext)
        return run

    def plain_read() -> None:  # the same pages, summed: the pool layout's own floor
        pool.tensor.sum()

    calls = {"sgmv": step_with(None), "read": plain_read}
    if args.with_gemm:
        # [layer][projection]: the fused projection's weight [out, in], packed
        weights = [[cpu_linear.pack(torch.randn(b[-1], k, generator=gen) / k**0.5) for _, b, k in PROJECTIONS]
                   for _ in range(args.layers)]

        def gemm_step(lora_too: bool):
            def run() -> None:
                for layer in range(args.layers):
                    for (mods, b, k), w in zip(PROJECTIONS, weights[layer]):
                        y = cpu_linear.linear(xs[k], w, None)
                        if lora_too:
                            cpu_sgmv.apply_lora_group(y, xs[k], rows, lora, layer, mods, b)
            return run

        calls["gemm"], calls["gemm+sgmv"] = gemm_step(False), gemm_step(True)
    for name, ext in baseline_builds(args.baseline_source, "baseline_cpu_sgmv").items():
        calls[name] = step_with(ext)
    roof = measure_roofline()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(args.reps + 1):
        for name, f in round_order(calls, rep):
            t = time.perf_counter()
            f()
            if rep:  # the first round warms every path
                times[name].append(time.perf_counter() - t)
    q1 = {name: sorted(ts)[len(ts) // 4] for name, ts in times.items()}
    # what the LoRA adds to the GEMMs: the median of same-round differences
    added = {"gemm+sgmv": statistics.median(a - b for a, b in zip(times["gemm+sgmv"], times["gemm"]))} \
        if args.with_gemm else {}
    floor_s = adapter_bytes / (roof.read_gbps * 1e9)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "batch": args.batch, "layers": args.layers, "adapters": len(adapters), "ranks": args.ranks,
              "segment_lengths": lengths,
              "adapter_mb": adapter_bytes / 1e6, "read_gbps": roof.read_gbps, "floor_ms": floor_s * 1e3,
              "ms_q1": {k: v * 1e3 for k, v in q1.items()},
              "gbps": {k: adapter_bytes / v / 1e9 for k, v in q1.items()},
              "added_to_gemm_ms": {k: v * 1e3 for k, v in added.items()},
              "all_ms": {k: [t * 1e3 for t in ts] for k, ts in times.items()}}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"decode step, {args.batch} tokens over {len(adapters)} adapters of ranks {args.ranks}, {args.layers} layers "
          f"x 7 modules: {adapter_bytes / 1e6:.0f} MB of adapters, floor {floor_s * 1e3:.2f} ms "
          f"at {roof.read_gbps:.1f} GB/s")
    print("| path | ms (25th pct) | GB/s of adapter bytes | / floor |")
    print("|---|---|---|---|")
    for name, t in q1.items():
        if name in ("gemm", "gemm+sgmv"):
            continue
        print(f"| {name} | {t * 1e3:.2f} | {adapter_bytes / t / 1e9:.1f} | {t / floor_s:.2f} |")
    for name, t in added.items():
        print(f"| {name} - gemm ({q1['gemm'] * 1e3:.2f} ms alone) | {t * 1e3:.2f} | {adapter_bytes / t / 1e9:.1f} | "
              f"{t / floor_s:.2f} |")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
