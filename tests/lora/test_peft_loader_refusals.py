"""load_peft_adapter refuses unservable adapters (made with real PEFT) with a message that names the problem."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import edit_adapter_config, make_peft_adapter, make_tiny_model
from loraplex.errors import AdapterError, ConfigError
from loraplex.lora.peft_loader import load_peft_adapter
from loraplex.models.config import ModelConfig

WEIGHTS = "adapter_model.safetensors"


def refused(config: ModelConfig, adapter_dir: Path, *fragments: str, max_lora_rank: int = 64,
            dtype: torch.dtype = torch.float32) -> str:
    with pytest.raises(AdapterError) as e:
        load_peft_adapter("tenant-a/bad", adapter_dir, config, max_lora_rank, dtype)
    message = str(e.value)
    assert "'tenant-a/bad'" in message and str(adapter_dir) in message  # says which adapter
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def rewrite_weights(adapter_dir: Path, edit) -> None:
    weights = load_file(adapter_dir / WEIGHTS)
    save_file(edit(weights), adapter_dir / WEIGHTS)


class _UnpickleTrap:
    """Unpickling this creates a folder: proof that a file was (or was not) unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


class _TorchlessUnpickler(pickle.Unpickler):
    """Plain pickle over torch.save's object pickle, with no torch code run: tensors and storages come back
    as None. Enough to show what any unpickling of the file would execute."""

    def find_class(self, module: str, name: str):
        if module.split(".")[0] == "torch":
            return lambda *args, **kwargs: None
        return super().find_class(module, name)

    def persistent_load(self, pid):
        return None


def _unpickle(path: Path) -> object:
    """What a loader that trusts pickle would do with a torch.save file, in the standard library's pickle."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z, z.open(next(n for n in z.namelist() if n.endswith("/data.pkl"))) as f:
            return _TorchlessUnpickler(f).load()
    with open(path, "rb") as f:
        for _ in range(3):  # the legacy format's magic number, protocol version and system info
            _TorchlessUnpickler(f).load()
        return _TorchlessUnpickler(f).load()


def _pickled_adapter(llama_dir: Path, tmp_path: Path) -> tuple[Path, Path, dict]:
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=4)
    marker = tmp_path / "unpickled"
    state = {"trap": _UnpickleTrap(marker), **load_file(adapter_dir / WEIGHTS)}
    (adapter_dir / WEIGHTS).unlink()
    return adapter_dir, marker, state


# --- PEFT features --------------------------------------------------------------------------------------------


def test_dora_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", use_dora=True)
    refused(llama_config, adapter_dir, "DoRA", "use_dora")


def test_dora_magnitude_vectors_are_refused_even_if_the_config_hides_them(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", use_dora=True)
    edit_adapter_config(adapter_dir, use_dora=False)
    refused(llama_config, adapter_dir, "lora_magnitude_vector", "DoRA magnitude")


def test_modules_to_save_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", modules_to_save=["lm_head"])
    refused(llama_config, adapter_dir, "modules_to_save", "lm_head")


@pytest.mark.parametrize("extra", ["embed_tokens", "lm_head"])
def test_embedding_and_lm_head_targets_are_refused(llama_dir, llama_config, tmp_path, extra):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", target_modules=("q_proj", extra))
    refused(llama_config, adapter_dir, f"target modules {extra} are not supported")


@pytest.mark.parametrize("extra, named", [("embed_tokens", "embedding LoRA"), ("lm_head", "lm_head")])
def test_weights_are_the_ground_truth_for_targets(llama_dir, llama_config, tmp_path, extra, named):
    """A config that claims q_proj only cannot smuggle embedding or lm_head weights past the loader."""
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", target_modules=("q_proj", extra))
    edit_adapter_config(adapter_dir, target_modules=["q_proj"])
    refused(llama_config, adapter_dir, f"{extra}.", named)


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_trained_bias_is_refused(llama_dir, llama_config, tmp_path, bias):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", bias=bias)
    refused(llama_config, adapter_dir, f"bias={bias!r}")


def test_lora_bias_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", lora_bias=True)
    refused(llama_config, adapter_dir, "lora_bias")
    edit_adapter_config(adapter_dir, lora_bias=False)  # the lora_B.bias tensors are still refused
    refused(llama_config, adapter_dir, "lora_B.bias", "bias weights are not supported")


def test_trainable_token_indices_are_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", trainable_token_indices=[3, 4])
    refused(llama_config, adapter_dir, "trainable_token_indices")


def test_layer_replication_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", layer_replication=[[0, 2], [1, 3]])
    refused(llama_config, adapter_dir, "layer_replication")


def test_target_parameters_are_refused(llama_dir, llama_config, tmp_path):
    # PEFT's parameter-targeting LoRA saves keys that look like plain gate_proj LoRA: only the config tells.
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", target_modules=(),
                                    target_parameters=["mlp.gate_proj.weight"])
    refused(llama_config, adapter_dir, "target_parameters")


@pytest.mark.parametrize("field, value", [("fan_in_fan_out", True), ("use_qalora", True)])
def test_config_only_features_are_refused(llama_dir, llama_config, tmp_path, field, value):
    # PEFT cannot make these on a float Llama (it resets fan_in_fan_out; QA-LoRA needs GPTQ layers).
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    edit_adapter_config(adapter_dir, **{field: value})
    refused(llama_config, adapter_dir, field)


def test_pissa_adapter_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", init_lora_weights="pissa")
    refused(llama_config, adapter_dir, "init_lora_weights='pissa'", "path_initial_model_for_weight_conversion")


@pytest.mark.parametrize("kind", ["IA3", "LOHA"])
def test_other_peft_types_are_refused(llama_dir, llama_config, tmp_path, kind):
    from peft import IA3Config, LoHaConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cfg = (IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]) if kind == "IA3"
           else LoHaConfig(r=4, target_modules=["q_proj"]))
    get_peft_model(AutoModelForCausalLM.from_pretrained(llama_dir), cfg).save_pretrained(tmp_path / "a")
    refused(llama_config, tmp_path / "a", f"peft_type {kind!r} is not supported", "LORA")


# --- ranks and shapes -----------------------------------------------------------------------------------------


def test_rank_above_the_limit_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=16)
    refused(llama_config, adapter_dir, "rank 16", "max_lora_rank 8", max_lora_rank=8)
    load_peft_adapter("ok", adapter_dir, llama_config, 16)  # exactly at the limit is fine


def test_rank_pattern_above_the_limit_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=4, rank_pattern={"v_proj": 40})
    refused(llama_config, adapter_dir, "v_proj has rank 40", "max_lora_rank 32", max_lora_rank=32)


def test_adapter_for_a_differently_shaped_model_is_refused(llama_config, tmp_path):
    other = make_tiny_model(tmp_path / "other", "llama", hidden_size=72, intermediate_size=120)
    adapter_dir = make_peft_adapter(other, tmp_path / "a", r=4, target_modules=("q_proj",))
    refused(llama_config, adapter_dir, "q_proj", "[4, 72]", "[rank, 96]", "different base model")


def test_adapter_for_a_deeper_model_is_refused(llama_config, tmp_path):
    deeper = make_tiny_model(tmp_path / "deeper", "llama", num_hidden_layers=llama_config.num_layers + 1)
    adapter_dir = make_peft_adapter(deeper, tmp_path / "a", r=4)
    refused(llama_config, adapter_dir, f"layer {llama_config.num_layers}", f"has {llama_config.num_layers} layers")


def test_rank_that_disagrees_with_the_config_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=8)
    edit_adapter_config(adapter_dir, r=6)
    refused(llama_config, adapter_dir, "rank 8 in the weights", "rank 6")


def test_lora_a_without_lora_b_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    rewrite_weights(adapter_dir, lambda w: {k: v for k, v in w.items() if "layers.1.self_attn.v_proj.lora_B" not in k})
    refused(llama_config, adapter_dir, "model.layers.1.self_attn.v_proj has lora_A", "no lora_B")


def test_malformed_tensor_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    rewrite_weights(adapter_dir, lambda w: {**w, key: w[key].to(torch.int32)})
    refused(llama_config, adapter_dir, key, "2-D float tensor")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights_are_refused(llama_dir, llama_config, tmp_path, bad):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    key = "base_model.model.model.layers.2.self_attn.v_proj.lora_B.weight"

    def poison(w):
        t = w[key].clone()
        t.view(-1)[torch.randint(t.numel(), ())] = bad
        return {**w, key: t}

    rewrite_weights(adapter_dir, poison)
    refused(llama_config, adapter_dir, key, "NaN or Inf")


def test_weights_too_large_for_the_serving_dtype_are_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    rewrite_weights(adapter_dir, lambda w: {**w, key: w[key] * 1e6})
    refused(llama_config, adapter_dir, key, "too large for torch.float16", dtype=torch.float16)
    load_peft_adapter("ok", adapter_dir, llama_config, 64, torch.float32)


def test_unknown_and_duplicate_keys_are_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    rewrite_weights(adapter_dir, lambda w: {**w, "base_model.model.model.norm.weight": torch.ones(96)})
    refused(llama_config, adapter_dir, "'base_model.model.model.norm.weight' is not supported")
    rewrite_weights(adapter_dir, lambda w: {k: v for k, v in w.items() if "norm" not in k} | {
        key.removeprefix("base_model.model."): w[key].clone()})
    refused(llama_config, adapter_dir, "same tensor twice")


def test_two_adapters_in_one_file_are_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", target_modules=("q_proj", "k_proj"))
    rewrite_weights(adapter_dir, lambda w: {
        k.replace(".weight", ".one.weight" if "q_proj" in k else ".two.weight"): v for k, v in w.items()})
    refused(llama_config, adapter_dir, "more than one adapter")


def test_empty_weights_file_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    save_file({}, adapter_dir / WEIGHTS)
    refused(llama_config, adapter_dir, "holds no LoRA weights")


# --- files -----------------------------------------------------------------------------------------------------


def test_missing_folder_and_files_are_refused(llama_dir, llama_config, tmp_path):
    refused(llama_config, tmp_path / "nowhere", "adapter folder does not exist")
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    refused(llama_config, adapter_dir / WEIGHTS, "not a folder")
    (adapter_dir / WEIGHTS).unlink()
    refused(llama_config, adapter_dir, f"{WEIGHTS} is missing")
    (adapter_dir / "adapter_config.json").unlink()
    refused(llama_config, adapter_dir, "adapter_config.json is missing")


def test_broken_config_json_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    (adapter_dir / "adapter_config.json").write_text('{"r": 8,')
    refused(llama_config, adapter_dir, "adapter_config.json is not valid JSON")


@pytest.mark.parametrize("filename", ["adapter_model.bin", "adapter_model.pt", "adapter_model.pth"])
def test_pickle_weight_files_are_refused_unread(llama_dir, llama_config, tmp_path, filename):
    adapter_dir, marker, state = _pickled_adapter(llama_dir, tmp_path)
    torch.save(state, adapter_dir / filename)
    refused(llama_config, adapter_dir, "pickle format", filename, "never unpickled")
    assert not marker.exists()


@pytest.mark.parametrize("zipfile, kind", [(True, "a zip archive"), (False, "a pickle")])
def test_pickle_named_safetensors_is_refused_unread(llama_dir, llama_config, tmp_path, zipfile, kind):
    adapter_dir, marker, state = _pickled_adapter(llama_dir, tmp_path)
    torch.save(state, adapter_dir / WEIGHTS, _use_new_zipfile_serialization=zipfile)
    refused(llama_config, adapter_dir, f"{WEIGHTS} is {kind}", "never unpickled")
    assert not marker.exists()
    # The trap is live: unpickling the file (what the loader must never do) creates the marker.
    assert _unpickle(adapter_dir / WEIGHTS)["trap"] is None
    assert marker.exists()


@pytest.mark.parametrize("content", [b"", b"\x00\x01garbage", (10**9).to_bytes(8, "little") + b"{}"])
def test_truncated_or_garbage_safetensors_is_refused(llama_dir, llama_config, tmp_path, content):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    (adapter_dir / WEIGHTS).write_bytes(content)
    refused(llama_config, adapter_dir, f"{WEIGHTS} is not in safetensors format")


def test_corrupt_safetensors_header_is_refused(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    header = b'{"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99]}}'
    (adapter_dir / WEIGHTS).write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 16)
    refused(llama_config, adapter_dir, f"{WEIGHTS} is not a valid safetensors file")


def test_bad_arguments_are_config_errors(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    with pytest.raises(ConfigError, match="max_lora_rank"):
        load_peft_adapter("a", adapter_dir, llama_config, 0)
    with pytest.raises(ConfigError, match="floating-point"):
        load_peft_adapter("a", adapter_dir, llama_config, 8, torch.int8)


def test_a_refused_adapter_leaves_its_folder_untouched(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a", r=16)
    before = {p.name: p.read_bytes() for p in adapter_dir.iterdir()}
    refused(llama_config, adapter_dir, "rank 16", max_lora_rank=8)
    assert {p.name: p.read_bytes() for p in adapter_dir.iterdir()} == before
