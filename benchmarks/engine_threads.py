"""Which threads run torch work beside a CPU engine, and what it does to the engine's decode steps.

libgomp spins at its barriers only while the threads it manages do not outnumber the CPUs; torch gives
every thread that runs a parallel op a team of its own. A second team (an engine stepped on another
thread than the one that built it; an adapter load on a prefetch thread) then makes every parallel region
of every later step sleep and wake (kernels/cpu_threads.py). Each scenario runs in a fresh process (the
teams last as long as their threads), in alternating order over --rounds:

    main              built and stepped on the main thread (LLM, the benchmarks)
    other-thread      built on the main thread, stepped on another (the server before AsyncEngine built its own)
    own-thread        built and stepped on one other thread (AsyncEngine(config) now)
    load-beside       stepped on the main thread after an adapter load on a prefetch thread, unconfined
    load-confined     the same, the prefetch thread confined to one thread (HostCache now)

Reported: the median decode step of --batch requests (--context tokens of prompt), --steps steps.

    .venv/bin/python benchmarks/engine_threads.py [--rounds 2] [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SCENARIOS = ("main", "other-thread", "own-thread", "load-beside", "load-confined")
_KEEP: list[ThreadPoolExecutor] = []


def _engine(model: str, threads: int):
    import torch
    from loraplex.config import EngineConfig
    from loraplex.engine import EngineCore

    torch.set_num_threads(threads)
    return EngineCore(EngineConfig(model=model, dtype="float32", device="cpu", pool_bytes=512 << 20, max_lora_rank=64))


def _decode_steps(eng, batch: int, context: int, steps: int) -> float:
    import torch
    from loraplex.engine import SamplingParams

    cfg = eng.model_config
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, cfg.vocab_size, (batch, context), generator=g).tolist()
    reqs = [eng.add_request(p, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)) for p in prompts]
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in reqs):
        eng.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    for r in reqs:
        eng.abort_request(r.request_id)
    return statistics.median(times)


def _load_beside(eng, folder: Path, confined: bool) -> None:
    from loraplex.kernels.cpu_threads import confine_to_one_thread
    from loraplex.unified_pager import load_packed_folder

    def load():
        if confined:
            confine_to_one_thread()
        return load_packed_folder("a", folder, eng.model_config, 64, eng.pager.geometry.row_layout)

    # The pool stays up, as the host cache's does: a team lasts as long as its thread.
    pool = ThreadPoolExecutor(1)
    pool.submit(load).result()
    _KEEP.append(pool)


def run_scenario(name: str, model: str, threads: int, batch: int, context: int, steps: int, adapter: Path) -> float:
    """One scenario in this process: the median decode step, seconds."""
    if name in ("own-thread", "other-thread"):
        with ThreadPoolExecutor(1) as pool:
            eng = pool.submit(_engine, model, threads).result() if name == "own-thread" else _engine(model, threads)
            return pool.submit(_decode_steps, eng, batch, context, steps).result()
    eng = _engine(model, threads)
    _decode_steps(eng, batch, context, 4)  # the main thread's team exists before the load beside it
    if name != "main":
        _load_beside(eng, adapter, confined=name == "load-confined")
    return _decode_steps(eng, batch, context, steps)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--work-dir", default="/tmp/loraplex-engine-threads")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_threads.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)  # run one scenario, print its step time
    args = ap.parse_args(argv)
    adapter = Path(args.work_dir) / "adapters" / "a-r16"
    if args.child:
        print(run_scenario(args.child, args.model, args.threads, args.batch, args.context, args.steps, adapter))
        return {}
    sys.path.insert(0, str(Path(__file__).parent))
    from e2e.workload import ensure_adapters
    from loraplex.config import default_cache_dir
    from loraplex.models.config import load_model_config
    from loraplex.models.default_model import resolve_model_path

    cfg = load_model_config(resolve_model_path(args.model, default_cache_dir()))
    ensure_adapters(adapter.parent, cfg, [adapter.name])
    steps: dict[str, list[float]] = {s: [] for s in args.scenarios}
    for r in range(args.rounds):
        for name in (args.scenarios if r % 2 == 0 else list(reversed(args.scenarios))):
            cmd = [sys.executable, __file__, "--child", name, "--model", args.model, "--threads", str(args.threads),
                   "--batch", str(args.batch), "--context", str(args.context), "--steps", str(args.steps),
                   "--work-dir", args.work_dir]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            steps[name].append(float(out.strip().splitlines()[-1]))
            print(f"  {name}: {steps[name][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads, "batch": args.batch,
              "context": args.context, "steps": args.steps, "step_ms": {k: [v * 1e3 for v in vs] for k, vs in steps.items()}}
    base = statistics.mean(steps["main"]) if "main" in steps else None
    print(f"decode step, B={args.batch}, context {args.context}, {args.threads} threads (median of {args.steps} steps, "
          f"each run in a fresh process)")
    print("| scenario | step ms, each round | vs main |\n|---|---|---|")
    for name, vs in steps.items():
        rel = f"{statistics.mean(vs) / base:.2f}" if base else "-"
        print(f"| {name} | {', '.join(f'{v * 1e3:.1f}' for v in vs)} | {rel} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
