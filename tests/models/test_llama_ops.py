"""The model's small ops against transformers' own: RMSNorm (bit for bit) and RoPE on fused q/k heads; its
linear in every weight layout against float64, and which layout a gemm setting gives (cpu_gemm.choose)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from loraplex.config import EngineConfig
from loraplex.errors import ConfigError
from loraplex.kernels import cpu_linear
from loraplex.models import cpu_gemm
from loraplex.models.config import model_config_from_dict
from loraplex.models.llama import linear, rms_norm
from loraplex.models.rope import RotaryEmbedding
from native_kernels import require_built, skip_or_fail


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


def _skip_unless_usable(layout: str) -> None:
    if layout == "onednn" and not cpu_gemm.onednn_available():
        skip_or_fail("this torch has no usable oneDNN linear")
    if layout == "packed":
        require_built("cpu_linear", cpu_linear.available(), "linear kernel")


@pytest.mark.parametrize("layout", cpu_gemm.PACKED_LAYOUTS)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_float64(bias, layout):
    _skip_unless_usable(layout)
    t, k, n = (int(v) for v in torch.randint(1, 300, (3,)))
    x = torch.randn(t, k + 3)[:, 2 : 2 + k]  # a column slice, as the model passes qkv and attention views
    w = torch.randn(n, k)  # [out, in]
    b = torch.randn(n) if bias else None
    w_before = w.clone()
    ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    got = linear(x, cpu_gemm.pack(w, layout), b, layout)
    assert torch.equal(w, w_before)
    assert got.shape == (t, n) and got.dtype == torch.float32
    # Against each element's float32 summation bound, sum_k |x w| + |b|: max |ref| could be a lone
    # near-cancelled element when t and n are 1.
    bound = x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())
    assert ((got.double() - ref).abs() <= 1e-5 * bound).all(), (t, k, n)


def test_packed_weights_moved_onto_huge_pages_compute_the_same():
    require_built("cpu_linear", cpu_linear.available(), "packed GEMM")
    ws = [cpu_gemm.pack(torch.randn(n, k), "packed") for n, k in ((96, 40), (7, 300), (1024, 576))]
    moved = cpu_gemm.on_huge_pages(ws)
    storage = moved[0].panels.untyped_storage().data_ptr()
    assert moved[0].panels.data_ptr() % (2 << 20) == 0  # the buffer starts on a 2 MiB page
    for w, m in zip(ws, moved):
        assert m.out_features == w.out_features and torch.equal(m.panels, w.panels)
        assert m.panels.untyped_storage().data_ptr() == storage  # one buffer for all
        x = torch.randn(5, w.panels.shape[1])
        assert torch.equal(linear(x, m, None, "packed"), linear(x, w, None, "packed"))


# -- cpu_gemm.choose: which layout a gemm setting gives ---------------------------------------------------


def test_gemm_auto_prefers_the_packed_kernel_then_onednn_then_mm():
    cpu = torch.device("cpu")
    expected = "packed" if cpu_linear.available() else "onednn" if cpu_gemm.onednn_available() else None
    assert cpu_gemm.choose("auto", cpu, torch.float32) == expected
    # Where neither prepacked layout applies, auto quietly takes plain tensors (mm).
    assert cpu_gemm.choose("auto", cpu, torch.float64) is None
    assert cpu_gemm.choose("auto", cpu, torch.bfloat16) is None
    assert cpu_gemm.choose("auto", torch.device("meta"), torch.float32) is None


@pytest.mark.parametrize("layout", cpu_gemm.PACKED_LAYOUTS)
def test_gemm_asked_by_name_is_held_or_refused(layout):
    cpu = torch.device("cpu")
    _skip_unless_usable(layout)
    assert cpu_gemm.choose(layout, cpu, torch.float32) == layout
    for device, dtype in [(cpu, torch.float64), (cpu, torch.float16), (torch.device("meta"), torch.float32)]:
        with pytest.raises(ConfigError, match=f"gemm '{layout}' was asked for, but it runs only on the CPU in float32"):
            cpu_gemm.choose(layout, device, dtype)


def test_gemm_mm_keeps_plain_tensors():
    for device, dtype in [(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.float64),
                          (torch.device("meta"), torch.float16)]:
        assert cpu_gemm.choose("mm", device, dtype) is None


@pytest.mark.parametrize("name", ["bogus", "", "PACKED", "in_out", "out_in"])
def test_gemm_unknown_name_is_refused(name):
    assert name not in cpu_gemm.GEMM_CHOICES
    with pytest.raises(ConfigError, match="is not one of auto, packed, onednn, mm"):
        cpu_gemm.choose(name, torch.device("cpu"), torch.float32)
    with pytest.raises(ConfigError, match="is not one of auto, packed, onednn, mm"):
        EngineConfig(gemm=name)
    EngineConfig(gemm="packed")  # a known name passes the config check, whether or not it runs here
