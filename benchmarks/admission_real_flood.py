"""The flood (fairness) run on the real engine (admission_bench.py --real-flood).

The comparison admission_bench.run_fairness makes in simulation, on EngineCore with the default model: for
each base load and mode, the trace at base load x capacity and the same trace with one tenant sending
`flood` x its share (the other tenants' requests are identical in both) are replayed in real time with
admission_real.run_real; reported are the well-behaved tenants' p99 TTFT and attainment without -> with the
flood, and the simulation's p99 rise on the same two traces beside the real one. A short trace holds few
requests per tenant (a 30 s trace at 0.5x: a handful each), so its p99 is about its slowest request.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter

from loraplex.admission.cost_model import StepCost
from loraplex.admission.sim_metrics import by_tenant
from loraplex.admission.simulate import SimConfig, simulate
from loraplex.engine import EngineCore

import traces as T
from admission_bench import fairness_cells, fairness_header, fairness_row, flood_traces, _pct
from admission_real import run_real

TARGET_RISE = 0.10  # issue 6: the well-behaved tenants' p99 TTFT rises by at most 10% under the flood
TARGET_MODE = "early_abort_vtc"


def run_real_fairness(core: EngineCore, spec: T.TraceSpec, cost: StepCost, capacity: float,
                      configs: dict[str, SimConfig], base_loads: list[float], flood_tenant: str, flood: float,
                      duration_s: float) -> dict:
    """Each mode at each base load: a `duration_s` trace at load x capacity without, then with, the flood."""
    short = dataclasses.replace(spec, duration_s=duration_s)
    others = [t.name for t in spec.tenants if t.name != flood_tenant]
    rows = []
    for load in base_loads:
        calm, flooded = flood_traces(short, load * capacity, flood_tenant, flood)
        calm_n, flooded_n = Counter(r.tenant for r in calm), Counter(r.tenant for r in flooded)
        for mode, config in configs.items():
            real, walls = [], []
            for label, trace in (("without", calm), ("with", flooded)):
                print(f"  real flood {load}x {mode}, {label} the flood: {len(trace)} requests over "
                      f"{duration_s:.0f} s...", file=sys.stderr)
                t0 = time.perf_counter()
                real.append(by_tenant(run_real(core, trace, config, cost)[0]))
                walls.append(round(time.perf_counter() - t0, 1))
            sim = [by_tenant(simulate(trace, core.model_config, cost, config).outcomes) for trace in (calm, flooded)]
            rows.append({"base_load": load, "mode": mode, "flood_tenant": flood_tenant, "flood": flood,
                         "requests": [len(calm), len(flooded)],
                         "requests_by_tenant": {t.name: [calm_n[t.name], flooded_n[t.name]] for t in spec.tenants},
                         "wall_s": walls, **fairness_row(real[0], real[1], others, flood_tenant),
                         "simulated_max_p99_rise": fairness_row(sim[0], sim[1], others, flood_tenant)["max_p99_rise"]})
            print(f"  real flood {load}x {mode}: max p99 rise {_pct(rows[-1]['max_p99_rise'])}", file=sys.stderr)
    return {"duration_s": duration_s, "flood_tenant": flood_tenant, "flood": flood, "runs": rows}


def check_real_flood_targets(runs: list[dict]) -> dict:
    """The flood target on the real runs of TARGET_MODE, as check_targets states it for the simulation."""
    out = {}
    for r in runs:
        if r["mode"] == TARGET_MODE:
            rise = r["max_p99_rise"]
            n = sum(r["requests_by_tenant"][t][0] for t in r["well_behaved"])
            out[f"real engine, flood at {r['base_load']}x, {TARGET_MODE}: max p99 rise (<= +10%)"] = \
                f"{_pct(rise)} ({n} well-behaved requests per run): " \
                f"{'met' if rise is not None and rise <= TARGET_RISE else 'NOT met'}"
    return out


def print_real_fairness_table(real: dict) -> None:
    c = real["cost"]
    print(f"\nReal engine, flood: tenant {real['flood_tenant']} sends {real['flood']:g}x its share "
          f"({real['duration_s']:.0f} s of arrivals per run; loads relative to {real['capacity_rps']:.3f} req/s, "
          f"the capacity simulated with {c['fixed_s'] * 1e3:.1f} ms + {c['per_new_token_s'] * 1e3:.3f} ms/token + "
          f"{c['per_cached_token_s'] * 1e6:.2f} us/cached token); well-behaved tenants' p99 TTFT (s) and "
          "attainment, without -> with the flood, and the largest p99 rise, real and simulated\n")
    tenants = list(real["runs"][0]["well_behaved"]) if real["runs"] else []
    print(f"| base load | policy | requests | {fairness_header(tenants)} | max rise real / sim |")
    print("|---|---|---|" + "---|---|---|" * len(tenants) + "---|")
    for r in real["runs"]:
        print(f"| {r['base_load']}x | {r['mode']} | {r['requests'][0]} -> {r['requests'][1]} | "
              + " | ".join(fairness_cells(r, tenants))
              + f" | {_pct(r['max_p99_rise'])} / {_pct(r['simulated_max_p99_rise'])} |")
