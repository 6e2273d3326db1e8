"""The C++ RoPE kernel (kernels/cpu_rope.cpp) against float64 and against the model's torch rotation.

Where the kernel cannot be built the tests skip with the build error, except under CI, where the build
is part of what is tested.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_testkit import rel_err
from loraplex.kernels import cpu_rope
from loraplex.models.config import model_config_from_dict
from loraplex.models.rope import RotaryEmbedding, rotate_half
from native_kernels import require_built


@pytest.fixture(scope="module", autouse=True)
def built():
    require_built("cpu_rope", cpu_rope.available(), "RoPE kernel")


@settings(max_examples=40, deadline=None)
@given(t=st.integers(0, 40), half=st.integers(1, 70), q_heads=st.integers(1, 6), k_heads=st.integers(0, 3),
       v_cols=st.integers(0, 40), seed=st.integers(0, 2**31 - 1))
def test_rope_rotates_the_q_and_k_heads_in_place(t, half, q_heads, k_heads, v_cols, seed):
    g = torch.Generator().manual_seed(seed)
    hd = 2 * half
    ncols = (q_heads + k_heads) * hd
    x = torch.randn(t, ncols + v_cols, generator=g) * 3  # q | k | v, as the fused projection's output
    angle = torch.rand(t, half, generator=g, dtype=torch.float64) * 1000
    cos = torch.cat([angle.cos(), angle.cos()], dim=1).float()  # [T, hd], as RotaryEmbedding.cos_sin
    sin = torch.cat([angle.sin(), angle.sin()], dim=1).float()
    before = x.clone()
    cpu_rope.rope_(x, ncols, cos, sin)
    nheads = q_heads + k_heads
    heads = before[:, :ncols].double().view(t, nheads, hd)
    ref = heads * cos.double()[:, None] + rotate_half(heads) * sin.double()[:, None]
    if t:
        assert rel_err(x[:, :ncols].reshape(t, nheads, hd), ref) < 1e-6
    assert torch.equal(x[:, ncols:], before[:, ncols:])  # v untouched


def test_rope_matches_the_models_torch_rotation_on_strided_rows():
    cfg = model_config_from_dict({"model_type": "llama", "hidden_size": 96, "num_attention_heads": 6,
                                  "num_key_value_heads": 2, "intermediate_size": 64, "num_hidden_layers": 1,
                                  "vocab_size": 100, "max_position_embeddings": 4096})
    rope = RotaryEmbedding(cfg)
    positions = torch.randint(0, 4096, (37,))
    cos, sin = rope.cos_sin(positions, torch.float32)
    wide = torch.randn(37, 200)
    qkv = wide[:, :160]  # q 96 | k 32 | v 32, rows strided by 200
    ref = rope.rotate(qkv[:, :128].reshape(37, 8, 16).clone(), cos[:, None], sin[:, None])
    cpu_rope.rope_(qkv, 128, cos, sin)
    torch.testing.assert_close(qkv[:, :128].reshape(37, 8, 16), ref, rtol=1e-6, atol=1e-6)


def test_rope_refuses_bad_shapes():
    x, cos = torch.randn(4, 10), torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="whole heads"):
        cpu_rope.rope_(x, 6, cos, cos.clone())
    with pytest.raises(RuntimeError, match="T rows"):
        cpu_rope.rope_(x, 8, torch.randn(3, 4), torch.randn(3, 4))
