"""The admission benchmark's short version on the real engine (admission_bench.py --real).

EngineCore with the default model, driven on the wall clock: each trace request is added when its arrival
time has passed (between steps, as the async engine's thread does), with the SLO check on arrival when the
mode has admission and the engine's own early abort (core.slo) when it has early abort. Adapters are zero
LoraAdapters of the trace's ranks, placed in the real pool and applied by the real kernels. Each run is
also simulated on the same trace with the same step cost, so the simulator's agreement with the engine is
stated next to the result.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time

from loraplex.admission.cost_model import StepCost, StepCostModel
from loraplex.admission.sim_adapters import SimAdapterFactory
from loraplex.admission.sim_metrics import summarize
from loraplex.admission.simulate import ABORTED, OK, REFUSED, SimConfig, SimOutcome, simulate
from loraplex.admission.slo import SloController
from loraplex.engine import EngineCore, SamplingParams
from loraplex.engine.queue_policy import make_queue_policy

import traces as T


def run_real(core: EngineCore, trace: list[T.TraceRequest], config: SimConfig, cost: StepCost,
             seed: int = 0) -> tuple[list[SimOutcome], StepCost | None]:
    """Replay the trace on the engine in real time; outcomes in the simulation's terms."""
    ec = core.config
    core.scheduler.policy = make_queue_policy(config.policy)  # the engine is idle: a fresh policy is safe
    slo = None
    if config.admission or config.early_abort:
        slo = SloController(ec.max_num_batched_tokens, ec.max_num_seqs, StepCostModel(prior=cost, min_samples=1))
    core.slo = slo if config.early_abort else None
    factory = SimAdapterFactory(core.model_config, core.pager.geometry.row_layout, config.adapter_modules)
    known = set(core.adapters.names())
    for r in trace:
        if r.adapter is not None and r.adapter not in known:
            core.add_adapter(r.adapter, factory.make(r.adapter, r.rank))
            known.add(r.adapter)
    rng = random.Random(seed)
    vocab = core.model_config.vocab_size
    prompts = {r.id: [rng.randrange(3, vocab) for _ in range(r.prompt_tokens)] for r in trace}
    items = {r.id: r for r in trace}
    outcomes: dict[str, SimOutcome] = {}

    def record(r, status, first, finish, n_out):
        outcomes[r.id] = SimOutcome(r.id, r.tenant, r.arrival_s, r.ttft_target_ms / 1e3, status, first, finish,
                                    r.prompt_tokens, n_out)

    pending = sorted(trace, key=lambda r: r.arrival_s)
    i = 0
    t0 = time.monotonic()
    while i < len(pending) or core.has_unfinished():
        now = time.monotonic() - t0
        while i < len(pending) and pending[i].arrival_s <= now:
            r = pending[i]
            i += 1
            target = r.ttft_target_ms / 1e3
            # The HTTP layer's budget: the target less the time since the request came in.
            if config.admission and not slo.check(r.prompt_tokens, target - (now - r.arrival_s), tenant=r.tenant,
                                                  share=float(config.shares.get(r.tenant, 1.0)), request_id=r.id,
                                                  max_tokens=r.output_tokens).allowed:
                record(r, REFUSED, None, now, 0)
                continue
            core.add_request(prompts[r.id], SamplingParams(max_tokens=r.output_tokens, ignore_eos=True,
                                                           temperature=0.0),
                             adapter=r.adapter, request_id=r.id, tenant=r.tenant,
                             share=float(config.shares.get(r.tenant, 1.0)), ttft_deadline=t0 + r.arrival_s + target)
        if not core.has_unfinished():
            time.sleep(max(0.0, pending[i].arrival_s - (time.monotonic() - t0)))
            continue
        for out in core.step():
            if not out.finished:
                continue
            r = items[out.request_id]
            if out.finish_reason == "slo_unreachable":
                record(r, ABORTED, None, out.finish_time - t0, 0)
            else:
                record(r, OK, out.first_token_time - t0, out.finish_time - t0, len(out.token_ids))
        if slo is not None and core.slo is None:  # admission without engine-side abort: publish ourselves
            slo.publish(core.scheduler.view())
    core.slo = None
    core.scheduler.policy = make_queue_policy(ec.queue_policy)
    return [outcomes[r.id] for r in trace], (slo.cost if slo is not None else None)


def run_real_bench(core: EngineCore, spec: T.TraceSpec, cost: StepCost, capacity: float,
                   configs: dict[str, SimConfig], loads: list[float], duration_s: float) -> dict:
    """Each mode at each load on a `duration_s` trace at load x capacity (capacity from the simulation)."""
    short = dataclasses.replace(spec, duration_s=duration_s)
    rows = []
    for load in loads:
        trace = T.generate(short.with_rate(load * capacity))
        for mode, config in configs.items():
            print(f"  real {load}x {mode}: {len(trace)} requests over {duration_s:.0f} s...", file=sys.stderr)
            t0 = time.perf_counter()
            outcomes, final_cost = run_real(core, trace, config, cost)
            wall = time.perf_counter() - t0
            real = summarize(outcomes)
            sim = summarize(simulate(trace, core.model_config, cost, config).outcomes)
            rows.append({"load": load, "mode": mode, "requests": len(trace), "wall_s": round(wall, 1),
                         "real": real.as_dict(), "simulated": sim.as_dict(),
                         "online_fit_at_end": dataclasses.asdict(final_cost) if final_cost else None})
    return {"duration_s": duration_s, "runs": rows}


def print_real_table(real: dict) -> None:
    c = real["cost"]
    print(f"\nReal engine (default model, {real['duration_s']:.0f} s of arrivals per run; loads relative to "
          f"{real['capacity_rps']:.3f} req/s, the capacity simulated with the engine's online fit: "
          f"{c['fixed_s'] * 1e3:.1f} ms + {c['per_new_token_s'] * 1e3:.3f} ms/token + "
          f"{c['per_cached_token_s'] * 1e6:.2f} us/cached token), beside the simulation of the same trace\n")
    print("| load | policy | requests | attainment real / sim | p99 TTFT s real / sim | throughput req/s real / sim |")
    print("|---|---|---|---|---|---|")
    for r in real["runs"]:
        a, s = r["real"], r["simulated"]
        p99 = (lambda m: "-" if m["p99_ttft_s"] is None else f"{m['p99_ttft_s']:.2f}")
        print(f"| {r['load']}x | {r['mode']} | {r['requests']} | {a['attainment']:.3f} / {s['attainment']:.3f} "
              f"| {p99(a)} / {p99(s)} | {a['throughput_rps']:.3f} / {s['throughput_rps']:.3f} |")
