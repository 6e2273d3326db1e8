"""The one-pass safetensors reader against the safetensors library, and the loader's batched finite check."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from factories import make_peft_adapter
from loraplex.errors import AdapterError
from loraplex.lora.peft_loader import _check_finite, load_peft_adapter
from loraplex.lora.safetensors_views import read_views


def _random_tensors(g: torch.Generator) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(12):
        shape = [int(s) for s in torch.randint(1, 9, (int(torch.randint(1, 4, (), generator=g)),), generator=g)]
        dtype = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int64][i % 6]
        if dtype.is_floating_point:
            out[f"t{i}"] = torch.randn(shape, generator=g).to(dtype)
        else:  # odd byte counts: later tensors start off their element alignment
            out[f"t{i}"] = torch.randint(-100, 100, shape, generator=g).to(dtype)
    return out


def test_views_equal_the_librarys_tensors(tmp_path):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    tensors = _random_tensors(g)
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    views = read_views(path)
    ref = load_file(str(path))
    assert views.keys() == ref.keys()
    for k, t in ref.items():
        assert views[k].dtype == t.dtype and views[k].shape == t.shape
        assert torch.equal(views[k], t), k


def test_key_check_runs_before_the_data_is_read(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(4), "b": torch.zeros(2, 2)}, str(path))
    seen = []

    def refuse(keys):
        seen.extend(keys)
        raise AdapterError("no")

    with pytest.raises(AdapterError, match="no"):
        read_views(path, check_keys=refuse)
    assert sorted(seen) == ["a", "b"]


def test_truncated_file_is_refused_by_the_library_check(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(64)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-16])
    with pytest.raises(SafetensorError):
        read_views(path)
    (header_len,) = struct.unpack("<Q", data[:8])
    assert header_len < len(data)


def test_finite_check_names_the_bad_tensor_and_passes_overflowing_norms():
    big = torch.full((8, 8), 3e30)  # finite, but its norm overflows float32: the per-tensor check must clear it
    _check_finite([("big", big), ("ok", torch.randn(3, 3))], "bad")
    poisoned = torch.randn(5, 7)
    poisoned[int(torch.randint(5, ())), int(torch.randint(7, ()))] = float("nan")
    with pytest.raises(AdapterError, match="'second' bad"):
        _check_finite([("first", torch.randn(4)), ("second", poisoned), ("third", big)], "bad")


def test_loaded_weights_match_the_files_tensors(llama_dir, llama_config, tmp_path):
    adapter_dir = make_peft_adapter(llama_dir, tmp_path / "a")
    ref = load_file(str(adapter_dir / "adapter_model.safetensors"))
    adapter = load_peft_adapter("a", adapter_dir, llama_config, 64, torch.float32)
    for m in adapter.modules:
        prefix = f"base_model.model.model.layers.{m.layer}."
        block = "self_attn" if m.module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        a = next(v for k, v in ref.items() if k.startswith(f"{prefix}{block}.{m.module}.lora_A"))
        b = next(v for k, v in ref.items() if k.startswith(f"{prefix}{block}.{m.module}.lora_B"))
        assert torch.equal(m.a, a.float()) and torch.equal(m.b, b.float())
