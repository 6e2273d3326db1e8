"""Every refused upload names the problem and leaves nothing behind: no blob, no row, no staging files.

Adapter content: pickles (by name and by content, never unpickled), bad configs, wrong shapes, rank,
size cap, names, missing or unexpected files. Archive refusals are in test_archive_refusals.py.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapter_files import write_peft_adapter
from factories import make_tiny_model
from loraplex.adapter_store import NotFoundError, UploadFile
from loraplex.errors import AdapterError
from loraplex.lora.peft_loader import load_peft_adapter
from loraplex.models.config import load_model_config
from store_helpers import assert_nothing_stored, folder_files, new_tenant

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _UnpickleTrap:
    """Unpickling this creates a folder: proof that a file was (or was not) unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


@pytest.fixture
def store(make_store):
    return make_store(max_upload_bytes=200_000)


@pytest.fixture
def good(tiny_config, tmp_path) -> Path:
    return write_peft_adapter(tmp_path / "good", tiny_config, r=4)


def refuse(store, files, *fragments: str, name: str = "bot") -> str:
    tenant = new_tenant(store)
    with pytest.raises(AdapterError) as e:
        store.upload(tenant, name, files)
    message = str(e.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert_nothing_stored(store, tenant)
    return message


def with_file(folder: Path, name: str, data: bytes) -> list[UploadFile]:
    return folder_files(folder) + [UploadFile(name, data)]


def replace_file(folder: Path, name: str, data: bytes) -> list[UploadFile]:
    return [f for f in folder_files(folder) if f.filename != name] + [UploadFile(name, data)]


# -- pickles -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("filename", ["adapter_model.bin", "training_args.bin", "weights.pt", "model.pth"])
def test_pickle_files_are_refused_by_name(store, good, tmp_path, filename):
    marker = tmp_path / "unpickled"
    files = replace_file(good, WEIGHTS, b"")[:-1] + [UploadFile(filename, pickle.dumps(_UnpickleTrap(marker)))]
    refuse(store, files, "pickle", filename, "never unpickled")
    assert not marker.exists()


@pytest.mark.parametrize("filename", [WEIGHTS, "notes.txt", "README.md"])
def test_pickle_files_are_refused_by_content_whatever_their_name(store, good, tmp_path, filename):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps(_UnpickleTrap(marker), protocol=random_protocol())
    files = replace_file(good, filename, payload)
    refuse(store, files, "pickle", "never unpickled")
    assert not marker.exists()


def random_protocol() -> int:
    return int(torch.randint(2, 6, ()).item())


def test_torch_save_zip_named_safetensors_is_refused(store, good, tmp_path):
    marker = tmp_path / "unpickled"
    path = tmp_path / "trap.pt"
    torch.save({"trap": _UnpickleTrap(marker), **load_file(good / WEIGHTS)}, path)
    refuse(store, replace_file(good, WEIGHTS, path.read_bytes()), "zip archive", "never unpickled")
    assert not marker.exists()


# -- configs: the engine's rules and messages --------------------------------------------------------

@pytest.mark.parametrize("change, fragment", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"init_lora_weights": "pissa"}, "rewrites the base model"),
    ({"brand_new_field": 3}, "fields loraplex does not know"),
    ({"r": 0}, "r must be a positive integer"),
])
def test_bad_configs_get_the_engines_message(store, good, tiny_config, change, fragment):
    cfg = json.loads((good / CONFIG).read_text())
    cfg.update(change)
    (good / CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(AdapterError) as engine_error:
        load_peft_adapter("bot", good, tiny_config, 16)
    message = refuse(store, folder_files(good), fragment)
    assert message == f"adapter 'bot': {engine_error.value.__cause__}"  # same words as the engine


def test_config_that_is_not_json_is_refused(store, good):
    refuse(store, replace_file(good, CONFIG, b"{not json"), "adapter_config.json is not valid JSON")


def test_missing_files_are_refused(store, good):
    refuse(store, [f for f in folder_files(good) if f.filename != WEIGHTS], f"{WEIGHTS} is missing")
    refuse(store, [f for f in folder_files(good) if f.filename != CONFIG], f"{CONFIG} is missing")
    refuse(store, [], "holds no files")


def test_unexpected_files_are_refused(store, good):
    refuse(store, with_file(good, "tokenizer.json", b"{}"), "unexpected files tokenizer.json")


def test_duplicate_files_are_refused(store, good):
    refuse(store, with_file(good, CONFIG, (good / CONFIG).read_bytes()), "twice")


# -- weights against the base model -----------------------------------------------------------------

def test_adapter_for_another_base_model_is_refused(store, tmp_path):
    other = load_model_config(make_tiny_model(tmp_path / "other", "llama", hidden_size=64, num_attention_heads=4))
    folder = write_peft_adapter(tmp_path / "a", other, r=4)
    refuse(store, folder_files(folder), "was the adapter made for a different base model?", "q_proj")


def test_adapter_with_more_layers_than_the_model_is_refused(store, good):
    weights = load_file(good / WEIGHTS)
    key = next(iter(weights))
    weights[key.replace("layers.0.", "layers.7.")] = weights.pop(key)
    save_file(weights, good / WEIGHTS)
    refuse(store, folder_files(good), "layer 7", "3 layers")


def test_rank_above_the_limit_is_refused(store, tiny_config, tmp_path):
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=32)  # the store's limit is 16
    refuse(store, folder_files(folder), "rank 32", "max_lora_rank 16")


def test_nan_weights_are_refused(store, good):
    weights = load_file(good / WEIGHTS)
    key = sorted(weights)[0]
    weights[key][0, 0] = float("nan")
    save_file(weights, good / WEIGHTS)
    refuse(store, folder_files(good), "NaN or Inf")


# -- size and names ----------------------------------------------------------------------------------

def test_uploads_over_the_size_cap_are_refused(store, tiny_config, tmp_path):
    folder = write_peft_adapter(tmp_path / "big", tiny_config, r=16, targets=ALL_MODULES)
    assert sum(p.stat().st_size for p in folder.iterdir()) > 200_000
    refuse(store, folder_files(folder), "larger than the 200,000-byte limit")


@pytest.mark.parametrize("name", ["", "../x", "a/b", "has space", "-dash", "x" * 65, "a..b", "naïve"])
def test_bad_adapter_names_are_refused(store, good, name):
    refuse(store, folder_files(good), "adapter name", name=name)


@pytest.mark.parametrize("filename, why", [
    ("../adapter_config.json", "contains a path"), ("/etc/passwd", "contains a path"),
    ("sub/adapter_config.json", "contains a path"), ("a\\b", "contains a path"), ("..", "not allowed"),
    (".hidden", "not allowed"), ("", "not allowed"),
])
def test_bad_file_names_are_refused(store, good, filename, why):
    refuse(store, with_file(good, filename, b"{}"), "file name", why)


def test_unknown_tenant_is_refused_before_any_work(store, good):
    with pytest.raises(NotFoundError, match="tenant"):
        store.upload("no-such-tenant", "bot", folder_files(good))
    assert store.blobs.objects.list() is not None and list(store.blobs.objects.list()) == []
