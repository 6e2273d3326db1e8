"""EngineConfig.kv_reserve_tokens: sequences take KV blocks ahead of their tokens where the pool has them free,
which changes where their K/V lies and nothing else: the same outputs, the same preemptions, no block past a
request's last token, every page back at the end."""

from __future__ import annotations

import random

import pytest

from factories import make_tiny_model
from loraplex.config import EngineConfig
from loraplex.engine import EngineCore, SamplingParams
from loraplex.errors import ConfigError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model"), "llama", max_position_embeddings=256)


def _run(model_dir, reserve: int, pool_bytes: int, prompts, outputs, kernels: str) -> tuple[list, int, int]:
    """(each request's tokens, preemptions, most reserved pages seen) of one engine over the requests."""
    engine = EngineCore(EngineConfig(model=str(model_dir), max_lora_rank=16, pool_bytes=pool_bytes, kernels=kernels,
                                     max_num_batched_tokens=32, block_size=4, kv_reserve_tokens=reserve))
    bs = engine.config.block_size
    reqs = [engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for p, n in zip(prompts, outputs)]
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, engine.pager.stats().kv_reserved_pages)
        for r, p, n in zip(reqs, prompts, outputs):  # never a block past the last token whose KV is written
            assert engine.pager.kv_num_blocks(r.request_id) <= -(-(len(p) + n - 1) // bs)
        engine.pager.check_integrity()
    stats = engine.pager.stats()
    assert stats.kv_pages == 0 and stats.kv_reserved_pages == 0
    return [list(r.output_token_ids) for r in reqs], engine.stats().num_preemptions, most


@pytest.mark.parametrize("pool_kib", [4096, 96])
@pytest.mark.parametrize("kernels", ["torch", "auto"])  # auto: the C++ kernels on a CPU where they build
def test_a_reserve_changes_no_output_and_no_preemption(model_dir, pool_kib, kernels):
    rng = random.Random()
    # The 96 KiB pool holds 128 tokens: at least three requests of 24-40 prompt tokens run before one no longer
    # fits, and their 20-30 outputs each outgrow what is left before any finishes, so it preempts.
    prompts = [[rng.randrange(3, 257) for _ in range(rng.randint(24, 40))] for _ in range(8)]
    outputs = [rng.randint(20, 30) for _ in prompts]
    exact = _run(model_dir, 0, pool_kib << 10, prompts, outputs, kernels)
    ahead = _run(model_dir, 16, pool_kib << 10, prompts, outputs, kernels)
    assert ahead[0] == exact[0] and ahead[1] == exact[1]
    assert exact[2] == 0 and ahead[2] > 0
    if pool_kib == 96:
        assert exact[1] > 0  # the small pool preempts: the reserve is given back first, as free pages would be


def test_a_negative_reserve_is_refused():
    with pytest.raises(ConfigError, match="kv_reserve_tokens"):
        EngineConfig(kv_reserve_tokens=-1)
