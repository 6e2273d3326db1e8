"""Rotary position embeddings for flattened ragged batches, numerically identical to transformers.

The inverse frequencies follow transformers' ``ROPE_INIT_FUNCTIONS`` operation for operation (same
float32 ops in the same order), so that cos/sin, and thus attention, match the reference bit for bit.
"""

from __future__ import annotations

import math

import torch

from loraplex.errors import ModelLoadError

from .config import SUPPORTED_ROPE_TYPES, ModelConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:  # [dim/2] float32
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:  # [dim/2] -> [dim/2]
    factor = s["factor"]
    low_freq_factor = s["low_freq_factor"]
    high_freq_factor = s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(theta: float, dim: int, s: dict) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    original_max = s["original_max_position_embeddings"]

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp

    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor) + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, float(attention_factor)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32 on the CPU, attention scaling applied to cos and sin)."""
    scaling = cfg.rope_scaling or {"rope_type": "default"}
    rope_type = scaling.get("rope_type", "default")
    theta, dim = cfg.rope_theta, cfg.head_dim
    if rope_type == "default":
        return _base_inv_freq(theta, dim), 1.0
    if rope_type == "linear":
        # Dividing the frequencies by factor is the same as dividing the positions by it.
        return _base_inv_freq(theta, dim) / scaling["factor"], 1.0
    if rope_type in ("llama3", "yarn"):
        # As transformers does: without a stated pretraining length, the model's own length.
        scaling = dict(scaling)
        if scaling.get("original_max_position_embeddings") is None:
            scaling["original_max_position_embeddings"] = cfg.max_position_embeddings
    if rope_type == "llama3":
        return _llama3(_base_inv_freq(theta, dim), scaling), 1.0
    if rope_type == "yarn":
        if scaling.get("factor") is None:
            scaling["factor"] = cfg.max_position_embeddings / scaling["original_max_position_embeddings"]
        return _yarn(theta, dim, scaling)
    raise ModelLoadError(
        f"RoPE type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def rotate_half(x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding:
    """cos/sin for every position up to the model's limit, precomputed once, applied per token.

    Positions are per token (a flattened ragged batch mixes sequences), so there is no notion of
    a batch or sequence axis here: each token looks up its own row of the cache.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu", max_positions: int | None = None):
        self.head_dim = cfg.head_dim
        self.max_positions = max_positions or cfg.max_position_embeddings
        inv_freq, self.attention_scaling = rope_inv_freq(cfg)
        # Same float32 product as transformers' forward (positions.float() * inv_freq), so the
        # cache rows equal what it computes for those positions.
        positions = torch.arange(self.max_positions, dtype=torch.int64).float()
        freqs = positions[:, None] * inv_freq  # [P, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = (emb.cos() * self.attention_scaling).to(device)  # [P, D] float32
        self.sin = (emb.sin() * self.attention_scaling).to(device)  # [P, D] float32
        self.inv_freq = inv_freq.to(device)  # [D/2] float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D] in dtype for positions [T] int64 (each < max_positions)."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    @staticmethod
    def rotate(
        x: torch.Tensor,  # [T, n, head_dim]
        cos: torch.Tensor,  # [T, 1, head_dim] in x's dtype, from cos_sin
        sin: torch.Tensor,  # [T, 1, head_dim]
    ) -> torch.Tensor:  # [T, n, head_dim]
        """x rotated with precomputed cos/sin: the model computes them once per step for all
        layers and rotates q and k heads together (they sit side by side in the fused qkv output)."""
        return x * cos + rotate_half(x) * sin

    def apply(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        positions: torch.Tensor,  # [T] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated (q, k), each in its input dtype (transformers' rotate_half convention)."""
        # No bounds check here: it would force a device sync every step; the engine caps
        # positions at the model's length before they get here.
        cos, sin = self.cos_sin(positions, q.dtype)
        q_out = q * cos[:, None, :] + rotate_half(q) * sin[:, None, :]  # cos/sin broadcast over heads
        if k.dtype != q.dtype:
            cos, sin = self.cos_sin(positions, k.dtype)
        k_out = k * cos[:, None, :] + rotate_half(k) * sin[:, None, :]
        return q_out, k_out
