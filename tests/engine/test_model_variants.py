"""Model variants beyond the parity matrix: rope scaling, 4.x-style configs, half precision."""

from __future__ import annotations

import json

import pytest
import torch

from factories import make_tiny_model
from loraplex.engine import LLM, SamplingParams


def hf_greedy(model_dir, prompts, n, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def random_prompts(n, vocab=257):
    return [torch.randint(3, vocab, (int(torch.randint(4, 30, ())),)).tolist() for _ in range(n)]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ],
    ids=["llama3", "linear", "yarn"],
)
def test_rope_scaling_matches_transformers(tmp_path, rope):
    model_dir = make_tiny_model(tmp_path / "m", "llama", rope_parameters=rope, tie_word_embeddings=True)
    prompts = random_prompts(4)
    ref = hf_greedy(model_dir, prompts, 24)
    llm = LLM(str(model_dir), kernels="torch")
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref


def test_transformers_4x_config_layout(tmp_path):
    # transformers 4.x wrote rope_theta / rope_scaling at the top level, with "type" for the kind.
    model_dir = make_tiny_model(tmp_path / "m", "llama",
                                rope_parameters={"rope_type": "linear", "rope_theta": 20000.0, "factor": 2.0})
    prompts = random_prompts(3)
    ref = hf_greedy(model_dir, prompts, 16)
    cfg_path = model_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    rp = cfg.pop("rope_parameters")
    cfg["rope_theta"] = rp["rope_theta"]
    cfg["rope_scaling"] = {"type": "linear", "factor": 2.0}
    cfg_path.write_text(json.dumps(cfg))
    llm = LLM(str(model_dir), kernels="torch")
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_close_to_transformers(tmp_path, dtype):
    """Half precision rounds differently in different kernels, so compare logits loosely."""
    model_dir = make_tiny_model(tmp_path / "m", "qwen2")
    prompts = random_prompts(3)
    llm = LLM(str(model_dir), dtype=dtype, kernels="torch")
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, return_logits=True))
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = ref_model(input_ids=torch.tensor([p])).logits[0]
        err = float((o.prompt_logits - ref).abs().max() / ref.abs().max())
        assert err < 5e-2, f"{dtype}: relative logits error {err:.3e} against float32"
