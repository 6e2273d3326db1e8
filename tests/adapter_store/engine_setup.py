"""An engine on the tiny model, and greedy runs that return logits, for bridge and scale tests."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from loraplex.engine import LLM, SamplingParams

def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, return_logits=True)


def tiny_llm(model_dir: Path, max_lora_rank: int = 16) -> LLM:
    return LLM(str(model_dir), pool_bytes=64 << 20, max_lora_rank=max_lora_rank, max_num_seqs=128)


def random_prompts(n: int, vocab: int) -> list[list[int]]:
    return [[random.randrange(3, vocab) for _ in range(random.randint(2, 8))] for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], adapters: list[str | None], max_tokens: int = 3):
    """Greedy outputs with the logits of every prompt and output position (what parity compares)."""
    outs = llm.generate(prompts, greedy(max_tokens), adapters=adapters)
    return [(o.token_ids, torch.cat([o.prompt_logits, o.logits])) for o in outs]


def assert_same_outputs(got, want, where: str = "") -> None:
    for i, ((tokens, logits), (ref_tokens, ref_logits)) in enumerate(zip(got, want, strict=True)):
        assert tokens == ref_tokens, (where, i)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5, msg=f"{where} request {i}")
