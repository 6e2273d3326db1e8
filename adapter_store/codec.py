"""The stored form of an adapter: one safetensors file holding the PEFT tensors as uploaded, with the
adapter_config.json in the file's metadata. One blob means one sha256 and one atomic write.

Decoding reads with safetensors only (never pickle) and checks again what depends on the serving
server (validate_adapter_config, shapes against its model, its rank limit and dtype range; see
assemble.py), so a blob can never produce an adapter this server's upload path would have refused.
"""

from __future__ import annotations

import json
import math
import struct

import torch
from loraplex.errors import AdapterError
from loraplex.lora.peft_config import validate_adapter_config
from loraplex.lora.types import LoraAdapter
from loraplex.models.config import ModelConfig
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .assemble import assemble_modules

FORMAT = "loraplex-adapter/1"
# One metadata key only: safetensors writes the metadata map in hash order, which changes from call to
# call, so two keys would give the same adapter different bytes (and a different sha256) each time.
META_KEY = "loraplex"


def encode_adapter(config: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    """Deterministic bytes for (config, tensors): the same adapter uploaded twice gets the same sha256."""
    meta = json.dumps({"format": FORMAT, "adapter_config": config}, sort_keys=True, separators=(",", ":"))
    return st_save({k: tensors[k].contiguous() for k in sorted(tensors)}, metadata={META_KEY: meta})


# safetensors dtype names of the float tensors an adapter may hold (little-endian, as x86 and ARM are).
_FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def header_bytes(data: bytes | bytearray) -> tuple[bytes, int]:
    """(the safetensors header's bytes as stored, offset of the data section); unparsed (the loader's pack
    plans are keyed by these bytes, see loader.py)."""
    if len(data) < 8:
        raise AdapterError("stored adapter blob is truncated")
    (n,) = struct.unpack("<Q", data[:8])
    return bytes(data[8:8 + n]), 8 + n


def read_header(data: bytes | bytearray) -> tuple[dict, int]:
    """(safetensors header, offset of the data section)."""
    raw, start = header_bytes(data)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise AdapterError(f"stored adapter blob has an unreadable header: {e}") from e
    if not isinstance(header, dict):
        raise AdapterError("stored adapter blob has an unreadable header")
    return header, start


def read_metadata(data: bytes | bytearray) -> dict:
    """{"format": ..., "adapter_config": {...}} from the blob's safetensors header."""
    header, _ = read_header(data)
    try:
        meta = json.loads((header.get("__metadata__") or {}).get(META_KEY, "{}"))
    except (ValueError, AttributeError, TypeError) as e:
        raise AdapterError(f"stored adapter blob has an unreadable header: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not isinstance(meta.get("adapter_config"), dict):
        raise AdapterError("stored blob is not a loraplex adapter")
    return meta


def decode_tensors(data: bytes | bytearray) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, tensors). From a bytearray the tensors alias it (no copy); from bytes they are copied."""
    config = read_metadata(data)["adapter_config"]
    header, start = read_header(data)
    entries = {k: v for k, v in header.items() if k != "__metadata__"}
    if isinstance(data, bytearray) and all(isinstance(v, dict) and v.get("dtype") in _FLOATS
                                           for v in entries.values()):
        try:
            return config, _alias_tensors(data, entries, start)
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise AdapterError(f"stored adapter blob cannot be decoded: {e}") from e
    try:
        tensors = st_load(bytes(data))
    except (ValueError, SafetensorError) as e:
        raise AdapterError(f"stored adapter blob cannot be decoded: {e}") from e
    return config, tensors


def _alias_tensors(data: bytearray, entries: dict, start: int) -> dict[str, torch.Tensor]:
    tensors = {}
    size = len(data)
    for key, entry in entries.items():
        dtype = _FLOATS[entry["dtype"]]
        shape = [int(d) for d in entry["shape"]]
        begin, end = (int(o) for o in entry["data_offsets"])
        count = math.prod(shape)
        if not 0 <= begin <= end or start + end > size or (end - begin) != count * dtype.itemsize:
            raise AdapterError(f"stored adapter blob cannot be decoded: tensor {key!r} has bad offsets")
        if count == 0:
            tensors[key] = torch.empty(shape, dtype=dtype)
        else:
            tensors[key] = torch.frombuffer(data, dtype=dtype, count=count, offset=start + begin).view(shape)
    return tensors


def decode_adapter(
    name: str, data: bytes, model: ModelConfig, max_lora_rank: int, dtype: torch.dtype, source: str = ""
) -> LoraAdapter:
    """A served LoraAdapter from verified blob bytes; AdapterError if this server cannot run it."""
    config, tensors = decode_tensors(data)
    try:
        info = validate_adapter_config(config)
        modules = assemble_modules(tensors, info, model, max_lora_rank, dtype)
    except AdapterError as e:
        raise AdapterError(f"adapter {name!r}: {e}") from e
    return LoraAdapter(name=name, modules=modules, max_rank=max(m.rank for m in modules), source=source,
                       config=config)

