"""What EngineConfig.kv_reserve_tokens does to decode steps: two engines of one model stepped in turn, one taking KV
blocks one at a time (0), one reserving --reserve tokens ahead, over the same requests.

A decoding sequence opens a block every block_size tokens; taken one at a time, its blocks of a layer lie one page
every few hundred (UnifiedPager.allocate_kv), and the decode attention reads them scattered. The requests start from
short prompts (--prompt tokens) so that most of their KV is made by decoding. Both engines must produce the same
tokens (checked); the steps are timed in quarters of --steps, each quarter's median and the median of the paired
differences (this engine's step minus the other's, step by step).

    .venv/bin/python benchmarks/kv_reserve.py [--batch 64] [--prompt 16] [--steps 400] [--reserve 64]
                                              [--model DIR] [--out benchmarks/results/kv_reserve.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from loraplex.config import EngineConfig
from loraplex.engine import EngineCore, SamplingParams


def make_engine(model: str, batch: int, prompt: int, steps: int, reserve: int, pool_mib: int) -> EngineCore:
    """An engine holding `batch` greedy requests of `prompt` random tokens that decode for `steps` tokens or more."""
    engine = EngineCore(EngineConfig(model=model, dtype="float32", device="cpu", pool_bytes=pool_mib << 20,
                                     max_num_seqs=batch, kv_reserve_tokens=reserve))
    engine.warmup()
    g = torch.Generator().manual_seed(7)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for p in torch.randint(3, vocab, (batch, prompt), generator=g).tolist():
        engine.add_request(p, params, None)
    return engine


def run(model: str, batch: int, prompt: int, steps: int, reserve: int, pool_mib: int) -> dict:
    engines = {"one at a time": make_engine(model, batch, prompt, steps, 0, pool_mib),
               f"reserve {reserve}": make_engine(model, batch, prompt, steps, reserve, pool_mib)}
    ms: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(steps):
        outs = {}
        for name, engine in engines.items():
            t0 = time.perf_counter()
            o = engine.step()
            ms[name].append((time.perf_counter() - t0) * 1e3)
            outs[name] = sorted((x.request_id, tuple(x.new_token_ids)) for x in o)
        a, b = outs.values()
        if a != b:
            raise RuntimeError("the two engines produced different tokens")
    base, ours = ms.values()
    q = max(1, steps // 4)
    quarters = []
    for lo in range(0, q * (steps // q), q):
        d = [x - y for x, y in zip(ours[lo:lo + q], base[lo:lo + q])]
        quarters.append({"steps": [lo, lo + q], "one_at_a_time_ms": statistics.median(base[lo:lo + q]),
                         "reserve_ms": statistics.median(ours[lo:lo + q]), "paired_ms": statistics.median(d),
                         "faster_in": sum(x < 0 for x in d), "of": len(d)})
    return {"batch": batch, "prompt": prompt, "steps": steps, "reserve": reserve, "same_tokens": True,
            "kv_reserved_pages_at_end": {name: e.pager.stats().kv_reserved_pages for name, e in engines.items()},
            "quarters": quarters, "step_ms": ms}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="checkpoint folder (default: the default model)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--reserve", type=int, default=64, help="kv_reserve_tokens of the second engine")
    ap.add_argument("--pool-mib", type=int, default=3072)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kv_reserve.json")
    args = ap.parse_args(argv)
    res = run(args.model, args.batch, args.prompt, args.steps, args.reserve, args.pool_mib)
    res["torch"] = torch.__version__
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2))
    print(f"B={args.batch}, {args.prompt}-token prompts, {args.steps} steps; the same tokens from both engines")
    print("| steps | one at a time, ms | reserve %d, ms | paired, ms (faster in) |" % args.reserve)
    print("|---|---|---|---|")
    for r in res["quarters"]:
        print(f"| {r['steps'][0]}-{r['steps'][1]} | {r['one_at_a_time_ms']:.1f} | {r['reserve_ms']:.1f} | "
              f"{r['paired_ms']:+.2f} ({r['faster_in']} of {r['of']}) |")
    print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
