"""Reading config.json as transformers 4.x and 5.x write it, for Llama, Qwen2 and Mistral."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from factories import make_tiny_model
from transformers import AutoConfig

from loraplex.errors import ModelLoadError
from loraplex.models.config import load_model_config, model_config_from_dict

ARCHS = ("llama", "qwen2", "mistral")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch) for arch in ARCHS}


def _config_only_copy(src: Path, dst: Path, **changes) -> Path:
    """A folder holding src's config.json (with changes; None deletes a key) and generation_config.json."""
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dst / "config.json").write_text(json.dumps(cfg))
    if (src / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    return dst


def _as_4x(cfg: dict) -> dict:
    """config.json the way transformers 4.x wrote it: rope_theta and rope_scaling at the top level."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    cfg["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **rope}
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg["transformers_version"] = "4.46.0"
    return cfg


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_config(tiny_models, arch):
    folder = tiny_models[arch]
    cfg = load_model_config(folder)
    hf = AutoConfig.from_pretrained(folder)
    assert cfg.architecture == arch
    assert cfg.vocab_size == hf.vocab_size
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_layers == hf.num_hidden_layers
    assert cfg.num_heads == hf.num_attention_heads
    assert cfg.num_kv_heads == hf.num_key_value_heads
    assert cfg.head_dim == hf.hidden_size // hf.num_attention_heads
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.rope_scaling is None
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert cfg.torch_dtype == torch.float32
    assert cfg.sliding_window is None and cfg.max_model_len == hf.max_position_embeddings
    # The biases the config implies are exactly the ones the checkpoint holds.
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == cfg.attention_bias
    assert ("model.layers.0.self_attn.o_proj.bias" in names) == cfg.o_bias
    assert ("model.layers.0.mlp.up_proj.bias" in names) == cfg.mlp_bias
    assert cfg.q_size == cfg.module_shape("q_proj")[1]


@pytest.mark.parametrize("arch", ARCHS)
def test_4x_config_reads_the_same(tiny_models, arch, tmp_path):
    src = tiny_models[arch]
    cfg5 = json.loads((src / "config.json").read_text())
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_as_4x(cfg5)))
    assert load_model_config(folder) == load_model_config(src)


def test_rope_scaling_is_normalised_from_both_formats():
    rng = random.Random()
    theta = rng.uniform(1e4, 1e6)
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192}
    base = {"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 131072}
    expected = {"rope_type": "llama3", **llama3}
    v5 = model_config_from_dict({**base, "rope_parameters": {"rope_theta": theta, "rope_type": "llama3", **llama3}})
    v4_type = model_config_from_dict({**base, "rope_theta": theta, "rope_scaling": {"type": "llama3", **llama3}})
    v4_rope_type = model_config_from_dict(
        {**base, "rope_theta": theta, "rope_scaling": {"rope_type": "llama3", **llama3}}
    )
    for cfg in (v5, v4_type, v4_rope_type):
        assert cfg.rope_theta == theta and cfg.rope_scaling == expected
    # Default RoPE, however it is spelled, normalises to None.
    for spelled in ({"rope_parameters": {"rope_theta": theta, "rope_type": "default"}},
                    {"rope_theta": theta, "rope_scaling": None},
                    {"rope_theta": theta, "rope_scaling": {"type": "default"}},
                    {"rope_theta": theta}):
        cfg = model_config_from_dict({**base, **spelled})
        assert cfg.rope_scaling is None and cfg.rope_theta == theta
    # Without any theta transformers assumes 10000; yarn without a pretraining length uses max positions.
    assert model_config_from_dict(base).rope_theta == 10000.0
    yarn = model_config_from_dict({**base, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    assert yarn.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 131072}


def test_head_dim_explicit_or_derived():
    rng = random.Random()
    heads = rng.choice([2, 4, 8])
    head_dim = rng.choice([32, 64, 128])
    base = {"model_type": "qwen2", "vocab_size": 100, "hidden_size": heads * 48, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": heads, "num_key_value_heads": heads // 2}
    assert model_config_from_dict(base).head_dim == 48
    cfg = model_config_from_dict({**base, "head_dim": head_dim})
    assert cfg.head_dim == head_dim and cfg.q_size == heads * head_dim and cfg.kv_size == heads // 2 * head_dim
    assert cfg.module_shape("o_proj") == (heads * head_dim, heads * 48)


def test_biases_per_family(tiny_models, tmp_path):
    llama = load_model_config(_config_only_copy(tiny_models["llama"], tmp_path / "b", attention_bias=True,
                                                mlp_bias=True))
    assert llama.attention_bias and llama.o_bias and llama.mlp_bias
    # Qwen2 always has q/k/v bias and never an o or MLP bias, whatever the config says.
    qwen = load_model_config(_config_only_copy(tiny_models["qwen2"], tmp_path / "q", attention_bias=False,
                                               mlp_bias=True))
    assert qwen.attention_bias and not qwen.o_bias and not qwen.mlp_bias
    mistral = load_model_config(tiny_models["mistral"])
    assert not (mistral.attention_bias or mistral.o_bias or mistral.mlp_bias)


def test_sliding_window(tiny_models, tmp_path):
    window = random.randrange(64, 400)
    m = load_model_config(_config_only_copy(tiny_models["mistral"], tmp_path / "m1", sliding_window=window))
    assert m.sliding_window == window and m.max_model_len == window
    # Absent from config.json means Mistral's default window (4096), capped by the model's length.
    m = load_model_config(_config_only_copy(tiny_models["mistral"], tmp_path / "m2", sliding_window=None))
    assert m.sliding_window == 4096 and m.max_model_len == 512

    # Qwen2's window counts only when use_sliding_window is set (and some layer slides).
    src = tiny_models["qwen2"]
    q = load_model_config(_config_only_copy(src, tmp_path / "q1", sliding_window=window))
    assert q.sliding_window is None
    q = load_model_config(_config_only_copy(src, tmp_path / "q2", sliding_window=window, use_sliding_window=True,
                                            layer_types=["full_attention", "sliding_attention"]))
    assert q.sliding_window == window and q.max_model_len == window
    q = load_model_config(_config_only_copy(src, tmp_path / "q3", sliding_window=window, use_sliding_window=True,
                                            layer_types=None, max_window_layers=28))
    assert q.sliding_window is None  # max_window_layers >= num layers: no layer slides
    q = load_model_config(_config_only_copy(src, tmp_path / "q4", sliding_window=window, use_sliding_window=True,
                                            layer_types=None, max_window_layers=0))
    assert q.sliding_window == window


def test_eos_and_dtype_sources(tiny_models, tmp_path):
    folder = _config_only_copy(tiny_models["llama"], tmp_path / "e", eos_token_id=[7, 9])
    assert load_model_config(folder).eos_token_ids == (2,)  # generation_config.json wins
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6], "bos_token_id": 3}))
    cfg = load_model_config(folder)
    assert cfg.eos_token_ids == (5, 6) and cfg.bos_token_id == 3
    (folder / "generation_config.json").unlink()
    assert load_model_config(folder).eos_token_ids == (7, 9)

    folder = _config_only_copy(tiny_models["llama"], tmp_path / "d", dtype=None, torch_dtype="bfloat16")
    assert load_model_config(folder).torch_dtype == torch.bfloat16
    folder = _config_only_copy(tiny_models["llama"], tmp_path / "n", dtype=None)
    assert load_model_config(folder).torch_dtype is None


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "gpt2"}, r"'gpt2'.*llama, qwen2, mistral"),
        ({"model_type": None}, r"model_type None"),
        ({"hidden_act": "gelu"}, r"hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "dynamic", "factor": 2.0}}, r"'dynamic'"),
        ({"rope_parameters": None, "rope_scaling": {"type": "longrope", "short_factor": [1.0]}}, r"'longrope'"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear"}}, r"'linear' needs factor"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0}}, r"low_freq_factor"),
        ({"hidden_size": None}, r"'hidden_size'"),
        ({"num_key_value_heads": 4}, r"not a multiple of num_key_value_heads=4"),
        ({"head_dim": 15}, r"head_dim=15 is odd"),
        ({"dtype": "int8"}, r"dtype 'int8'"),
        ({"eos_token_id": "</s>"}, r"eos_token_id"),
    ],
)
def test_refusals_name_the_problem(tiny_models, tmp_path, changes, message):
    folder = _config_only_copy(tiny_models["llama"], tmp_path / "bad", **changes)
    (folder / "generation_config.json").unlink()
    with pytest.raises(ModelLoadError, match=message):
        load_model_config(folder)


def test_missing_or_broken_files(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_config(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        load_model_config(tmp_path)
