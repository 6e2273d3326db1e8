"""The model's small ops against transformers' own: RMSNorm (bit for bit) and RoPE on fused q/k heads."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from loraplex.models import cpu_gemm
from loraplex.models.config import model_config_from_dict
from loraplex.models.llama import linear, rms_norm
from loraplex.models.rope import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_rms_norm_equals_transformers(dtype, tokens):
    # float32 takes torch's rms_norm op, the half types the explicit formula: both must give exactly
    # what transformers' LlamaRMSNorm gives, or greedy parity could flip on a near tie.
    g = torch.Generator().manual_seed(tokens)
    hidden = 96
    ref = LlamaRMSNorm(hidden, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.1 * torch.randn(hidden, generator=g))
    x = (3 * torch.randn(tokens, hidden, generator=g)).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, ref.weight, 1e-5), ref(x))


def test_rotate_on_fused_heads_equals_apply():
    cfg = model_config_from_dict(
        {"model_type": "llama", "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2,
         "intermediate_size": 64, "num_hidden_layers": 1, "vocab_size": 100, "max_position_embeddings": 256}
    )
    rope = RotaryEmbedding(cfg)
    t, nh, nkv, hd = 7, 6, 2, cfg.head_dim
    qk = torch.randn(t, nh + nkv, hd)
    positions = torch.tensor([0, 3, 9, 10, 11, 200, 255])
    q_ref, k_ref = rope.apply(qk[:, :nh], qk[:, nh:], positions)
    cos, sin = rope.cos_sin(positions, torch.float32)
    out = RotaryEmbedding.rotate(qk, cos[:, None], sin[:, None])
    assert torch.equal(out[:, :nh], q_ref)
    assert torch.equal(out[:, nh:], k_ref)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_layouts_agree(bias):
    x = torch.randn(5, 24, dtype=torch.float64)
    w = torch.randn(40, 24, dtype=torch.float64)  # [out, in]
    b = torch.randn(40, dtype=torch.float64) if bias else None
    ref = torch.nn.functional.linear(x, w, b)
    assert torch.allclose(linear(x, w, b, "out_in"), ref)
    assert torch.allclose(linear(x, w.t().contiguous(), b, "in_out"), ref)


@pytest.mark.parametrize("bias", [False, True])
def test_onednn_packed_linear_matches_float64(bias):
    if not cpu_gemm.onednn_available():
        pytest.skip("this torch has no usable oneDNN linear")
    t, k, n = (int(v) for v in torch.randint(1, 300, (3,)))
    x = torch.randn(t, k + 3)[:, 2 : 2 + k]  # a column slice, as the model passes qkv and attention views
    w = torch.randn(n, k)  # [out, in]
    b = torch.randn(n) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = linear(x, cpu_gemm.pack(w), b, "onednn")
    assert got.shape == (t, n) and got.dtype == torch.float32
    assert ((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item() < 1e-5
