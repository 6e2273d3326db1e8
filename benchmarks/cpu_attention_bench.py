"""Paged attention per layer call on the CPU: the torch path against the C++ kernel.

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, block_size 16, float32). Decode: B
sequences of one new token at each context length; prefill: chunks through the kernel's tiles
against the torch path's per-sequence SDPA. Each layer call reads its own layer's pages
(scattered, as the pager hands them out) and the layers are visited in turn, so that, as in a
model step, a layer's K/V is not left in cache by the call before; the pool is sized past the L3
cache for the same reason.

Bandwidth: K/V bytes a call must read (every cached token's K and V of every sequence, once)
over its time, next to a streaming read measured in the same run (roofline.measure_roofline).

--baseline-source FILE builds FILE (an earlier cpu_attention.cpp, e.g. from `git show
REV:kernels/cpu_attention.cpp > /tmp/old.cpp`) beside the current kernel and times the two alternating,
rep by rep, in one process: across processes this CPU's speed moves by as much as a kernel change gains.

Writes JSON (--out) and prints a table. Usage:
    python benchmarks/cpu_attention_bench.py [--batch 64] [--contexts 128 2048] [--threads 2]
                                             [--reps 5] [--baseline-source FILE]
                                             [--out benchmarks/results/cpu_attention.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from loraplex.kernels import AttentionMetadata, cpu_attention, cpu_build, torch_attention

from roofline import measure_roofline

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
POOL_TARGET_BYTES = 600 << 20  # past this machine's 300 MiB L3
MAX_LAYERS = 30  # the model's


def make_step(seqs: list[tuple[int, int]], layers: int, gen: torch.Generator
              ) -> tuple[torch.Tensor, AttentionMetadata, torch.Tensor]:
    """(kv_pool [P, 2, bs, kvh, hd] random, metadata on scattered pages, q [T, H, hd] as a strided
    slice of a fused qkv) for sequences of (cached tokens, new tokens) in `layers` layers."""
    nbs = [-(-(c + q) // BLOCK) for c, q in seqs]
    per_layer = sum(nbs)
    pages = per_layer * layers
    kv_pool = torch.randn(pages, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    tables = layout_tables(nbs, layers, "scattered", gen)
    positions = torch.cat([torch.arange(c, c + q) for c, q in seqs])
    seq_of = torch.cat([torch.full((q,), s) for s, (_, q) in enumerate(seqs)])
    qs = [0]
    for _, q in seqs:
        qs.append(qs[-1] + q)
    meta = AttentionMetadata(
        block_size=BLOCK,
        positions=positions,
        query_start=torch.tensor(qs, dtype=torch.int32),
        seq_lens=torch.tensor([c + q for c, q in seqs], dtype=torch.int32),
        block_tables=tables,
        slot_pages=tables[:, seq_of, positions // BLOCK].long(),
        slot_offsets=positions % BLOCK,
        query_lens_host=tuple(q for _, q in seqs),
        seq_lens_host=tuple(c + q for c, q in seqs),
    )
    t = positions.numel()
    fused = torch.randn(t, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen)
    return kv_pool, meta, fused[:, :HEADS]


LAYOUTS = ("scattered", "block-major", "layer-major")


def layout_tables(nbs: list[int], layers: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """[layers, S, max(nbs)] int32 block tables over sum(nbs) * layers pages. scattered: every page at random
    (a pool after much churn); block-major: a sequence's pages one run, a block's layers adjacent (the pager's
    layout before the forty-fifth session); layer-major: a sequence's pages one run, a layer's blocks adjacent
    (the pager's layout for the blocks one allocation takes)."""
    pages = sum(nbs) * layers
    tables = torch.zeros(layers, len(nbs), max(nbs), dtype=torch.int32)
    perm = torch.randperm(pages, generator=gen).to(torch.int32)
    at = 0
    for s, nb in enumerate(nbs):
        for layer in range(layers):
            if layout == "scattered":
                tables[layer, s, :nb] = perm[at + layer * nb : at + (layer + 1) * nb]
            elif layout == "block-major":
                tables[layer, s, :nb] = torch.arange(nb, dtype=torch.int32) * layers + at + layer
            elif layout == "layer-major":
                tables[layer, s, :nb] = torch.arange(nb, dtype=torch.int32) + at + layer * nb
            else:
                raise ValueError(f"layout {layout!r} is not one of {', '.join(LAYOUTS)}")
        at += nb * layers
    return tables


def layers_for(seqs: list[tuple[int, int]]) -> int:
    per_layer = sum(-(-(c + q) // BLOCK) for c, q in seqs) * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4
    return max(1, min(MAX_LAYERS, -(-POOL_TARGET_BYTES // per_layer)))


def time_per_call(fns: dict[str, Callable[[int], object]], layers: int, reps: int) -> dict[str, dict]:
    """ms per layer call of each fn: each rep calls every layer once with each fn in turn; median and best
    over reps."""
    for fn in fns.values():
        for layer in range(layers):  # warm-up: per-step plans, first touch
            fn(layer)
    per: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for layer in range(layers):
                fn(layer)
            per[name].append((time.perf_counter() - t0) / layers * 1e3)
    return {name: {"median_ms": statistics.median(p), "best_ms": min(p)} for name, p in per.items()}


def kv_bytes(seqs: list[tuple[int, int]]) -> int:
    return sum(c + q for c, q in seqs) * 2 * KV_HEADS * HEAD_DIM * 4


def bench_case(name: str, seqs: list[tuple[int, int]], reps: int, gen: torch.Generator, baseline=None) -> dict:
    layers = layers_for(seqs)
    kv_pool, meta, q = make_step(seqs, layers, gen)
    scale = HEAD_DIM**-0.5
    ext = cpu_attention.extension()
    tiles = cpu_attention.kernel_tiles(meta, HEADS // KV_HEADS)

    def ours(layer: int) -> torch.Tensor:
        out = torch.empty(q.shape)
        ext.paged_attention(out, q, kv_pool, meta.block_tables[layer], tiles, scale)
        return out

    def theirs(layer: int) -> torch.Tensor:
        return torch_attention.paged_attention(q, kv_pool, meta, layer, scale)

    def before(layer: int) -> torch.Tensor:
        out = torch.empty(q.shape)
        baseline.paged_attention(out, q, kv_pool, meta.block_tables[layer], tiles, scale)
        return out

    err = (ours(0) - theirs(0)).abs().max().item()
    res = {"case": name, "seqs": len(seqs), "tokens": meta.num_tokens, "layers_cycled": layers,
           "kv_mib_per_call": kv_bytes(seqs) / 2**20, "max_abs_diff": err,
           "torch": time_per_call({"torch": theirs}, layers, reps)["torch"]}
    if baseline is not None:
        res["baseline_max_abs_diff"] = (ours(0) - before(0)).abs().max().item()
        res.update(time_per_call({"cpp": ours, "baseline": before}, layers, reps))
    else:
        res.update(time_per_call({"cpp": ours}, layers, reps))
    for k in ("torch", "cpp", "baseline"):
        if k in res:
            res[k]["kv_gbps"] = kv_bytes(seqs) / (res[k]["median_ms"] * 1e-3) / 1e9
    res["speedup"] = res["torch"]["median_ms"] / res["cpp"]["median_ms"]
    return res


def layout_case(name: str, seqs: list[tuple[int, int]], reps: int, gen: torch.Generator) -> dict:
    """The kernel over the same K/V with each of LAYOUTS' block tables, alternating rep by rep."""
    layers = layers_for(seqs)
    kv_pool, meta, q = make_step(seqs, layers, gen)
    nbs = [-(-(c + n) // BLOCK) for c, n in seqs]
    scale = HEAD_DIM**-0.5
    ext = cpu_attention.extension()
    tiles = cpu_attention.kernel_tiles(meta, HEADS // KV_HEADS)
    fns = {}
    for layout in LAYOUTS:
        tables = layout_tables(nbs, layers, layout, gen)

        def run(layer: int, tables: torch.Tensor = tables) -> torch.Tensor:
            out = torch.empty(q.shape)
            ext.paged_attention(out, q, kv_pool, tables[layer], tiles, scale)
            return out

        fns[layout] = run
    res = {"case": name, "seqs": len(seqs), "layers_cycled": layers, "kv_mib_per_call": kv_bytes(seqs) / 2**20,
           "layouts": time_per_call(fns, layers, reps)}
    for r in res["layouts"].values():
        r["kv_gbps"] = kv_bytes(seqs) / (r["median_ms"] * 1e-3) / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--contexts", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-prefill", action="store_true", help="decode cases only")
    ap.add_argument("--baseline-source", type=Path, default=None,
                    help="an earlier cpu_attention.cpp, timed alternating with the current kernel")
    ap.add_argument("--layouts", action="store_true",
                    help="instead: the decode cases over each block-table layout (scattered, block-major, layer-major)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cpu_attention.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    if cpu_attention.extension() is None:
        raise SystemExit(f"cpu_attention extension unavailable: {cpu_build.build_error(cpu_attention.STEM)}")
    load_s = time.perf_counter() - t0  # the build, on a machine without a cached one

    gen = torch.Generator().manual_seed(0)
    cases = [(f"decode B={args.batch} ctx={c}", [(c - 1, 1)] * args.batch) for c in args.contexts]
    if not args.no_prefill:
        cases += [
            ("prefill 1x512 ctx=0", [(0, 512)]),
            ("prefill 1x256 ctx=1024", [(1024, 256)]),
            ("prefill 8x32 ctx=96", [(96, 32)] * 8),
            (f"mixed {args.batch - 1} decode ctx=128 + 1x256", [(127, 1)] * (args.batch - 1) + [(0, 256)]),
        ]
    if args.layouts:
        roof = measure_roofline()
        results = [layout_case(name, seqs, args.reps, gen) for name, seqs in cases if name.startswith("decode")]
        report = {"threads": args.threads, "roofline": roof.as_dict(), "layout_cases": results}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(f"threads {args.threads}; streaming read {roof.read_gbps:.1f} GB/s")
        print(f"{'case':<28} " + " ".join(f"{lay + ' ms':>15} {'GB/s':>6}" for lay in LAYOUTS))
        for r in results:
            print(f"{r['case']:<28} " + " ".join(f"{r['layouts'][lay]['median_ms']:15.3f} {r['layouts'][lay]['kv_gbps']:6.1f}"
                                                 for lay in LAYOUTS))
        print(f"wrote {args.out}")
        return
    baseline = cpu_build.compile_source(args.baseline_source, "baseline_cpu_attention") if args.baseline_source else None
    roof = measure_roofline()
    results = [bench_case(name, seqs, args.reps, gen, baseline) for name, seqs in cases]
    report = {"threads": args.threads, "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                                  "block_size": BLOCK, "dtype": "float32"},
              "extension_load_s": load_s, "roofline": roof.as_dict(), "cases": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))

    print(f"threads {args.threads}; streaming read {roof.read_gbps:.1f} GB/s; extension load {load_s:.1f} s")
    print(f"{'case':<40} {'torch ms':>9} {'C++ ms':>8} {'speedup':>8} {'torch GB/s':>10} {'C++ GB/s':>9} {'of read':>8}")
    for r in results:
        print(f"{r['case']:<40} {r['torch']['median_ms']:9.3f} {r['cpp']['median_ms']:8.3f} {r['speedup']:7.2f}x "
              f"{r['torch']['kv_gbps']:10.1f} {r['cpp']['kv_gbps']:9.1f} {r['cpp']['kv_gbps'] / roof.read_gbps:7.0%}"
              + (f"   baseline {r['baseline']['median_ms']:.3f} ms, {r['baseline']['kv_gbps']:.1f} GB/s, "
                 f"differs by {r['baseline_max_abs_diff']:.3g}" if "baseline" in r else ""))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
