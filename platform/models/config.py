"""The base model's shape, read from a Hugging Face config.json (transformers 4.x or 5.x)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code and the pager need to know about a Llama-family decoder."""

    architecture: str  # "llama" | "qwen2" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Normalised rope scaling: None for plain RoPE, else a dict with "rope_type" in
    # {"linear", "llama3", "yarn", "dynamic"?...} and that type's parameters (see models/rope.py).
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    mlp_bias: bool = False
    o_bias: bool = False  # o_proj bias (Llama's attention_bias also puts a bias on o_proj)
    sliding_window: int | None = None  # when set, loraplex caps the context at this length
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    torch_dtype: torch.dtype | None = None  # the checkpoint's own dtype, if stated
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_model_len(self) -> int:
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def module_shape(self, module: str) -> tuple[int, int]:
        """(in_features, out_features) of a target projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }[module]
