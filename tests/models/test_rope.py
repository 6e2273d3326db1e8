"""RoPE against transformers' own rotary embeddings, for every supported type."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

from loraplex.errors import ModelLoadError
from loraplex.models.config import model_config_from_dict
from loraplex.models.rope import RotaryEmbedding, rope_inv_freq

HF_CLASSES = {
    "llama": (LlamaConfig, LlamaRotaryEmbedding),
    "qwen2": (Qwen2Config, Qwen2RotaryEmbedding),
    "mistral": (MistralConfig, MistralRotaryEmbedding),
}

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
ROPE_CASES = {
    "default": (None, 2048),
    "linear": ({"rope_type": "linear", "factor": 4.0}, 2048),
    "llama3": (LLAMA3, 16384),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}, 8192),
    "yarn-tuned": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
                    "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}, 8192),
    "yarn-attention-factor": ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096,
                               "attention_factor": 1.25, "truncate": False}, 8192),
}


def _shape(rng: random.Random) -> dict:
    head_dim = rng.choice([16, 32, 64, 128])
    kv_heads = rng.choice([1, 2, 3])
    heads = kv_heads * rng.choice([1, 2, 3])
    # An explicit head_dim that is not hidden/heads half the time, as in Qwen3 or Gemma-style configs.
    return dict(hidden_size=heads * head_dim * rng.choice([1, 2]), num_attention_heads=heads,
                num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=64, num_hidden_layers=1,
                vocab_size=100)


def _configs(arch: str, rope: dict | None, max_pos: int, theta: float, rng: random.Random):
    """(transformers config, loraplex ModelConfig) describing the same model."""
    hf_cls, _ = HF_CLASSES[arch]
    shape = _shape(rng)
    rope_parameters = {"rope_theta": theta, **(rope or {"rope_type": "default"})}
    hf = hf_cls(**shape, max_position_embeddings=max_pos, rope_parameters=dict(rope_parameters))
    ours = model_config_from_dict(
        {"model_type": arch, **shape, "max_position_embeddings": max_pos, "rope_parameters": dict(rope_parameters)}
    )
    return hf, ours


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_inv_freq_matches_transformers(case):
    rope, max_pos = ROPE_CASES[case]
    rng = random.Random()
    hf, ours = _configs("llama", rope, max_pos, rng.choice([10000.0, 500000.0, rng.uniform(1e3, 1e6)]), rng)
    inv_freq, scaling = rope_inv_freq(ours)
    if rope is None:
        ref_inv_freq, ref_scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        ref_inv_freq, ref_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (ours.head_dim // 2,)
    assert torch.equal(inv_freq, ref_inv_freq)
    assert scaling == pytest.approx(ref_scaling, rel=0, abs=0)
    if case != "default":
        assert not torch.equal(inv_freq, LlamaRotaryEmbedding.compute_default_rope_parameters(hf)[0])


def test_inv_freq_from_4x_config_equals_5x():
    """transformers 4.x wrote rope_theta and rope_scaling (type key "type") at the top level."""
    rng = random.Random()
    shape = _shape(rng)
    theta = rng.uniform(1e4, 1e6)
    for rope in (ROPE_CASES["llama3"][0], ROPE_CASES["yarn"][0], ROPE_CASES["linear"][0]):
        params = {k: v for k, v in rope.items() if k != "rope_type"}
        old = model_config_from_dict({"model_type": "llama", **shape, "max_position_embeddings": 16384,
                                      "rope_theta": theta, "rope_scaling": {"type": rope["rope_type"], **params}})
        new = model_config_from_dict({"model_type": "llama", **shape, "max_position_embeddings": 16384,
                                      "rope_parameters": {"rope_theta": theta, **rope}})
        assert old.rope_scaling == new.rope_scaling
        assert torch.equal(rope_inv_freq(old)[0], rope_inv_freq(new)[0])


@pytest.mark.parametrize("arch", sorted(HF_CLASSES))
@pytest.mark.parametrize("case", sorted(ROPE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_matches_transformers_on_ragged_batch(arch, case, dtype):
    rope, max_pos = ROPE_CASES[case]
    rng = random.Random()
    hf, ours = _configs(arch, rope, max_pos, rng.choice([10000.0, 100000.0, 1e6]), rng)
    ref_rope = HF_CLASSES[arch][1](hf)
    ours_rope = RotaryEmbedding(ours, "cpu")

    # A flattened ragged batch: a long prefill chunk starting mid-sequence, single decode tokens at
    # scattered positions (including the last one the cache holds), another short prefill.
    seq_positions = [
        torch.arange(start, start + n)
        for start, n in [(rng.randrange(0, max_pos - 40), 37), (max_pos - 1, 1), (0, 5),
                         (rng.randrange(0, max_pos), 1), (rng.randrange(0, max_pos - 3), 3)]
    ]
    positions = torch.cat(seq_positions)  # [T]
    t = positions.numel()
    q = torch.randn(t, ours.num_heads, ours.head_dim, dtype=dtype)
    k = torch.randn(t, ours.num_kv_heads, ours.head_dim, dtype=dtype)

    q_out, k_out = ours_rope.apply(q, k, positions)
    assert q_out.dtype == dtype and k_out.dtype == dtype
    assert q_out.shape == q.shape and k_out.shape == k.shape

    # transformers works per sequence on [B, heads, S, D]; run each sequence on its own.
    start = 0
    for pos in seq_positions:
        n = pos.numel()
        cos, sin = ref_rope(q, pos[None, :])  # [1, n, D] in q's dtype
        q_ref, k_ref = apply_rotary_pos_emb(
            q[start:start + n].transpose(0, 1)[None], k[start:start + n].transpose(0, 1)[None], cos, sin
        )
        assert torch.equal(q_out[start:start + n], q_ref[0].transpose(0, 1))
        assert torch.equal(k_out[start:start + n], k_ref[0].transpose(0, 1))
        start += n


def test_rotation_preserves_norm_and_relative_positions():
    """Rotations keep vector norms, and q.k depends only on the distance between positions."""
    rng = random.Random()
    _, cfg = _configs("llama", None, 4096, 10000.0, rng)
    rope = RotaryEmbedding(cfg)
    q = torch.randn(1, cfg.num_heads, cfg.head_dim)
    k = torch.randn(1, cfg.num_kv_heads, cfg.head_dim)
    a, shift = rng.randrange(0, 2000), rng.randrange(1, 2000)
    q1, k1 = rope.apply(q, k, torch.tensor([a]))
    assert torch.allclose(q1.norm(dim=-1), q.norm(dim=-1), rtol=1e-5)

    def score(pq: int, pk: int) -> torch.Tensor:
        rq, _ = rope.apply(q, k, torch.tensor([pq]))
        _, rk = rope.apply(q, k, torch.tensor([pk]))
        return (rq[0, 0] * rk[0, 0]).sum()

    assert torch.allclose(score(a + 7, a), score(a + 7 + shift, a + shift), atol=1e-3)


def test_cache_covers_max_positions_and_can_be_capped():
    rng = random.Random()
    _, cfg = _configs("qwen2", None, 1024, 1e6, rng)
    full = RotaryEmbedding(cfg)
    assert full.cos.shape == (1024, cfg.head_dim) and full.cos.dtype == torch.float32
    capped = RotaryEmbedding(cfg, max_positions=100)
    assert capped.cos.shape == (100, cfg.head_dim)
    assert torch.equal(capped.sin, full.sin[:100])


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su", "made-up"])
def test_unsupported_rope_types_are_refused(rope_type):
    _, cfg = _configs("llama", None, 512, 10000.0, random.Random())
    cfg = dataclasses.replace(cfg, rope_scaling={"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(ModelLoadError, match=rope_type):
        rope_inv_freq(cfg)
    with pytest.raises(ModelLoadError, match=rope_type):
        RotaryEmbedding(cfg)


def test_hand_built_scaling_falls_back_to_model_length_like_transformers():
    """A ModelConfig built in code may leave out the pretraining length (and yarn's factor)."""
    rng = random.Random()
    for rope in ({"rope_type": "yarn", "factor": 4.0}, {"rope_type": "yarn", "factor": None,
                                                         "original_max_position_embeddings": 1024},
                 {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}):
        hf, ours = _configs("llama", None, 4096, 10000.0, rng)
        ours = dataclasses.replace(ours, rope_scaling=dict(rope))
        hf = LlamaConfig(**{k: getattr(hf, k) for k in ("hidden_size", "num_attention_heads", "head_dim",
                                                        "num_key_value_heads", "intermediate_size")},
                         max_position_embeddings=4096, rope_parameters={"rope_theta": 10000.0, **rope})
        ref_inv_freq, ref_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
        inv_freq, scaling = rope_inv_freq(ours)
        assert torch.equal(inv_freq, ref_inv_freq) and scaling == ref_scaling
