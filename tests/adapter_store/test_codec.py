"""The stored form: deterministic bytes (one adapter, one sha256), safetensors only, re-checked on decode."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save

from adapter_files import write_peft_adapter
from loraplex.adapter_store.blobs import sha256_hex
from loraplex.adapter_store.codec import decode_adapter, decode_tensors, encode_adapter
from loraplex.errors import AdapterError
from loraplex.lora.peft_loader import load_peft_adapter
from store_helpers import assert_same_adapter


@pytest.fixture
def adapter(tiny_config, tmp_path):
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=4, targets=("q_proj", "o_proj", "up_proj"))
    config = json.loads((folder / "adapter_config.json").read_text())
    return folder, config, load_file(folder / "adapter_model.safetensors")


def test_encoding_is_deterministic_across_calls_and_processes(adapter, tmp_path):
    folder, config, tensors = adapter
    blobs = {encode_adapter(config, dict(reversed(list(tensors.items())))) for _ in range(10)}
    assert len(blobs) == 1
    code = ("import json,sys; from safetensors.torch import load_file; "
            "from loraplex.adapter_store.codec import encode_adapter; "
            "from loraplex.adapter_store.blobs import sha256_hex; "
            f"print(sha256_hex(encode_adapter(json.load(open({str(folder / 'adapter_config.json')!r})), "
            f"load_file({str(folder / 'adapter_model.safetensors')!r}))))")
    other_process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other_process.stdout.strip() == sha256_hex(blobs.pop())


def test_decode_gives_what_the_engine_loader_gives(adapter, tiny_config):
    folder, config, tensors = adapter
    blob = encode_adapter(config, tensors)
    got_config, got_tensors = decode_tensors(blob)
    assert got_config == config and got_tensors.keys() == tensors.keys()
    assert_same_adapter(decode_adapter("x", blob, tiny_config, 16, torch.float32),
                        load_peft_adapter("x", folder, tiny_config, 16))


def test_decode_rechecks_against_the_serving_model(adapter, tiny_config):
    _, config, tensors = adapter
    blob = encode_adapter(config, tensors)
    with pytest.raises(AdapterError, match="above this server's max_lora_rank 2"):
        decode_adapter("x", blob, tiny_config, 2, torch.float32)


def test_plain_safetensors_and_garbage_are_not_adapters(adapter):
    _, _, tensors = adapter
    garbage = b"\x08" + b"\x00" * 7 + b"{nope"
    for blob in (save(tensors), save(tensors, metadata={"loraplex": "{}"}), b"\x00" * 4, garbage):
        with pytest.raises(AdapterError, match="not a loraplex adapter|truncated|unreadable"):
            decode_tensors(blob)


def test_decode_to_a_narrower_dtype_runs_the_range_checks(tiny_config, tmp_path):
    folder = write_peft_adapter(tmp_path / "a", tiny_config, r=2)
    tensors = load_file(folder / "adapter_model.safetensors")
    key = sorted(tensors)[0]
    tensors[key][0, 0] = 1e6  # finite in float32, infinite in float16
    blob = encode_adapter(json.loads((folder / "adapter_config.json").read_text()), tensors)
    assert decode_adapter("x", blob, tiny_config, 16, torch.float32).max_rank == 2
    assert decode_adapter("x", blob, tiny_config, 16, torch.bfloat16).max_rank == 2
    with pytest.raises(AdapterError, match="too large for torch.float16"):
        decode_adapter("x", blob, tiny_config, 16, torch.float16)


def test_decode_refuses_a_model_with_other_shapes(adapter, tmp_path):
    from factories import make_tiny_model
    from loraplex.models.config import load_model_config

    _, config, tensors = adapter
    other = load_model_config(make_tiny_model(tmp_path / "other", "llama", num_hidden_layers=2))
    with pytest.raises(AdapterError, match="base model has 2 layers"):
        decode_adapter("x", encode_adapter(config, tensors), other, 16, torch.float32)


def test_bytearray_blobs_decode_without_a_copy(adapter):
    _, config, tensors = adapter
    blob = encode_adapter(config, tensors)
    buffer = bytearray(blob)
    _, aliased = decode_tensors(buffer)
    _, copied = decode_tensors(blob)
    assert aliased.keys() == copied.keys() == tensors.keys()
    base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    for key, t in aliased.items():
        assert torch.equal(t, copied[key]) and torch.equal(t, tensors[key])
        assert base <= t.data_ptr() < base + len(buffer)  # a view of the blob, not a copy


def test_blobs_with_bad_offsets_are_refused(adapter):
    _, config, tensors = adapter
    blob = encode_adapter(config, tensors)
    cut = bytearray(blob[: len(blob) - 100])
    with pytest.raises(AdapterError, match="bad offsets"):
        decode_tensors(cut)
