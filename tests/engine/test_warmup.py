"""EngineCore.warmup: one throwaway request as large as the largest step, then the engine as it was."""

from __future__ import annotations

import random

import pytest
import torch

from factories import make_tiny_model
from loraplex.config import EngineConfig
from loraplex.engine import EngineCore, SamplingParams
from loraplex.errors import RequestError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "llama", max_position_embeddings=256)


def _engine(model_dir, **kw) -> EngineCore:
    kw.setdefault("pool_bytes", 8 << 20)
    kw.setdefault("kernels", "torch")
    return EngineCore(EngineConfig(model=str(model_dir), max_lora_rank=16, **kw))


def _greedy(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    reqs = [engine.add_request(p, GREEDY) for p in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
    return [done[r.request_id] for r in reqs]


def test_warmup_runs_the_largest_step_and_leaves_the_engine_as_it_was(model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 257) for _ in range(rng.randint(3, 40))] for _ in range(4)]
    cold = _engine(model_dir, max_num_batched_tokens=128)
    expected = _greedy(cold, prompts)

    engine = _engine(model_dir, max_num_batched_tokens=128)
    steps = []
    real_step = engine.runner.execute
    engine.runner.execute = lambda sched: steps.append(sum(c.num_new_tokens for c in sched.chunks)) or real_step(sched)
    assert engine.warmup() > 0
    assert steps[0] == 128  # a prompt that fills the token budget, in one step
    assert len(steps) == 2  # then one decode
    stats = engine.stats()
    assert (stats.num_waiting, stats.num_running, stats.kv_pages) == (0, 0, 0)
    assert not engine.requests
    engine.pager.check_integrity()
    assert engine.warmup() == 0.0  # once per engine
    assert len(steps) == 2
    engine.runner.execute = real_step
    assert _greedy(engine, prompts) == expected  # what it served next is what a cold engine serves


def test_warmup_fits_its_prompt_to_a_small_pool(model_dir):
    probe = _engine(model_dir)
    per_token = probe.pager.geometry.kv_pages_for_tokens(16) / 16
    page_bytes = probe.pager.geometry.page_bytes
    # A pool of about 40 tokens of KV: the 256-token budget (and the 253-token context cap) cannot fit.
    engine = _engine(model_dir, max_num_batched_tokens=256, pool_bytes=int(40 * per_token * page_bytes))
    steps = []
    real_step = engine.runner.execute
    engine.runner.execute = lambda sched: steps.append(sum(c.num_new_tokens for c in sched.chunks)) or real_step(sched)
    assert engine.warmup() > 0
    assert 0 < steps[0] <= 40
    assert engine.stats().kv_pages == 0


def test_warmup_refuses_a_busy_engine_and_changes_nothing(model_dir):
    engine = _engine(model_dir)
    req = engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(RequestError, match="idle engine"):
        engine.warmup()
    assert list(engine.requests) == [req.request_id]
    assert engine.stats().num_waiting == 1
    assert engine.stats().num_steps == 0


def test_triton_warmup_runs_a_throwaway_adapter_and_drops_it(model_dir):
    """With the Triton kernels (interpreted here), the warm-up also serves a prefill and a decode through a
    throwaway adapter beside a request without one, so that a GPU server's first adapter request does not
    wait for the LoRA kernels to compile; afterwards no adapter, page or request is left, and the engine
    serves what a cold one serves. The other backends build nothing at first use and skip it."""
    rng = random.Random()
    prompts = [[rng.randrange(3, 257) for _ in range(rng.randint(3, 20))] for _ in range(2)]
    engine = _engine(model_dir, kernels="triton", max_num_batched_tokens=32)
    assert engine.warmup() > 0
    stats, pool = engine.stats(), engine.pager.stats()
    assert pool.adapter_loads == 1  # the throwaway adapter was placed: the LoRA path ran
    assert (stats.adapter_pages, stats.resident_adapters, stats.kv_pages) == (0, 0, 0)
    assert engine.adapters.names() == [] and not engine.requests
    engine.pager.check_integrity()
    cold = _engine(model_dir, kernels="triton", max_num_batched_tokens=32)
    assert _greedy(engine, prompts) == _greedy(cold, prompts)

    plain = _engine(model_dir, max_num_batched_tokens=32)  # the torch kernels
    plain.warmup()
    assert plain.pager.stats().adapter_loads == 0
