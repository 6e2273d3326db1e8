"""SLO admission on the real engine (tiny model): the step cost is fitted from measured steps, a queued
request whose deadline can no longer be met is aborted before it runs, and check() refuses up front."""

from __future__ import annotations

import random
import time

import pytest
import torch

from factories import make_tiny_model
from loraplex.admission.slo import SloController
from loraplex.config import EngineConfig
from loraplex.engine.engine_core import EngineCore
from loraplex.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    torch.set_num_threads(1)
    d = make_tiny_model(tmp_path_factory.mktemp("slo-model"), "llama")
    core = EngineCore(EngineConfig(model=str(d), pool_bytes=16 << 20, max_num_seqs=4, max_num_batched_tokens=64,
                                   kernels="torch"))
    core.slo = SloController(64, 4)
    return core


def _run(core) -> dict:
    finals = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_fit_from_real_steps_then_early_abort(core):
    rng = random.Random()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i in range(12):  # warm the fit with real steps
        core.add_request([rng.randrange(3, 200) for _ in range(rng.randint(4, 60))], params, request_id=f"w{i}")
    _run(core)
    fitted = core.slo.cost
    assert fitted.samples >= core.slo.model.min_samples
    # The fit predicts real steps of this engine within a factor of two (a loaded 2-core machine is noisy).
    step = fitted.predict(64, 0)
    assert 0 < step < 10

    now = time.monotonic()
    for i in range(8):  # a queue of long requests without deadline
        core.add_request([rng.randrange(3, 200) for _ in range(60)], SamplingParams(max_tokens=30, ignore_eos=True,
                                                                                    temperature=0.0),
                         request_id=f"bulk{i}")
    core.add_request([5, 6, 7], params, request_id="hopeless", ttft_deadline=now + 1e-6)
    core.add_request([5, 6, 7], params, request_id="relaxed", ttft_deadline=now + 3600)
    finals = _run(core)
    assert finals["hopeless"].finish_reason == "slo_unreachable" and finals["hopeless"].token_ids == []
    assert finals["relaxed"].finish_reason == "length"
    assert all(finals[f"bulk{i}"].finish_reason == "length" for i in range(8))
    assert core.slo.aborted >= 1
    assert core.pager.stats().kv_pages == 0
    core.pager.check_integrity()


def test_check_refuses_what_the_queue_makes_impossible(core):
    core.slo.publish(core.scheduler.view())
    alone = core.slo.check(10, budget_s=60)
    assert alone.allowed and alone.retry_after_s == 0
    refused = core.slo.check(10, budget_s=alone.predicted_ttft_s / 10)
    assert not refused.allowed and refused.retry_after_s >= 1
    assert core.slo.check(10, budget_s=60, extra_s=120).allowed is False  # an adapter that loads too slowly
