"""The engine with the Triton kernels forced (interpreted on the CPU) against transformers + PEFT.

A reduced form of tests/engine/test_parity.py: one tiny Llama, a few requests and adapters of mixed
ranks (one request without an adapter), few new tokens, and a token budget small enough that
prompts run in chunks beside decodes, with KV blocks of 4 tokens so that chunks start mid-block.
Checks greedy tokens and every logit, as check_outputs does there.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from factories import make_peft_adapter, make_tiny_model
from greedy_parity import check_greedy_parity
from loraplex.engine import LLM, SamplingParams

# Widths that are not powers of two (hidden 96, MLP 160); 3 query heads on one KV head (MQA).
# Pool rows of D = gcd(96, 96, 32, 160, 32) = 32: the interpreter's time grows with the number of
# programs, so a wider row than the engine tests' models (D = 8 or 16) keeps this test short.
MODEL = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=3,
             num_key_value_heads=1)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "r1": dict(r=1, target_modules=["q_proj", "v_proj"]),
    "r16": dict(r=16, target_modules=ALL, rank_pattern={"up_proj": 4}, use_rslora=True),
    "r64": dict(r=64, target_modules=["k_proj", "o_proj", "down_proj"]),
}
REQUEST_ADAPTERS = ["r16", None, "r64", "r1", "r16"]
MAX_NEW = 5


@dataclass
class Case:
    model_dir: Path
    adapter_dirs: dict[str, Path]
    prompts: list[list[int]]
    ref_tokens: list[list[int]]
    ref_logits: list[torch.Tensor]  # [P + n - 1, V]


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> Case:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("triton-parity")
    model_dir = make_tiny_model(tmp / "model", "llama", **MODEL)
    adapter_dirs = {}
    for name, spec in ADAPTERS.items():
        spec = dict(spec)
        r = spec.pop("r")
        adapter_dirs[name] = make_peft_adapter(model_dir, tmp / name, r=r, target_modules=spec.pop("target_modules"),
                                               lora_alpha=2 * r, **spec)
    rng = random.Random()
    prompts = [[rng.randrange(3, 257) for _ in range(rng.randint(3, 11))] for _ in REQUEST_ADAPTERS]

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = list(adapter_dirs)
    peft_model = PeftModel.from_pretrained(base, adapter_dirs[names[0]], adapter_name=names[0])
    for n in names[1:]:
        peft_model.load_adapter(adapter_dirs[n], adapter_name=n)
    peft_model.eval()
    ref_tokens, ref_logits = [], []
    with torch.no_grad():
        for p, a in zip(prompts, REQUEST_ADAPTERS):
            which = [a if a is not None else "__base__"]
            ids = torch.tensor([p])
            gen = peft_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=which,
                                      max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
            out = gen[0, len(p):].tolist()
            full = torch.tensor([p + out[:-1]])
            ref_tokens.append(out)
            ref_logits.append(peft_model(input_ids=full, adapter_names=which).logits[0].float())
    return Case(model_dir, adapter_dirs, prompts, ref_tokens, ref_logits)


def test_engine_with_triton_kernels_matches_peft(case):
    llm = LLM(str(case.model_dir), dtype="float32", device="cpu", max_lora_rank=64, kernels="triton",
              block_size=4, max_num_batched_tokens=12)
    assert llm.engine.ops.name == "triton"
    for name, d in case.adapter_dirs.items():
        llm.load_adapter(name, d)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, return_logits=True)
    outs = llm.generate(case.prompts, params, adapters=REQUEST_ADAPTERS)
    for i, out in enumerate(outs):
        assert out.finish_reason == "length"
        check_greedy_parity(f"request {i} (adapter {REQUEST_ADAPTERS[i]})", len(case.prompts[i]), out.token_ids,
                            out.prompt_logits, out.logits, case.ref_tokens[i], case.ref_logits[i])
    llm.engine.pager.check_integrity()
    assert llm.engine.stats().kv_pages == 0
