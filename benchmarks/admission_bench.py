"""Admission and fairness benchmark (issue 6), in simulation, with a step cost fitted from the real engine.

1. Step cost: fitted from real EngineCore steps of the default model (step_cost_fit.py: a warm-up pass, then
   two recorded passes over a mix of prefill and decode steps, requests spread over 16 zero adapters of
   ranks 8-64 so that LoRA's share of a step is in the fit; by default least squares on the fastest
   repeat of each step shape, --fit online for the engine's own online fit), or given with
   --cost FIXED PER_NEW_TOKEN PER_CACHED_TOKEN.
2. Trace (traces.py): gamma arrivals (CV 2 by default), lognormal chat lengths, 100 adapters of ranks
   8-64 with power-law popularity (alpha 1), three tenants with TTFT targets of 3, 8 and 20 full-budget
   steps of the fitted cost (so the targets scale with the machine; the values in ms are reported).
3. Capacity: the request rate at which the simulated engine's throughput saturates. Measured by a sweep of
   offered rates under FCFS: throughput = requests finished within the trace's arrival window / its
   length; capacity = the highest such throughput (the plateau). The sweep is reported.
4. Policies at 0.5x, 1x, 2x, 4x capacity, each on the same trace: FCFS with no admission, LIFO, early abort
   (FCFS order; SloController.unreachable() before each step, S-LoRA's early abort), early abort + VTC,
   and both of those with the admission check (SloController.check() on arrival) as the API runs it.
   Metrics (sim_metrics.py): SLO attainment over all arrivals, goodput, mean and p99 TTFT of served
   requests, throughput.
5. Fairness: one tenant sends 10x its share; the other tenants' p99 TTFT and attainment with and without
   the flood (their requests are identical in both traces), at 0.5x and 1x capacity.
6. On the real engine (admission_real.py, admission_real_flood.py), if asked: --real, each of --real-modes at
   --real-loads; --real-flood, the fairness comparison of 5. for --real-flood-modes at --real-flood-loads.
   Short traces (--real-duration s each), rates relative to the capacity simulated with the real runs' cost.

Targets (issue 6): at 2x, early-abort attainment >= 1.5x FCFS; in the flood run the well-behaved tenants'
p99 TTFT rises by at most 10%.

    python benchmarks/admission_bench.py                       # fit on the default model, then simulate
    python benchmarks/admission_bench.py --cost 0.05 0.0015 2e-6   # skip the fit
    python benchmarks/admission_bench.py --real                # also a short run on the real engine
    python benchmarks/admission_bench.py --cost 0.05 0.0015 2e-6 --real-only --real-flood   # only the real flood run

Writes benchmarks/results/admission_bench.json (--real-only: admission_bench_real.json) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loraplex.admission.cost_model import StepCost
from loraplex.admission.sim_metrics import SloMetrics, by_tenant, summarize
from loraplex.admission.simulate import OK, SimConfig, SimResult, simulate
from loraplex.config import DEFAULT_CPU_POOL_BYTES, default_cache_dir
from loraplex.models.config import ModelConfig, load_model_config
from loraplex.models.default_model import resolve_model_path

import traces as T

if TYPE_CHECKING:
    from loraplex.engine import EngineCore

MODES: dict[str, dict] = {
    "fcfs": {},
    "lifo": {"policy": "lifo"},
    "early_abort": {"early_abort": True},
    "early_abort_vtc": {"policy": "vtc", "early_abort": True},
    "early_abort+admission": {"early_abort": True, "admission": True},
    "early_abort_vtc+admission": {"policy": "vtc", "early_abort": True, "admission": True},
}
FAIRNESS_MODES = ("fcfs", "vtc", "early_abort", "early_abort_vtc", "early_abort_vtc+admission")
EXTRA_MODES = {"vtc": {"policy": "vtc"}}


def mode_config(base: SimConfig, mode: str) -> SimConfig:
    return dataclasses.replace(base, **{**MODES, **EXTRA_MODES}[mode])


def run(trace, cfg: ModelConfig, cost: StepCost, config: SimConfig) -> tuple[SimResult, float]:
    t0 = time.perf_counter()
    result = simulate(trace, cfg, cost, config)
    return result, time.perf_counter() - t0


# -- capacity --------------------------------------------------------------------------------------

def offline_throughput(spec: T.TraceSpec, cfg: ModelConfig, cost: StepCost, base: SimConfig, n: int = 400) -> float:
    """FCFS requests/s with about n requests of the trace all available at once."""
    trace = T.offline(T.generate(dataclasses.replace(spec, rate=1.0, duration_s=float(n))))
    return summarize(simulate(trace, cfg, cost, base).outcomes).throughput_rps


def measure_capacity(spec: T.TraceSpec, cfg: ModelConfig, cost: StepCost, base: SimConfig, offline_rps: float,
                     factors=(0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)) -> dict:
    """FCFS throughput within the arrival window over a sweep of offered rates; capacity = its plateau.
    The sweep is centred on the offline throughput (every request of a trace available at once)."""
    points = []
    for f in factors:
        rate = f * offline_rps
        trace = T.generate(spec.with_rate(rate))
        result, wall = run(trace, cfg, cost, base)
        done = sum(1 for o in result.outcomes if o.status == OK and o.finish_s <= spec.duration_s)
        m = summarize(result.outcomes)
        # Offered = what the trace holds (bursty gamma streams realise their nominal rate only on average).
        points.append({"nominal_rps": round(rate, 4), "offered_rps": round(len(trace) / spec.duration_s, 4),
                       "arrivals": len(trace),
                       "window_throughput_rps": round(done / spec.duration_s, 4),
                       "p99_ttft_s": round(m.p99_ttft_s, 3), "preemptions": result.preemptions,
                       "sim_wall_s": round(wall, 2)})
    capacity = max(p["window_throughput_rps"] for p in points)
    saturates_at = min(p["offered_rps"] for p in points if p["window_throughput_rps"] >= 0.95 * capacity)
    return {"capacity_rps": capacity, "saturates_at_offered_rps": saturates_at,
            "offline_throughput_rps": round(offline_rps, 4), "sweep": points}


# -- runs ------------------------------------------------------------------------------------------

def _metrics_row(result: SimResult, wall: float) -> dict:
    m = summarize(result.outcomes).as_dict()
    m["per_tenant"] = {t: v.as_dict() for t, v in by_tenant(result.outcomes).items()}
    pred = [(o.ttft_s, o.predicted_ttft_s) for o in result.outcomes
            if o.predicted_ttft_s is not None and o.ttft_s is not None and o.predicted_ttft_s > 0]
    if pred:  # how the admission check's prediction compares with the TTFT the request then got
        ratios = np.array([a / p for a, p in pred])
        m["admission_actual_over_predicted"] = {"p10": round(float(np.percentile(ratios, 10)), 3),
                                                "p50": round(float(np.median(ratios)), 3),
                                                "p90": round(float(np.percentile(ratios, 90)), 3)}
    m.update(steps=result.steps, preemptions=result.preemptions, adapter_loads=result.adapter_loads,
             adapter_evictions=result.pool.adapter_evictions, sim_wall_s=round(wall, 2))
    return m


def run_grid(spec: T.TraceSpec, cfg: ModelConfig, cost: StepCost, base: SimConfig, capacity: float,
             loads: list[float], modes: list[str]) -> list[dict]:
    rows = []
    for load in loads:
        trace = T.generate(spec.with_rate(load * capacity))
        for mode in modes:
            result, wall = run(trace, cfg, cost, mode_config(base, mode))
            rows.append({"load": load, "mode": mode, "offered_rps": round(load * capacity, 4),
                         **_metrics_row(result, wall)})
            print(f"  load {load}x {mode}: attainment {rows[-1]['attainment']:.3f} ({wall:.1f} s)", file=sys.stderr)
    return rows


def flood_traces(spec: T.TraceSpec, rate: float, flood_tenant: str,
                 flood: float) -> tuple[list[T.TraceRequest], list[T.TraceRequest]]:
    """The trace at `rate`, and the same trace with `flood_tenant` sending `flood` x its share: the other
    tenants' requests are identical in both (traces.py draws each tenant from its own random stream)."""
    calm_spec = spec.with_rate(rate)
    return T.generate(calm_spec), T.generate(calm_spec.with_load(flood_tenant, flood))


def fairness_row(before: dict[str, SloMetrics], after: dict[str, SloMetrics], others: list[str],
                 flood_tenant: str) -> dict:
    """The well-behaved tenants' TTFT and attainment without -> with the flood (by_tenant() of each run)."""
    empty = summarize([])  # a tenant with no request in a (short) trace: nothing served, p99 None
    tenants = {}
    for t in others:
        b, a = before.get(t, empty), after.get(t, empty)
        rise = None  # None: no request of the tenant got a first token in one of the two runs
        if b.p99_ttft_s and a.p99_ttft_s is not None:
            rise = round(a.p99_ttft_s / b.p99_ttft_s - 1, 4)
        tenants[t] = {"p99_ttft_s": [_r(b.p99_ttft_s), _r(a.p99_ttft_s)], "p99_rise": rise,
                      "mean_ttft_s": [_r(b.mean_ttft_s), _r(a.mean_ttft_s)],
                      "attainment": [round(b.attainment, 4), round(a.attainment, 4)]}
    rises = [v["p99_rise"] for v in tenants.values()]
    return {"well_behaved": tenants,
            "flood_tenant_attainment": round(after.get(flood_tenant, empty).attainment, 4),
            "max_p99_rise": None if None in rises else max(rises)}


def run_fairness(spec: T.TraceSpec, cfg: ModelConfig, cost: StepCost, base: SimConfig, capacity: float,
                 base_loads: list[float], flood_tenant: str, flood: float, modes: list[str]) -> list[dict]:
    rows = []
    others = [t.name for t in spec.tenants if t.name != flood_tenant]
    for load in base_loads:
        calm, flooded = flood_traces(spec, load * capacity, flood_tenant, flood)
        for mode in modes:
            config = mode_config(base, mode)
            before = by_tenant(simulate(calm, cfg, cost, config).outcomes)
            after = by_tenant(simulate(flooded, cfg, cost, config).outcomes)
            rows.append({"base_load": load, "mode": mode, "flood_tenant": flood_tenant, "flood": flood,
                         "requests": [len(calm), len(flooded)],
                         **fairness_row(before, after, others, flood_tenant)})
            print(f"  fairness {load}x {mode}: max p99 rise {_pct(rows[-1]['max_p99_rise'])}", file=sys.stderr)
    return rows


# -- tables ----------------------------------------------------------------------------------------

def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def _f(x, fmt=".3f"):
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "none served" if x is None else f"{x:+.0%}"


def fairness_cells(row: dict, tenants: list[str]) -> list[str]:
    """A fairness row's cells per well-behaved tenant: p99 TTFT s and attainment without -> with the flood."""
    cells = []
    for t in tenants:
        v = row["well_behaved"][t]
        cells += [f"{_f(v['p99_ttft_s'][0], '.2f')} -> {_f(v['p99_ttft_s'][1], '.2f')}", _pct(v["p99_rise"]),
                  f"{v['attainment'][0]:.3f} -> {v['attainment'][1]:.3f}"]
    return cells


def fairness_header(tenants: list[str]) -> str:
    return " | ".join(f"{t} p99 | {t} rise | {t} attainment" for t in tenants)


def print_tables(out: dict) -> None:
    """The simulation's tables (absent in a --real-only run: only the cost line) and the targets."""
    print(f"\nStep cost: fixed {out['cost']['fixed_s'] * 1e3:.1f} ms + {out['cost']['per_new_token_s'] * 1e3:.3f} "
          f"ms/new token + {out['cost']['per_cached_token_s'] * 1e6:.3f} us/cached token ({out['cost_source']}). "
          f"TTFT targets: {', '.join(f'{t} {ms / 1e3:.1f} s' for t, ms in out['ttft_targets_ms'].items())}.")
    if "grid" in out:
        print_sim_tables(out)
    print("\nTargets:")
    for k, v in out["targets"].items():
        print(f"- {k}: {v}")


def print_sim_tables(out: dict) -> None:
    cap = out["capacity"]
    print(f"Capacity: {cap['capacity_rps']:.3f} req/s (FCFS throughput plateau; offline {cap['offline_throughput_rps']:.3f}); "
          f"{out['trace_spec']['duration_s']:.0f} s of arrivals per run\n")
    print("| offered req/s | window throughput req/s | p99 TTFT s |\n|---|---|---|")
    for p in cap["sweep"]:
        print(f"| {p['offered_rps']:.3f} | {p['window_throughput_rps']:.3f} | {p['p99_ttft_s']:.2f} |")
    print("\n| load | policy | attainment | goodput req/s | mean TTFT s | p99 TTFT s | throughput req/s | refused | aborted |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in out["grid"]:
        print(f"| {r['load']}x | {r['mode']} | {r['attainment']:.3f} | {r['goodput_rps']:.3f} | {_f(r['mean_ttft_s'], '.2f')} "
              f"| {_f(r['p99_ttft_s'], '.2f')} | {r['throughput_rps']:.3f} | {r['refused']} | {r['aborted']} |")
    print(f"\nFairness: tenant {out['fairness'][0]['flood_tenant']} sends {out['fairness'][0]['flood']:g}x its share; "
          "well-behaved tenants' p99 TTFT (s) and attainment, without -> with the flood\n")
    tenants = list(out["fairness"][0]["well_behaved"])
    print(f"| base load | policy | {fairness_header(tenants)} |")
    print("|---|---|" + "---|---|---|" * len(tenants))
    for r in out["fairness"]:
        print(f"| {r['base_load']}x | {r['mode']} | " + " | ".join(fairness_cells(r, tenants)) + " |")


def check_targets(grid: list[dict], fairness: list[dict]) -> dict:
    def att(load, mode):
        return next(r["attainment"] for r in grid if r["load"] == load and r["mode"] == mode)

    out = {}
    if any(r["load"] == 2.0 for r in grid):
        ratio = att(2.0, "early_abort") / max(att(2.0, "fcfs"), 1e-9)
        out["2x: early_abort attainment / fcfs (>= 1.5)"] = f"{ratio:.2f}x ({att(2.0, 'early_abort'):.3f} vs {att(2.0, 'fcfs'):.3f}): " \
                                                            f"{'met' if ratio >= 1.5 else 'NOT met'}"
    for r in fairness:
        if r["mode"] == "early_abort_vtc":
            rise = r["max_p99_rise"]
            out[f"flood at {r['base_load']}x, early_abort_vtc: max p99 rise (<= +10%)"] = \
                f"{_pct(rise)}: {'met' if rise is not None and rise <= 0.10 else 'NOT met'}"
    return out


# -- main ------------------------------------------------------------------------------------------

RESULTS = Path(__file__).parent / "results"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="SLO admission and fairness benchmark (simulation + optional real run)")
    ap.add_argument("--cost", type=float, nargs=3, metavar=("FIXED_S", "PER_NEW_S", "PER_CACHED_S"),
                    help="use this step cost instead of fitting one on the default model")
    ap.add_argument("--fit-repeats", type=int, default=2, help="recorded passes over the fit's step mix")
    ap.add_argument("--fit-adapters", type=int, default=16, help="zero adapters of mixed ranks the fit's requests use")
    ap.add_argument("--fit", choices=("floor", "online"), default="floor",
                    help="floor: least squares on the fastest repeat of each step shape (robust to other load on "
                         "a shared machine); online: the engine's own online fit over all steps")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the real-engine parts (one: steadier on a shared 2-core machine)")
    ap.add_argument("--model", default="default",
                    help="the real engine's model: 'default' (SmolLM2-135M-Instruct) or a checkpoint folder")
    ap.add_argument("--requests-at-1x", type=int, default=1500,
                    help="trace length: seconds of arrivals = this / the offline throughput (about capacity)")
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--fairness-loads", type=float, nargs="+", default=[0.5, 1.0])
    ap.add_argument("--flood-tenant", default="batch")
    ap.add_argument("--flood", type=float, default=10.0)
    ap.add_argument("--target-steps", type=float, nargs=3, default=[3.0, 8.0, 20.0],
                    help="TTFT targets of the three tenants, in full-budget steps of the fitted cost")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--pool-bytes", type=int, default=DEFAULT_CPU_POOL_BYTES)
    ap.add_argument("--adapter-load-gbps", type=float, default=2.0,
                    help="host -> pool copy rate charged for adapter placements (GB/s)")
    ap.add_argument("--real", action="store_true", help="also a short run on the real engine (default model)")
    ap.add_argument("--real-duration", type=float, default=30.0, help="seconds of arrivals per real run")
    ap.add_argument("--real-loads", type=float, nargs="+", default=[1.0, 2.0])
    ap.add_argument("--real-modes", nargs="+", default=["fcfs", "early_abort"])
    ap.add_argument("--real-flood", action="store_true",
                    help="also the flood run on the real engine: --flood-tenant sends --flood x its share")
    ap.add_argument("--real-flood-loads", type=float, nargs="+", default=[0.5], help="base loads of the real flood run")
    ap.add_argument("--real-flood-modes", nargs="+", default=["early_abort_vtc"], choices=list(FAIRNESS_MODES),
                    help="modes of the real flood run (without early abort a flooded run drains its backlog: slow)")
    ap.add_argument("--real-only", action="store_true",
                    help="skip the simulation grid and fairness runs: only the real runs asked for (--real, "
                         "--real-flood); the JSON goes to results/admission_bench_real.json unless --out")
    ap.add_argument("--capacity", type=float,
                    help="req/s the real runs' loads are relative to (default: simulated with their step cost)")
    T.add_spec_args(ap)
    ap.set_defaults(arrivals="gamma", cv=2.0)
    ap.add_argument("--out", type=Path, help="JSON output (default results/admission_bench.json)")
    args = ap.parse_args(argv)
    if args.real_only and not (args.real or args.real_flood):
        ap.error("--real-only needs --real and/or --real-flood")
    if args.out is None:  # a real-only run leaves the simulation's results in place
        args.out = RESULTS / ("admission_bench_real.json" if args.real_only else "admission_bench.json")
    return args


def make_core(args: argparse.Namespace) -> EngineCore:
    from loraplex.config import EngineConfig
    from loraplex.engine import EngineCore

    return EngineCore(EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs,
                                   max_num_batched_tokens=args.max_num_batched_tokens, pool_bytes=args.pool_bytes))


def short_capacity(spec: T.TraceSpec, cfg: ModelConfig, cost: StepCost, base: SimConfig, n: int = 400) -> float:
    """The capacity sweep on a trace of about n requests at 1x: seconds of simulation, for the real runs."""
    rps = offline_throughput(spec, cfg, cost, base)
    return measure_capacity(dataclasses.replace(spec, duration_s=round(n / rps, 1)), cfg, cost, base, rps)["capacity_rps"]


def simulate_all(args: argparse.Namespace, spec: T.TraceSpec, cfg: ModelConfig, cost: StepCost,
                 base: SimConfig) -> dict:
    """Capacity, the policies x loads grid and the fairness runs, in simulation."""
    t0 = time.perf_counter()
    # Trace length in virtual seconds from the offline throughput, so that every machine simulates about
    # the same number of requests (the same statistical weight for a p99).
    offline_rps = offline_throughput(spec, cfg, cost, base)
    spec = dataclasses.replace(spec, duration_s=round(args.requests_at_1x / offline_rps, 1))
    print(f"measuring capacity ({spec.duration_s:.0f} s of arrivals per run)...", file=sys.stderr)
    capacity = measure_capacity(spec, cfg, cost, base, offline_rps)
    cap = capacity["capacity_rps"]
    print("policies x loads...", file=sys.stderr)
    grid = run_grid(spec, cfg, cost, base, cap, args.loads, args.modes)
    print("fairness...", file=sys.stderr)
    fairness = run_fairness(spec, cfg, cost, base, cap, args.fairness_loads, args.flood_tenant, args.flood,
                            list(FAIRNESS_MODES))
    return {
        "trace_spec": dataclasses.asdict(spec),
        "trace_at_1x": T.describe(T.generate(spec.with_rate(cap))),
        "sim_config": {k: v for k, v in dataclasses.asdict(base).items() if k != "shares"},
        "capacity": capacity,
        "grid": grid,
        "fairness": fairness,
        "targets": check_targets(grid, fairness),
        "simulation_wall_s": round(time.perf_counter() - t0, 1),
    }


def run_real_parts(args: argparse.Namespace, out: dict, core: EngineCore, spec: T.TraceSpec, cfg: ModelConfig,
                   cost: StepCost, real_cost: StepCost, base: SimConfig) -> None:
    """The real-engine runs asked for (--real, --real-flood), into out["real"] and out["real_fairness"]."""
    from admission_real import run_real_bench
    from admission_real_flood import check_real_flood_targets, run_real_fairness

    simulated = out["capacity"]["capacity_rps"] if "capacity" in out else None
    if args.capacity:
        real_cap = args.capacity
    elif simulated is not None and real_cost == cost:
        real_cap = simulated
    else:  # the real runs' own cost, or a real-only run: a short sweep
        real_cap = short_capacity(spec, cfg, real_cost, base)
    if args.real:
        configs = {m: mode_config(base, m) for m in args.real_modes}
        out["real"] = run_real_bench(core, spec, real_cost, real_cap, configs, args.real_loads, args.real_duration)
        out["real"].update(cost=dataclasses.asdict(real_cost), capacity_rps=real_cap)
    if args.real_flood:
        configs = {m: mode_config(base, m) for m in args.real_flood_modes}
        out["real_fairness"] = run_real_fairness(core, spec, real_cost, real_cap, configs, args.real_flood_loads,
                                                 args.flood_tenant, args.flood, args.real_duration)
        out["real_fairness"].update(cost=dataclasses.asdict(real_cost), capacity_rps=real_cap)
        out["targets"].update(check_real_flood_targets(out["real_fairness"]["runs"]))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    model_path = resolve_model_path(args.model, default_cache_dir())
    cfg = load_model_config(model_path)
    core = None
    fit = None
    if args.cost:
        cost, source = StepCost(*args.cost, samples=0), "given on the command line"
    else:
        from step_cost_fit import fit_from_engine

        core = make_core(args)
        print("fitting the step cost from real steps of the default model...", file=sys.stderr)
        fit = fit_from_engine(core, args.fit_repeats, adapters=args.fit_adapters)
        cost = fit.floor if args.fit == "floor" else fit.online
        err = fit.floor_error if args.fit == "floor" else fit.online_error
        source = f"{args.fit} fit from {len(fit.records)} real steps of the default model, mean abs error {err:.0%}"

    full_step_s = cost.predict(args.max_num_batched_tokens, 0)
    spec_args = T.spec_from_args(args, 1.0, 1.0)
    if not args.tenants:  # the default three tenants, targets in full-budget steps
        tenants = tuple(dataclasses.replace(t, ttft_target_ms=round(n * full_step_s * 1e3, 1))
                        for t, n in zip(T.THREE_TENANTS, args.target_steps))
        spec_args = dataclasses.replace(spec_args, tenants=tenants)
    spec = spec_args
    base = SimConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     pool_bytes=args.pool_bytes, adapter_load_bytes_per_s=args.adapter_load_gbps * 1e9,
                     shares=spec.shares)

    out = {
        "benchmark": "admission_bench",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": args.threads},
        "command": " ".join(["python"] + (sys.argv if argv is None else [__file__, *argv])),
        "cost": dataclasses.asdict(cost), "cost_source": source,
        "cost_fit": fit.as_dict() if fit is not None else None,
        "full_budget_step_s": full_step_s,
        "ttft_targets_ms": {t.name: t.ttft_target_ms for t in spec.tenants},
    }
    if args.real_only:
        spec = dataclasses.replace(spec, duration_s=args.real_duration)
        out.update(trace_spec=dataclasses.asdict(spec), targets={},
                   sim_config={k: v for k, v in dataclasses.asdict(base).items() if k != "shares"})
    else:
        out.update(simulate_all(args, spec, cfg, cost, base))
    if args.real or args.real_flood:
        if core is None:
            core = make_core(args)
        # The real engine runs on the machine as it is now: on a shared machine other processes slow it
        # (several-fold on these 2-core machines), which the floor fit leaves out by design. The real runs'
        # rates and their simulated twins use the engine's online fit, which includes that slowdown.
        real_cost = fit.online if fit is not None else cost
        run_real_parts(args, out, core, spec, cfg, cost, real_cost, base)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print_tables(out)
    if args.real:
        from admission_real import print_real_table

        print_real_table(out["real"])
    if args.real_flood:
        from admission_real_flood import print_real_fairness_table

        print_real_fairness_table(out["real_fairness"])
    print(f"\nJSON: {args.out}")
    return out


if __name__ == "__main__":
    main()
