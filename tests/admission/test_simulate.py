"""Simulation mode: a trace replayed through the real scheduler, queue policy, pager and SLO controller with a
step-cost model in place of the model (tiny model config, a small pool so that adapters and KV compete).
No wall-clock assertions: everything here runs on the simulation's virtual clock."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from pathlib import Path

import pytest

from factories import make_tiny_model
from loraplex.admission.cost_model import StepCost
from loraplex.admission.sim_metrics import by_tenant, summarize
from loraplex.admission.simulate import ABORTED, OK, REFUSED, SimConfig, Simulator, simulate
from loraplex.models.config import load_model_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import traces as T  # noqa: E402

COST = StepCost(fixed_s=0.01, per_new_token_s=2e-4, per_cached_token_s=1e-7, samples=0)
TENANTS = (T.TenantSpec("a", 1.0, 500.0), T.TenantSpec("b", 1.0, 1000.0), T.TenantSpec("c", 1.0, 2000.0))
SPEC = T.TraceSpec(rate=10.0, duration_s=60.0, prompt_median=64, prompt_max=256, output_median=32, output_max=200,
                   num_adapters=20, ranks=(8, 16, 32, 64), tenants=TENANTS, seed=1)
# A 2 MiB pool: about 2,700 tokens of KV beside adapters of up to 60 pages, so KV allocation evicts idle
# adapters and the scheduler preempts.
BASE = SimConfig(max_num_seqs=32, max_num_batched_tokens=256, pool_bytes=2 << 20, shares=SPEC.shares)
EARLY_ABORT = dataclasses.replace(BASE, early_abort=True)


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    return load_model_config(make_tiny_model(tmp_path_factory.mktemp("sim-model"), "llama", seed=0))


@pytest.fixture(scope="module")
def capacity(model_config) -> float:
    """Requests/s the simulated engine sustains: FCFS throughput with the whole trace available at once."""
    trace = T.offline(T.generate(dataclasses.replace(SPEC, duration_s=30.0)))
    return summarize(simulate(trace, model_config, COST, BASE).outcomes).throughput_rps


def test_same_trace_same_outcomes(model_config):
    trace = T.generate(SPEC.with_rate(20.0))
    config = dataclasses.replace(BASE, policy="vtc", admission=True, early_abort=True)
    first, second = simulate(trace, model_config, COST, config), simulate(trace, model_config, COST, config)
    assert first.outcomes == second.outcomes
    assert (first.steps, first.end_s, first.preemptions) == (second.steps, second.end_s, second.preemptions)


def test_every_arrival_ends_once_and_the_pool_is_whole_again(model_config, capacity):
    trace = T.generate(SPEC.with_rate(2.5 * capacity))
    sim = Simulator(model_config, COST, dataclasses.replace(BASE, policy="vtc", admission=True, early_abort=True))
    result = sim.run(trace)
    assert [o.id for o in result.outcomes] == [r.id for r in trace]
    statuses = Counter(o.status for o in result.outcomes)
    assert set(statuses) == {OK, REFUSED, ABORTED}  # overload exercises every way out
    wanted = {r.id: r.output_tokens for r in trace}
    for o in result.outcomes:
        if o.status == OK:
            assert o.output_tokens == wanted[o.id] and o.first_token_s is not None
            assert o.arrival_s <= o.first_token_s <= o.finish_s
        else:
            assert o.first_token_s is None and o.output_tokens == 0 and not o.attained
    assert sim.slo.refused == statuses[REFUSED] and sim.slo.aborted == statuses[ABORTED]
    # The pool was under real pressure from adapters and KV...
    assert result.preemptions > 0 and result.pool.adapter_evictions > 0
    # ...and nothing leaked: no KV, no pins; idle adapters stay cached until unloaded.
    assert not sim.scheduler.has_unfinished()
    assert result.pool.kv_pages == 0 and result.pool.pinned_adapters == 0 and result.pool.num_sequences == 0
    sim.pager.check_integrity()
    for name in sim.adapters.names():
        sim.adapters.remove(name)
    assert sim.pager.stats().free_pages == sim.pager.geometry.num_pages
    sim.pager.check_integrity()


def test_under_2x_overload_early_abort_beats_fcfs(model_config, capacity):
    trace = T.generate(SPEC.with_rate(2 * capacity))
    fcfs = summarize(simulate(trace, model_config, COST, BASE).outcomes)
    abort = summarize(simulate(trace, model_config, COST, EARLY_ABORT).outcomes)
    assert fcfs.refused == fcfs.aborted == 0 and fcfs.served == fcfs.arrivals  # FCFS serves everyone, late
    assert abort.attainment >= 1.5 * fcfs.attainment and abort.attainment > 0.3
    assert abort.goodput_rps > fcfs.goodput_rps
    # Early abort keeps the queue bounded: served requests' TTFT stays near the targets (at most 2 s here).
    assert abort.p99_ttft_s < 2.5 < fcfs.p99_ttft_s


def test_vtc_protects_a_light_tenant_from_a_flood(model_config, capacity):
    """Tenant c sends 10x its share. Under VTC (+ early abort) tenants a and b keep their attainment and their
    p99 TTFT stays within their targets, where FCFS makes them wait behind the flood (p99 up >5x, attainment
    lost). Not asserted, and reported by benchmarks/admission_bench.py: how near the p99 stays depends on the
    base load. VTC orders only the waiting queue; the flood still fills the batch and the pool, so a light
    request waits for a slot or pages and is the newest, first-preempted request (a 2-4x higher p99 at
    0.3-0.8x capacity here, about 1.05x at 1.2x where the batch is full anyway)."""
    spec = SPEC.with_rate(0.8 * capacity)
    calm, flood = T.generate(spec), T.generate(spec.with_load("c", 10.0))

    def tenant_metrics(config, trace, tenant):
        return by_tenant(simulate(trace, model_config, COST, config).outcomes)[tenant]

    vtc = dataclasses.replace(EARLY_ABORT, policy="vtc")
    for tenant, target_s in (("a", 0.5), ("b", 1.0)):
        before, after = tenant_metrics(vtc, calm, tenant), tenant_metrics(vtc, flood, tenant)
        assert after.attainment >= before.attainment - 0.05
        assert after.p99_ttft_s <= target_s
    before, after = tenant_metrics(BASE, calm, "a"), tenant_metrics(BASE, flood, "a")
    assert after.p99_ttft_s > 5 * before.p99_ttft_s and after.attainment < 0.5 * before.attainment
