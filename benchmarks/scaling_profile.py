"""Where the adapter-scaling sweep's extra time goes: each adapter count's runs split by call, as offline_profile.py
splits an offline run.

The e2e harness's scaling part (e2e/scaling.py) gives each count's wall and its loss against the floor; this runs the
same workloads (the preset's trace regenerated with each count, adapters fed through the host cache as the sweep
feeds them, one engine for all runs) with the engine's calls timed (offline_profile.Timers: gemm, gemm_lora,
apply_lora_group, attention, the pointwise ops, other; split by prefill and decode steps) and the host cache's load
seconds beside them. The counts run in mirrored rounds (1 100 1000 1000 100 1 ...), and every count is compared with
the first, round by round: the paired differences of the wall, of each kind of step and of each call are what the
extra adapters cost, and where.

    .venv/bin/python benchmarks/scaling_profile.py [--preset quick] [--counts 1 100 1000] [--rounds 4]
                                                   [--work-dir DIR] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

_BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(_BENCH))

import torch  # noqa: E402

from e2e.run import PRESETS, MiB, engine_config, scaling_engine_config, trace_spec  # noqa: E402
from e2e.scaling import learn_plans, mirrored, pack_plans, run_one, scaling_workloads  # noqa: E402
from loraplex.engine import EngineCore  # noqa: E402
from offline_profile import CALLS, KINDS, Timers, timed_engine  # noqa: E402

COLUMNS = (*CALLS, "other", "step")


def _paired(runs: dict[int, list[dict]], n: int, ref: int, value) -> float:
    """The median over rounds of value(run of n) - value(run of ref) in the same round."""
    return statistics.median(value(a) - value(b) for a, b in zip(runs[n], runs[ref]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="quick", choices=sorted(PRESETS))
    ap.add_argument("--model", default="default", help="a checkpoint folder (default: the packaged default model)")
    ap.add_argument("--counts", type=int, nargs="+", default=None,
                    help="adapter counts, the first the reference (default: the preset's scaling counts)")
    ap.add_argument("--rounds", type=int, default=4, help="mirrored rounds over the counts")
    ap.add_argument("--seed", type=int, default=0, help="the trace's (the e2e harness's default)")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/lp-scaling-profile"),
                    help="where the traces' adapters are written (reused across runs)")
    ap.add_argument("--out", type=Path, default=_BENCH / "results" / "scaling_profile.json")
    args = ap.parse_args(argv)
    p = PRESETS[args.preset]
    counts = list(args.counts or p.scaling_counts)
    if args.rounds < 1 or len(counts) < 2 or min(counts) < 1 or len(set(counts)) != len(counts):
        ap.error("--rounds must be at least 1, --counts two or more distinct counts of at least 1")
    econf = scaling_engine_config(p, engine_config(p, args.model, torch.device("cpu"), "float32"))
    workloads = scaling_workloads(econf, trace_spec(p, args.seed, 1, p.scaling_requests), counts,
                                  p.scaling_requests, args.work_dir / "adapters", args.seed)
    engine = EngineCore(econf)
    plans = pack_plans(engine)
    learn_plans(plans, engine, {name: path for _, folders in workloads.values() for name, path in folders.items()})
    host_cache = int(p.host_cache_mib * MiB)
    timers = Timers()
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    with timed_engine(engine, timers):
        for n in counts:  # a first untimed run each: the steps' buffers and the kernels' first calls
            run_one(engine, *workloads[n], host_cache, plans=plans)
        for i, n in enumerate(mirrored(counts, args.rounds)):
            timers.take()
            run, point = run_one(engine, *workloads[n], host_cache, plans=plans)
            runs[n].append({"wall_s": run.wall_s, "host_load_s": point.host_load_s,
                            "host_loads": point.host_cache["loads"], "pool_loads": point.pool_loads,
                            "seconds": timers.take()})
            print(f"round {i // len(counts)} {n} adapters: {run.wall_s:.2f} s, host-cache loads "
                  f"{point.host_load_s:.3f} s", file=sys.stderr, flush=True)
    ref = counts[0]
    med = {n: {"wall_s": statistics.median(r["wall_s"] for r in rs),
               "host_load_s": statistics.median(r["host_load_s"] for r in rs),
               "seconds": {k: {c: statistics.median(r["seconds"][k][c] for r in rs) for c in COLUMNS} for k in KINDS}}
           for n, rs in runs.items()}
    paired = {n: {"wall_s": _paired(runs, n, ref, lambda r: r["wall_s"]),
                  "host_load_s": _paired(runs, n, ref, lambda r: r["host_load_s"]),
                  "seconds": {k: {c: _paired(runs, n, ref, lambda r, k=k, c=c: r["seconds"][k][c]) for c in COLUMNS}
                              for k in KINDS}}
              for n in counts[1:]}
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "preset": args.preset, "model": args.model, "counts": counts, "rounds": args.rounds,
           "requests": p.scaling_requests, "distinct_used": {n: len(workloads[n][1]) for n in counts},
           "runs": runs, "median": med, "paired_minus_first": paired}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{p.scaling_requests} requests, {args.rounds} rounds; adapters used: "
          + ", ".join(f"{n}: {out['distinct_used'][n]}" for n in counts))
    print(f"| steps | call | {' | '.join(f'{n}, s' for n in counts)} | "
          + " | ".join(f"{n} - {ref} paired, s" for n in counts[1:]) + " |")
    print("|---|---|" + "---|" * (2 * len(counts) - 1))
    rows = [("", "wall", lambda m: m["wall_s"]), ("", "host-cache loads", lambda m: m["host_load_s"])]
    rows += [(k, c, lambda m, k=k, c=c: m["seconds"][k][c]) for k in KINDS for c in COLUMNS]
    for kind, name, get in rows:
        vals = [get(med[n]) for n in counts] + [get(paired[n]) for n in counts[1:]]
        if any(vals):
            print(f"| {kind} | {name} | " + " | ".join(f"{v:.3f}" for v in vals[:len(counts)]) + " | "
                  + " | ".join(f"{v:+.3f}" for v in vals[len(counts):]) + " |")
    print(f"wrote {args.out}")
    return out


if __name__ == "__main__":
    main()
