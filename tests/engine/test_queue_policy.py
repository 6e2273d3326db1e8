"""Queue policies: FCFS, LIFO and VTC fairness, alone and inside the real engine."""

from __future__ import annotations

import random

import pytest
import torch

from factories import make_tiny_model
from loraplex.config import EngineConfig
from loraplex.engine.engine_core import EngineCore
from loraplex.engine.adapters import AdapterTable
from loraplex.engine.queue_policy import Fcfs, Lifo, Vtc, make_queue_policy
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler
from loraplex.errors import ConfigError
from loraplex.models.config import load_model_config
from loraplex.unified_pager import PoolGeometry, UnifiedPager


def _req(rid: str, tenant: str, prompt: int = 10, share: float = 1.0) -> Request:
    return Request(request_id=rid, prompt_token_ids=[1] * prompt, params=SamplingParams(), adapter=None,
                   max_total_tokens=1000, tenant=tenant, share=share)


def test_fcfs_and_lifo_orders():
    reqs = [_req(str(i), "t") for i in range(4)]
    assert list(Fcfs().order(reqs)) == reqs
    assert list(Lifo().order(reqs)) == reqs[::-1]


def test_vtc_serves_the_least_served_tenant_first_and_interleaves():
    vtc = Vtc()
    flood = [_req(f"a{i}", "a") for i in range(6)]
    for r in flood:
        vtc.on_add(r)
    vtc.on_tokens(flood[0], 100, 20)  # a has received service: 100 + 2 * 20 = 140
    assert vtc.counters["a"] == 140
    late = [_req("b0", "b"), _req("b1", "b")]
    for r in late:
        vtc.on_add(r)  # b becomes active: lifted to the minimum of the active tenants (a: 140)
    assert vtc.counters["b"] == 140
    order = [r.request_id for r in vtc.order(flood + late)]
    # Equal counters: one of each in turn (each pick provisionally charges its prompt), not all of a's.
    assert order[:4] in (["a0", "b0", "a1", "b1"], ["b0", "a0", "b1", "a1"])
    assert sorted(order) == sorted(r.request_id for r in flood + late)


def test_vtc_lifts_a_returning_tenant_and_weights_by_share():
    vtc = Vtc()
    a, b = _req("a", "a"), _req("b", "b", share=2.0)
    vtc.on_add(a)
    vtc.on_tokens(a, 1000, 0)
    vtc.on_finish(a)  # a idles with 1000
    vtc.on_add(b)  # b: no other tenant active -> keeps its own counter (0)
    assert vtc.counters["b"] == 0
    vtc.on_tokens(b, 1000, 0)
    assert vtc.counters["b"] == 500  # share 2: half the charge
    vtc.on_add(_req("c", "c"))  # c arrives while b is active: lifted to b's 500
    assert vtc.counters["c"] == 500
    vtc.on_add(_req("a2", "a"))  # a returns: max(own 1000, min active 500) = 1000, no banked credit lost
    assert vtc.counters["a"] == 1000


def test_unknown_policy_is_refused():
    with pytest.raises(ConfigError, match="fcfs"):
        make_queue_policy("random")
    with pytest.raises(ConfigError, match="queue_policy"):
        EngineConfig(queue_policy="sjf")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("qp-model"), "llama")


def _first_token_order(model_dir, policy: str, flood: int = 12) -> list[str]:
    """One sequence at a time: the order in which requests get their first token."""
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(model=str(model_dir), pool_bytes=8 << 20, max_num_seqs=1, kernels="torch",
                                   queue_policy=policy))
    rng = random.Random(0)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(flood):  # tenant "flood" queues many requests first
        core.add_request([rng.randrange(3, 200) for _ in range(8)], params, request_id=f"f{i}", tenant="flood")
    for i in range(2):  # then a well-behaved tenant sends two
        core.add_request([rng.randrange(3, 200) for _ in range(8)], params, request_id=f"g{i}", tenant="good")
    order: list[str] = []
    while core.has_unfinished():
        for out in core.step():
            if len(out.token_ids) == 1 and out.request_id not in order:
                order.append(out.request_id)
    return order


def test_vtc_in_the_engine_lets_the_light_tenant_through_a_flood(model_dir):
    fcfs = _first_token_order(model_dir, "fcfs")
    vtc = _first_token_order(model_dir, "vtc")
    assert fcfs.index("g0") == 12  # FCFS: behind the whole flood
    assert vtc.index("g0") <= 2 and vtc.index("g1") <= 4  # VTC: interleaved with the flood
    assert sorted(vtc) == sorted(fcfs)  # everyone is served


# -- tenant-aware scheduling under VTC (the real Scheduler and page pool; tokens advanced by hand) -------------

def _sched(model_config, policy, kv_blocks: int, max_num_seqs: int = 8) -> Scheduler:
    """A scheduler whose pool holds exactly kv_blocks KV blocks of 16 tokens (no adapters)."""
    probe = PoolGeometry.for_model(model_config, 1 << 20, torch.float32, 16)
    pool_bytes = kv_blocks * probe.kv_pages_for_tokens(16) * probe.page_bytes
    pager = UnifiedPager(PoolGeometry.for_model(model_config, pool_bytes, torch.float32, 16), "cpu")
    return Scheduler(pager, AdapterTable(pager), max_num_seqs, 256, policy)


def _add(sched: Scheduler, rid: str, tenant: str, prompt: int) -> Request:
    req = Request(request_id=rid, prompt_token_ids=[1] * prompt, params=SamplingParams(max_tokens=50), adapter=None,
                  max_total_tokens=1000, tenant=tenant)
    sched.add(req, None)
    return req


def _step(sched: Scheduler):
    """One scheduling step, with the tokens computed as the engine would (a token sampled once caught up)."""
    out = sched.schedule()
    for c in out.chunks:
        r = c.request
        prompt = max(0, min(r.num_computed_tokens + c.num_new_tokens, len(r.prompt_token_ids)) - r.num_computed_tokens)
        r.num_computed_tokens += c.num_new_tokens
        sampled = r.num_computed_tokens == r.num_tokens
        if sampled:
            r.output_token_ids.append(0)
        sched.account(r, prompt, int(sampled))
    return out


def _flood_then_light(model_config, policy, kv_blocks: int, max_num_seqs: int = 8, served: float = 0.0):
    """Three flood requests running (decoding, 8-token prompts: one block each), one more of the flood waiting
    (it asks for more than it gets), then a light request with a 16-token prompt. `served`: weighted tokens of
    service the flood had before (VTC)."""
    sched = _sched(model_config, policy, kv_blocks, max_num_seqs)
    flood = [_add(sched, f"a{i}", "flood", 8) for i in range(3)]
    _step(sched)
    light = _add(sched, "b1", "light", 16)
    _add(sched, "a4", "flood", 8)
    if served:
        policy.on_tokens(flood[0], served, 0)
    return sched, flood, light


@pytest.fixture(scope="module")
def model_config(model_dir):
    return load_model_config(model_dir)


def test_vtc_preempts_the_over_served_tenant_when_pages_run_out(model_config):
    """Pages run out with a light request admitted last: FCFS (vLLM's rule) preempts it, the newest; VTC
    preempts the newest request of the flood, which has been served far more and asks for more."""
    for policy, served in ((Fcfs(), 0.0), (Vtc(), 20000.0)):
        sched, flood, light = _flood_then_light(model_config, policy, kv_blocks=4, served=served)
        _step(sched)  # light's prompt takes the last free block; the flood's fourth request finds none
        assert light.status == RequestStatus.RUNNING and len(sched.running) == 4
        out = _step(sched)  # light's 17th token needs a second block: there is none
        if isinstance(policy, Fcfs):
            assert out.preempted == ("b1",) and light.status == RequestStatus.PREEMPTED
        else:
            assert out.preempted == ("a2",) and flood[2].status == RequestStatus.PREEMPTED
            assert light.status == RequestStatus.RUNNING and any(c.request is light for c in out.chunks)
        sched.pager.check_integrity()


def test_vtc_without_a_tenant_ahead_preempts_like_vllm(model_config):
    """Tenants that have had about the same service: VTC keeps vLLM's rule (the newest is preempted)."""
    sched, flood, light = _flood_then_light(model_config, Vtc(), kv_blocks=4)
    _step(sched)
    out = _step(sched)
    assert out.preempted == ("b1",)


def test_vtc_light_request_takes_a_slot_from_the_flood_and_its_step_alone(model_config):
    """No sequence slot free: under VTC the light request preempts the flood's newest running request, and the
    step that computes its prompt carries nothing of the flood (its decodes wait a step); FCFS makes it wait."""
    sched, flood, light = _flood_then_light(model_config, Fcfs(), kv_blocks=64, max_num_seqs=3)
    out = _step(sched)
    assert light.status == RequestStatus.WAITING and not out.preempted
    assert {c.request.tenant for c in out.chunks} == {"flood"}

    vtc = Vtc()
    sched, flood, light = _flood_then_light(model_config, vtc, kv_blocks=64, max_num_seqs=3, served=20000.0)
    out = _step(sched)
    assert light.status == RequestStatus.RUNNING and out.preempted == ("a2",)
    assert [c.request.request_id for c in out.chunks] == ["b1"]
    assert light.output_token_ids == [0]  # its first token, in a step of its own
    out = _step(sched)  # no light prompt any more: the flood decodes again, beside the light decode
    assert {c.request.request_id for c in out.chunks} == {"a0", "a1", "b1"}
