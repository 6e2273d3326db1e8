"""EngineCore.stats' step and token counters: every token that runs through the model is counted once."""

from __future__ import annotations

import random

import pytest

from factories import make_tiny_model
from loraplex.config import EngineConfig
from loraplex.engine import EngineCore, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "llama", max_position_embeddings=256)


def test_tokens_count_prompt_chunks_and_decode_tokens(model_dir):
    rng = random.Random()
    # A small batch budget: the longer prompts run in several chunks, beside other requests' decode tokens.
    engine = EngineCore(EngineConfig(model=str(model_dir), max_lora_rank=16, pool_bytes=8 << 20, kernels="torch",
                                     max_num_batched_tokens=24))
    prompts = [[rng.randrange(3, 257) for _ in range(rng.randint(1, 60))] for _ in range(5)]
    outputs = [rng.randint(1, 9) for _ in prompts]
    for p, n in zip(prompts, outputs):
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    stats = engine.stats()
    assert stats.num_preemptions == 0 and stats.num_steps == steps
    # Each prompt token once; each output token but the last is fed back as the next step's input.
    assert stats.num_tokens == sum(len(p) + n - 1 for p, n in zip(prompts, outputs))
