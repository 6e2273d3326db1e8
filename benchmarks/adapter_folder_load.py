"""Loading a PEFT adapter folder into packed pool rows: load_packed_folder, with and without pack plans,
against load-then-pack.

The path of every host-cache miss of an adapter kept as a folder (the e2e scaling benchmark's store):
read the safetensors file, check it against the model, pack it into the pool's row layout.
"load_then_pack" is load_peft_adapter (its own NaN/Inf pass over the weights) followed by pack_adapter;
"packed" is unified_pager.load_packed_folder, whose NaN/Inf check rides on the packing copy;
"planned" is the same with PackPlans (unified_pager.pack_plan), as the engine and the scaling benchmark
load: every adapter here has one shape, so all but the first load of the run use the plan. All three
run in one process, alternating adapter by adapter (and their order, round by round), so that a
CPU whose speed drifts affects them alike; their packed rows are checked equal first.
The first round is a warm-up (file pages, allocator, kernel build) and is not counted.

Writes JSON (--out) and prints a table. Usage:
    python benchmarks/adapter_folder_load.py [--adapters 12] [--rounds 8] [--rank 16] [--threads 2]
        [--out benchmarks/results/adapter_folder_load.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from loraplex.config import default_cache_dir
from loraplex.lora.peft_loader import load_peft_adapter
from loraplex.models.config import load_model_config
from loraplex.models.default_model import resolve_model_path
from loraplex.unified_pager import PackPlans, RowLayout, load_packed_folder, pack_adapter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e.workload import ensure_adapters  # noqa: E402

PATHS = ("load_then_pack", "packed", "planned")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--adapters", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default="default", help="checkpoint folder (default: the default model)")
    ap.add_argument("--work-dir", type=Path, default=None, help="adapter folders (default: a cache folder)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "adapter_folder_load.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_model_config(resolve_model_path(args.model, default_cache_dir()))
    work = args.work_dir or default_cache_dir() / "bench-adapter-folders"
    folders = ensure_adapters(work, cfg, [f"load{i}-r{args.rank}" for i in range(args.adapters)])
    layout = RowLayout.for_model(cfg, torch.float32)
    plans = PackPlans(cfg, max(64, args.rank), layout)

    def load(path: str, name: str, folder: Path):
        if path in ("packed", "planned"):
            return load_packed_folder(name, folder, cfg, max(64, args.rank), layout,
                                      plans=plans if path == "planned" else None)
        return pack_adapter(load_peft_adapter(name, folder, cfg, max(64, args.rank)), layout)

    first = [load(p, *next(iter(folders.items()))) for p in PATHS]
    load("planned", *next(iter(folders.items())))  # the plan's first use
    assert all(torch.equal(first[0].packed.rows, f.packed.rows) for f in first), "the paths packed different rows"
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    for r in range(args.rounds + 1):
        for name, folder in folders.items():
            for path in PATHS if r % 2 else PATHS[::-1]:  # mirrored order, round by round
                t = time.perf_counter()
                adapter = load(path, name, folder)
                if r:
                    times[path].append(time.perf_counter() - t)
                del adapter
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "threads": args.threads,
        "torch": torch.__version__, "rank": args.rank, "adapters": args.adapters, "rounds": args.rounds,
        "adapter_mb": first[0].nbytes / 1e6, "plan_hits": plans.hits, "plan_misses": plans.misses,
        "ms": {p: {"median": 1e3 * statistics.median(v), "mean": 1e3 * statistics.mean(v),
                   "p90": 1e3 * sorted(v)[int(0.9 * (len(v) - 1))]} for p, v in times.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"| path | median ms | mean ms | p90 ms |  ({result['adapter_mb']:.1f} MB rank-{args.rank} adapters, "
          f"{args.adapters} x {args.rounds} loads each)")
    print("|---|---|---|---|")
    for p, s in result["ms"].items():
        print(f"| {p} | {s['median']:.1f} | {s['mean']:.1f} | {s['p90']:.1f} |")
    return result


if __name__ == "__main__":
    main()
