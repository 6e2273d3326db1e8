"""Shared set-up for the engine parity tests: a random model, eight PEFT adapters, prompts, and
the transformers + PEFT reference run per request."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch

from factories import make_peft_adapter, make_tiny_model

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Ranks among 1..64, different target sets, rslora, rank_pattern, alpha_pattern, layers_to_transform.
ADAPTER_SPECS = [
    dict(r=1, target_modules=["q_proj", "v_proj"]),
    dict(r=4, target_modules=ALL, use_rslora=True),
    dict(r=8, target_modules=["o_proj", "down_proj"]),
    dict(r=16, target_modules=["gate_proj", "up_proj", "k_proj"], rank_pattern={"up_proj": 4}),
    dict(r=32, target_modules=ALL, alpha_pattern={"down_proj": 7}),
    dict(r=64, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    dict(r=8, target_modules=ALL, layers_to_transform=[0]),
    dict(r=16, target_modules=["v_proj", "down_proj"], use_rslora=True, rank_pattern={"v_proj": 2}),
]


@dataclass
class ParityCase:
    model_dir: Path
    adapter_dirs: dict[str, Path]
    prompts: list[list[int]]
    adapters: list[str | None]
    ref_tokens: list[list[int]]  # greedy tokens from transformers + PEFT
    ref_logits: list[torch.Tensor]  # [P + n - 1, V] teacher-forced logits over prompt + output
    max_new: int


def build_case(tmp: Path, arch: str, n_requests: int = 12, max_new: int = 32, prompt_lens: tuple[int, int] = (5, 40),
               **model_kw) -> ParityCase:
    """prompt_lens: the range prompt lengths are drawn from; model_kw: overrides of the family's tiny
    config (factories.ARCH_CONFIGS)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model(tmp / f"{arch}-model", arch, **model_kw)
    adapter_dirs = {}
    for i, spec in enumerate(ADAPTER_SPECS):
        spec = dict(spec)
        r = spec.pop("r")
        targets = spec.pop("target_modules")
        adapter_dirs[f"a{i}"] = make_peft_adapter(model_dir, tmp / f"{arch}-a{i}", r=r, target_modules=targets,
                                                  lora_alpha=2 * r, **spec)
    rng = random.Random()
    names = list(adapter_dirs) + [None] * 4
    adapters = [names[i % len(names)] for i in range(n_requests)]
    rng.shuffle(adapters)
    vocab = 257
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_lens))] for _ in range(n_requests)]

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names_list = list(adapter_dirs)
    peft_model = PeftModel.from_pretrained(base, adapter_dirs[names_list[0]], adapter_name=names_list[0])
    for n in names_list[1:]:
        peft_model.load_adapter(adapter_dirs[n], adapter_name=n)
    peft_model.eval()
    ref_tokens, ref_logits = [], []
    with torch.no_grad():
        for p, a in zip(prompts, adapters):
            names_arg = [a if a is not None else "__base__"]
            ids = torch.tensor([p])
            gen = peft_model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names_arg, max_new_tokens=max_new,
                min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0,
            )
            out = gen[0, len(p):].tolist()
            full = torch.tensor([p + out[:-1]])
            logits = peft_model(input_ids=full, adapter_names=names_arg).logits[0].float()
            ref_tokens.append(out)
            ref_logits.append(logits)
    return ParityCase(model_dir, adapter_dirs, prompts, adapters, ref_tokens, ref_logits, max_new)
