"""A random-weight bf16 model of Qwen2.5-1.5B's shape, built in-process (nothing downloaded): for timing
on a GPU, where the default 135M model is too small to say anything."""

from __future__ import annotations

from pathlib import Path

import torch

QWEN25_15B = dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=151645, bos_token_id=None, sliding_window=None,
    use_sliding_window=False,
)


def make_qwen25_15b_shape(out_dir: Path, device: str = "cuda", seed: int = 0) -> Path:
    """Save config.json + safetensors (bf16, random) to out_dir; reused if already there."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", **QWEN25_15B)
    torch.manual_seed(seed)
    with torch.device(device):  # initialising 1.5B weights on the GPU takes a second, on the CPU a minute
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
