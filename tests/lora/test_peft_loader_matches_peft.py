"""A loaded adapter's scale * B @ A equals what PEFT itself computes, for every supported config feature."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import make_peft_adapter
from loraplex.lora.peft_loader import load_peft_adapter
from loraplex.lora.types import MODULE_INDEX, TARGET_MODULES, LoraAdapter
from loraplex.models.config import load_model_config
from peft_reference import peft_modules

MAX_RANK = 64


def assert_matches_peft(adapter: LoraAdapter, model_dir: Path, adapter_dir: Path) -> None:
    reference = peft_modules(model_dir, adapter_dir)
    loaded = {(m.layer, m.module): m for m in adapter.modules}
    assert loaded.keys() == reference.keys()
    for key, ref in reference.items():
        m = loaded[key]
        assert m.rank == ref.rank, key
        assert m.scale == pytest.approx(ref.scale, rel=1e-12), key
        assert m.a.shape == (m.rank, ref.base.in_features) and m.b.shape == (ref.base.out_features, m.rank)
        torch.testing.assert_close(m.scale * m.b @ m.a, ref.delta, rtol=1e-5, atol=1e-6)
    # Modules come in (layer, TARGET_MODULES) order and max_rank is the largest rank.
    order = [(m.layer, MODULE_INDEX[m.module]) for m in adapter.modules]
    assert order == sorted(order)
    assert adapter.max_rank == max(m.rank for m in adapter.modules)


def load(model_dir: Path, adapter_dir: Path, **kwargs) -> LoraAdapter:
    return load_peft_adapter("t", adapter_dir, load_model_config(model_dir), kwargs.pop("max_lora_rank", MAX_RANK),
                             **kwargs)


@pytest.mark.parametrize("r", [1, 4, 16, 64])
def test_ranks_match_peft(llama_dir, tmp_path, r):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=r, lora_alpha=2 * r + 3)
    adapter = load(llama_dir, adapter_dir)
    assert {m.rank for m in adapter.modules} == {r}
    assert {m.module for m in adapter.modules} == {"q_proj", "v_proj"}
    assert adapter.max_rank == r
    assert_matches_peft(adapter, llama_dir, adapter_dir)


def test_rslora_scale_is_alpha_over_sqrt_rank(llama_dir, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=16, lora_alpha=7, use_rslora=True)
    adapter = load(llama_dir, adapter_dir)
    assert all(m.scale == pytest.approx(7 / math.sqrt(16)) for m in adapter.modules)
    assert_matches_peft(adapter, llama_dir, adapter_dir)


def test_rank_and_alpha_patterns_match_peft(llama_dir, tmp_path):
    adapter_dir = make_peft_adapter(
        llama_dir, tmp_path / "a", r=8, lora_alpha=16,
        target_modules=TARGET_MODULES,
        # First matching key wins: layer 0's q_proj gets 3, the other q_projs 2.
        rank_pattern={"model.layers.0.self_attn.q_proj": 3, "q_proj": 2, r"layers\.2\..*up_proj": 5, "down_proj": 12},
        alpha_pattern={"v_proj": 3.5, r"layers\.1\.mlp\.gate_proj": 40},
    )
    adapter = load(llama_dir, adapter_dir)
    ranks = {(m.layer, m.module): m.rank for m in adapter.modules}
    assert ranks[(0, "q_proj")] == 3 and ranks[(1, "q_proj")] == 2 and ranks[(2, "up_proj")] == 5
    assert ranks[(1, "up_proj")] == 8 and ranks[(0, "down_proj")] == 12
    scales = {(m.layer, m.module): m.scale for m in adapter.modules}
    assert scales[(2, "v_proj")] == pytest.approx(3.5 / 8) and scales[(1, "gate_proj")] == pytest.approx(40 / 8)
    assert_matches_peft(adapter, llama_dir, adapter_dir)


def test_rslora_with_patterns_matches_peft(llama_dir, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=4, lora_alpha=9, use_rslora=True,
                                    target_modules=("k_proj", "o_proj"), rank_pattern={"o_proj": 9},
                                    alpha_pattern={"k_proj": 2})
    assert_matches_peft(load(llama_dir, adapter_dir), llama_dir, adapter_dir)


@pytest.mark.parametrize("layers", [[0, 2], 1])
def test_layers_to_transform_match_peft(llama_dir, tmp_path, layers):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", target_modules=("q_proj", "down_proj"),
                                    layers_to_transform=layers)
    adapter = load(llama_dir, adapter_dir)
    assert {m.layer for m in adapter.modules} == ({0, 2} if layers == [0, 2] else {1})
    assert_matches_peft(adapter, llama_dir, adapter_dir)


@pytest.mark.parametrize(
    "targets",
    [TARGET_MODULES, ("o_proj", "down_proj"), ("gate_proj",), ("k_proj", "up_proj", "v_proj"), "all-linear",
     r".*\.(k|up)_proj"],
    ids=["all7", "o-down", "gate", "k-up-v", "all-linear", "regex"],
)
def test_target_subsets_match_peft(llama_dir, tmp_path, targets):
    if isinstance(targets, str):  # make_peft_adapter takes a list; PEFT also takes these strings
        adapter_dir = _adapter_with_string_targets(llama_dir, tmp_path / "a", targets)
    else:
        adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=4, target_modules=targets)
    adapter = load(llama_dir, adapter_dir)
    expected = {"all-linear": TARGET_MODULES, r".*\.(k|up)_proj": ("k_proj", "up_proj")}.get(targets, targets)
    assert adapter.target_modules == tuple(m for m in TARGET_MODULES if m in expected)
    n_layers = load_model_config(llama_dir).num_layers
    assert len(adapter.modules) == n_layers * len(expected)
    assert_matches_peft(adapter, llama_dir, adapter_dir)


def _adapter_with_string_targets(model_dir: Path, out: Path, targets: str) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(r=4, target_modules=targets))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures_match_peft(request, tmp_path, arch):
    model_dir = request.getfixturevalue(f"{arch}_dir")
    adapter_dir = make_peft_adapter(model_dir, tmp_path / "a", r=6, lora_alpha=5, target_modules=TARGET_MODULES)
    adapter = load(model_dir, adapter_dir)
    assert adapter.target_modules == TARGET_MODULES
    assert_matches_peft(adapter, model_dir, adapter_dir)


def test_projection_forward_matches_peft(qwen2_dir, tmp_path):
    """base(x) + scale * (x @ a.T) @ b.T is PEFT's lora.Linear forward (Qwen2: the base q/k/v carry a bias)."""
    adapter_dir = make_peft_adapter(qwen2_dir, tmp_path / "a", r=5, target_modules=("q_proj", "v_proj", "down_proj"))
    adapter = load(qwen2_dir, adapter_dir)
    reference = peft_modules(qwen2_dir, adapter_dir)
    for m in adapter.modules:
        ref = reference[(m.layer, m.module)]
        x = torch.randn(7, m.a.shape[1])  # [tokens, in_features]
        with torch.no_grad():
            expected = ref.lora_layer(x)
            got = ref.base(x) + m.scale * (x @ m.a.T) @ m.b.T
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_to_dtype(llama_dir, tmp_path, dtype):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=4)
    full = load(llama_dir, adapter_dir)
    half = load(llama_dir, adapter_dir, dtype=dtype)
    assert all(m.a.dtype == dtype and m.b.dtype == dtype for m in half.modules)
    for f, h in zip(full.modules, half.modules):
        assert (f.layer, f.module, f.rank, f.scale) == (h.layer, h.module, h.rank, h.scale)
        assert torch.equal(f.a.to(dtype), h.a) and torch.equal(f.b.to(dtype), h.b)
    assert half.nbytes * 2 == full.nbytes


def test_key_spellings_without_prefix_and_with_adapter_name(llama_dir, tmp_path):
    """Keys without base_model.model. and with an adapter segment (lora_A.default.weight) load the same."""
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=3, target_modules=("q_proj", "gate_proj"))
    reference = load(llama_dir, adapter_dir)
    weights = load_file(adapter_dir / "adapter_model.safetensors")
    renamed = {k.removeprefix("base_model.model.").replace(".weight", ".default.weight"): v for k, v in weights.items()}
    save_file(renamed, adapter_dir / "adapter_model.safetensors")
    adapter = load(llama_dir, adapter_dir)
    assert [(m.layer, m.module, m.rank, m.scale) for m in adapter.modules] == [
        (m.layer, m.module, m.rank, m.scale) for m in reference.modules]
    assert all(torch.equal(x.a, y.a) and torch.equal(x.b, y.b) for x, y in zip(adapter.modules, reference.modules))


def test_adapter_records_name_source_and_config(llama_dir, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=2)
    adapter = load_peft_adapter("tenant-7/sql", str(adapter_dir), load_model_config(llama_dir), 8)
    assert adapter.name == "tenant-7/sql" and adapter.source == str(adapter_dir)
    assert adapter.config["r"] == 2 and adapter.config["peft_type"] == "LORA"
