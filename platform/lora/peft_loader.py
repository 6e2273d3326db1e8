"""Read a PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors) into a LoraAdapter.

Weights are read with safetensors only: pickle files (.bin, .pt, .pth, or a pickle/zip named
.safetensors) are refused and never unpickled, because unpickling runs arbitrary code (vLLM had CVEs here).
The weights file decides which (layer, module) pairs exist; every tensor is checked against the base
model's shapes, the config's ranks and the rank limit before anything is returned.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import SafetensorError

from loraplex.errors import AdapterError, ConfigError
from loraplex.lora.finite import first_nonfinite
from loraplex.lora.peft_config import MODULE_BLOCK, AdapterConfigInfo, llama_module_name, validate_adapter_config
from loraplex.lora.safetensors_views import SafetensorsFile, read_file
from loraplex.lora.types import MODULE_INDEX, LoraAdapter, LoraModuleWeights
from loraplex.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# base_model.model.model.layers.3.self_attn.q_proj.lora_A[.default].weight (the first prefix is optional).
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<block>self_attn|mlp)\.(?P<module>\w+?)"
    r"\.(?P<half>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.weight$"
)


@dataclass(frozen=True)
class PeftFolderRead:
    """A folder load's result beside the exact bytes it checked (unified_pager.pack_plan learns from them)."""

    adapter: LoraAdapter
    config_bytes: bytes  # adapter_config.json as read
    weights: SafetensorsFile  # adapter_model.safetensors as read; its tensors back the adapter's where no cast was due


def load_peft_adapter(
    name: str,
    path: str | Path,
    model: ModelConfig,
    max_lora_rank: int,
    dtype: torch.dtype = torch.float32,
    check_finite: bool = True,
) -> LoraAdapter:
    """Read, validate and cast a PEFT LoRA adapter for `model`; raise AdapterError naming what is wrong.
    check_finite=False skips the NaN/Inf scan of weights that need no cast: only for a caller that
    checks them in a pass of its own (pack_adapter(check_finite=True), see load_packed_folder).
    Cast weights are always checked (a cast can overflow)."""
    return read_peft_folder(name, path, model, max_lora_rank, dtype, check_finite).adapter


def read_peft_folder(name: str, path: str | Path, model: ModelConfig, max_lora_rank: int,
                     dtype: torch.dtype = torch.float32, check_finite: bool = True) -> PeftFolderRead:
    """load_peft_adapter, with the bytes its checks ran on."""
    if isinstance(max_lora_rank, bool) or not isinstance(max_lora_rank, int) or max_lora_rank < 1:
        raise ConfigError(f"max_lora_rank must be a positive integer, got {max_lora_rank!r}")
    if not dtype.is_floating_point:
        raise ConfigError(f"adapter dtype must be a floating-point dtype, got {dtype}")
    folder = Path(path)
    try:
        config_bytes, raw_config = _read_config(folder)
        info = validate_adapter_config(raw_config)
        weights = _read_weights(folder / WEIGHTS_FILE)
        modules = _build_modules(weights.tensors, info, model, max_lora_rank, dtype, check_finite)
    except AdapterError as e:
        raise AdapterError(f"adapter {name!r} at {folder}: {e}") from e
    adapter = LoraAdapter(
        name=name,
        modules=modules,
        max_rank=max(m.rank for m in modules),
        source=str(folder),
        config=raw_config,
    )
    return PeftFolderRead(adapter, config_bytes, weights)


def _read_config(folder: Path) -> tuple[bytes, dict]:
    if not folder.exists():
        raise AdapterError("adapter folder does not exist")
    if not folder.is_dir():
        raise AdapterError("adapter path is not a folder (expected a folder with adapter_config.json and "
                           "adapter_model.safetensors)")
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"{CONFIG_FILE} is missing")
    try:
        raw = config_path.read_bytes()
        return raw, json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise AdapterError(f"cannot read {CONFIG_FILE}: {e}") from e
    except json.JSONDecodeError as e:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {e}") from e


def _read_weights(path: Path) -> SafetensorsFile:
    if not path.is_file():
        pickles = sorted(p.name for p in path.parent.iterdir() if p.suffix.lower() in _PICKLE_SUFFIXES)
        if pickles:
            raise AdapterError(
                f"weights are in pickle format ({', '.join(pickles)}), which is refused and never unpickled; "
                f"save the adapter as {WEIGHTS_FILE} (safe_serialization=True)"
            )
        raise AdapterError(f"{WEIGHTS_FILE} is missing")
    _check_safetensors_header(path)
    try:
        # Unknown tensors are refused by name (in read_views' key check) before any data is read.
        return read_file(path, check_keys=lambda keys: [parse_weights_key(k) for k in keys])
    except AdapterError:
        raise
    except (SafetensorError, OSError, ValueError, TypeError, KeyError) as e:
        raise AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {e}") from e


def _check_safetensors_header(path: Path) -> None:
    """Tell a pickle or zip (torch.save) named .safetensors apart from a broken file, before parsing it."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(9)
    if len(head) == 9:
        # safetensors: u64 little-endian header length, then a JSON object.
        (header_len,) = struct.unpack("<Q", head[:8])
        if 8 + header_len <= size and head[8:9] == b"{":
            return
    if head.startswith(b"PK\x03\x04"):
        kind = "a zip archive (what torch.save writes, with a pickle inside)"
    elif head.startswith(b"\x80") and len(head) > 1 and 2 <= head[1] <= 5:
        kind = "a pickle"
    else:
        kind = "not in safetensors format"
    raise AdapterError(f"{WEIGHTS_FILE} is {kind}; it is refused and never unpickled")


# Cached: every adapter of one base model has the same few hundred keys, and each load parses each
# key twice (the early refusal of unknown names, then the pairing); refusals raise, so are not cached.
@lru_cache(maxsize=8192)
def parse_weights_key(key: str) -> tuple[int, str, str, str | None]:
    """(layer, module, 'lora_A' | 'lora_B', adapter-name segment or None), or AdapterError naming the key."""
    m = _KEY.match(key)
    if m is None or MODULE_BLOCK.get(m["module"]) != m["block"]:
        raise AdapterError(f"weights key {key!r} is not supported: {_why_unsupported(key)}")
    return int(m["layer"]), m["module"], m["half"], m["adapter"]


def _why_unsupported(key: str) -> str:
    if "lora_embedding" in key or "embed_tokens" in key:
        return "embedding LoRA is not supported"
    if "lm_head" in key:
        return "lm_head weights (LoRA or modules_to_save) are not supported"
    if "lora_magnitude_vector" in key:
        return "DoRA magnitude vectors are not supported"
    if key.endswith(".bias"):
        return "bias weights are not supported (only bias='none')"
    return "only lora_A/lora_B weights of q/k/v/o/gate/up/down projections are served"


def _build_modules(
    tensors: dict[str, torch.Tensor],
    info: AdapterConfigInfo,
    model: ModelConfig,
    max_lora_rank: int,
    dtype: torch.dtype,
    check_finite: bool = True,
) -> tuple[LoraModuleWeights, ...]:
    pairs: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
    adapter_segments: set[str | None] = set()
    for key, tensor in tensors.items():
        layer, module, half, segment = parse_weights_key(key)
        adapter_segments.add(segment)
        if len(adapter_segments) > 1:
            raise AdapterError(
                f"weights hold more than one adapter (name segments {sorted(map(str, adapter_segments))}); "
                f"save one adapter per folder"
            )
        if layer >= model.num_layers:
            raise AdapterError(
                f"weights key {key!r} is for layer {layer}, but the base model has {model.num_layers} layers"
            )
        slot = pairs.setdefault((layer, module), {})
        if half in slot:
            raise AdapterError(f"weights keys {slot[half][0]!r} and {key!r} are the same tensor twice")
        slot[half] = (key, tensor)
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")

    modules = [
        _module_weights(layer, module, slot, info, model, max_lora_rank, dtype)
        for (layer, module), slot in pairs.items()
    ]
    cast_needed = any(t.dtype != dtype for t in tensors.values())
    if check_finite or cast_needed:
        _check_finite([(key, t) for slot in pairs.values() for key, t in slot.values()], "contains NaN or Inf values")
    if cast_needed:  # e.g. fp32 values beyond float16's range
        cast = [(slot[half][0], t) for slot, m in zip(pairs.values(), modules)
                for half, t in (("lora_A", m.a), ("lora_B", m.b))]
        _check_finite(cast, f"has values too large for {dtype}")
    modules.sort(key=lambda w: (w.layer, MODULE_INDEX[w.module]))
    return tuple(modules)


def _module_weights(
    layer: int,
    module: str,
    slot: dict[str, tuple[str, torch.Tensor]],
    info: AdapterConfigInfo,
    model: ModelConfig,
    max_lora_rank: int,
    dtype: torch.dtype,
) -> LoraModuleWeights:
    where = llama_module_name(layer, module)
    for half, other in (("lora_A", "lora_B"), ("lora_B", "lora_A")):
        if half in slot and other not in slot:
            raise AdapterError(f"{where} has {half} ({slot[half][0]!r}) but no {other}")
    (a_key, a), (b_key, b) = slot["lora_A"], slot["lora_B"]
    for key, t in ((a_key, a), (b_key, b)):
        if t.dim() != 2 or not t.dtype.is_floating_point:
            raise AdapterError(f"weights key {key!r} must be a 2-D float tensor, found {t.dtype} {list(t.shape)}")

    rank = a.shape[0]
    in_features, out_features = model.module_shape(module)
    if list(a.shape) != [rank, in_features] or list(b.shape) != [out_features, rank]:
        raise AdapterError(
            f"{where}: lora_A is {list(a.shape)} and lora_B is {list(b.shape)}, but this base model needs "
            f"lora_A [rank, {in_features}] and lora_B [{out_features}, rank] ({module} maps {in_features} -> "
            f"{out_features}); was the adapter made for a different base model?"
        )
    expected_rank = info.rank_for(where)
    if rank != expected_rank:
        raise AdapterError(f"{where} has rank {rank} in the weights, but adapter_config.json gives it rank "
                           f"{expected_rank} (r / rank_pattern)")
    if rank > max_lora_rank:  # rank >= 1 already: it equals the config's r, which is positive
        raise AdapterError(f"{where} has rank {rank}, above this server's max_lora_rank {max_lora_rank}")

    # Finiteness is checked for all modules at once (_check_finite), after every shape check.
    cast = [t.to(dtype).contiguous() for t in (a, b)]
    return LoraModuleWeights(
        layer=layer, module=module, rank=rank, scale=info.scale_for(where), a=cast[0], b=cast[1]
    )


def _check_finite(named: list[tuple[str, torch.Tensor]], problem: str) -> None:
    """AdapterError naming the first tensor with a NaN or Inf (isfinite per tensor cost ~40 ms per
    adapter on the dev CPU; first_nonfinite reduces all of them at once first)."""
    found = first_nonfinite([t for _, t in named])
    if found is not None:
        raise AdapterError(f"weights key {named[found][0]!r} {problem}")
