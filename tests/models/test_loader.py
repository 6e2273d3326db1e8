"""Reading checkpoint tensors: single file, sharded index, and the refusals (pickle, missing files)."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import pytest
import torch
from factories import make_tiny_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from loraplex.errors import ModelLoadError
from loraplex.models.loader import load_checkpoint_tensors


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    arch = random.choice(["llama", "qwen2", "mistral"])
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / arch, arch)


def _reference_state(folder: Path) -> dict[str, torch.Tensor]:
    """What transformers itself loads from the folder (lm_head left out when tied, as on disk)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_single_file_matches_transformers(tiny, dtype):
    tensors = load_checkpoint_tensors(tiny, dtype)
    reference = _reference_state(tiny)
    assert tensors.keys() == reference.keys()
    for name, ref in reference.items():
        assert tensors[name].dtype == dtype and tensors[name].device.type == "cpu"
        assert torch.equal(tensors[name], ref.to(dtype)), name


def test_sharded_index_matches_single_file(tiny, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    sharded = load_checkpoint_tensors(tmp_path, torch.float32)
    single = load_checkpoint_tensors(tiny, torch.float32)
    assert sharded.keys() == single.keys()
    assert all(torch.equal(sharded[k], single[k]) for k in single)


def test_single_safetensors_file_and_integer_tensors(tmp_path):
    tensors = {"w": torch.randn(3, 5, dtype=torch.bfloat16), "ids": torch.randint(0, 9, (4,))}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_checkpoint_tensors(tmp_path / "model.safetensors", torch.float32)
    assert loaded["w"].dtype == torch.float32 and torch.equal(loaded["w"], tensors["w"].float())
    assert loaded["ids"].dtype == torch.int64 and torch.equal(loaded["ids"], tensors["ids"])


class _RunsOnUnpickle:
    """A pickle payload that leaves a file behind if anyone unpickles it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth"])
def test_pickle_only_folder_is_refused_without_unpickling(tmp_path, name):
    marker = tmp_path / "unpickled"
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / name).write_bytes(pickle.dumps(_RunsOnUnpickle(marker)))
    with pytest.raises(ModelLoadError, match=rf"only pickle weights \({name}\).*safetensors"):
        load_checkpoint_tensors(tmp_path, torch.float32)
    assert not marker.exists()


def test_missing_and_broken_checkpoints(tiny, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_checkpoint_tensors(tmp_path / "nowhere", torch.float32)
    with pytest.raises(ModelLoadError, match="neither model.safetensors nor"):
        load_checkpoint_tensors(tmp_path, torch.float32)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="not a safetensors file"):
        load_checkpoint_tensors(tmp_path / "notes.txt", torch.float32)
    (tmp_path / "model.safetensors").write_bytes(random.randbytes(64))
    with pytest.raises(ModelLoadError, match="cannot read safetensors file"):
        load_checkpoint_tensors(tmp_path, torch.float32)


def _write_index(folder: Path, weight_map: dict) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_bad_indexes_are_refused(tiny, tmp_path):
    names = list(load_file(str(tiny / "model.safetensors")))
    (tmp_path / "model-1.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())

    _write_index(tmp_path, {n: "model-2.safetensors" for n in names})
    with pytest.raises(ModelLoadError, match="model-2.safetensors listed in .* is missing"):
        load_checkpoint_tensors(tmp_path, torch.float32)

    _write_index(tmp_path, {n: "../model-1.safetensors" for n in names})
    with pytest.raises(ModelLoadError, match="invalid shard file '../model-1.safetensors'"):
        load_checkpoint_tensors(tmp_path, torch.float32)

    _write_index(tmp_path, {**{n: "model-1.safetensors" for n in names}, "model.extra.weight": "model-1.safetensors"})
    with pytest.raises(ModelLoadError, match="no shard holds: model.extra.weight"):
        load_checkpoint_tensors(tmp_path, torch.float32)

    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="not a valid safetensors index"):
        load_checkpoint_tensors(tmp_path, torch.float32)

    # The same tensor in two shards is ambiguous.
    (tmp_path / "model-2.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    _write_index(tmp_path, {names[0]: "model-1.safetensors", names[1]: "model-2.safetensors"})
    with pytest.raises(ModelLoadError, match="more than one shard"):
        load_checkpoint_tensors(tmp_path, torch.float32)
