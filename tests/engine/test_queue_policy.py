"""Queue policies: FCFS, LIFO and VTC fairness, alone and inside the real engine."""

from __future__ import annotations

import random

import pytest
import torch

from factories import make_tiny_model
from loraplex.config import EngineConfig
from loraplex.engine.engine_core import EngineCore
from loraplex.engine.queue_policy import Fcfs, Lifo, Vtc, make_queue_policy
from loraplex.engine.request import Request
from loraplex.engine.sampling_params import SamplingParams
from loraplex.errors import ConfigError


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
