"""Assemble a LoraAdapter from tensors whose bytes were already validated at upload.

The blob's sha256 proves these are the exact bytes the upload path checked with the engine's loader
(finite values included), so decoding repeats only the checks that depend on *this* server: shapes
against its model, ranks against its max_lora_rank, and the range of its dtype. Skipping the
isfinite scans over bytes already scanned is most of the decode time (~70 ms of ~100 ms for a rank-16
adapter on the default model). When the serving dtype is narrower than the stored one, the engine's
own _build_modules runs instead, range checks and all.
"""

from __future__ import annotations

import torch
from loraplex.errors import AdapterError
from loraplex.lora.peft_config import AdapterConfigInfo, llama_module_name
from loraplex.lora.peft_loader import _build_modules, parse_weights_key
from loraplex.lora.types import MODULE_INDEX, LoraModuleWeights
from loraplex.models.config import ModelConfig

# Casts that cannot overflow or turn a finite value into an infinite one.
_WIDENING = {
    torch.float32: {torch.float32, torch.float64},
    torch.float16: {torch.float16, torch.float32, torch.float64},
    torch.bfloat16: {torch.bfloat16, torch.float32, torch.float64},
    torch.float64: {torch.float64},
}


def assemble_modules(tensors: dict[str, torch.Tensor], info: AdapterConfigInfo, model: ModelConfig,
                     max_lora_rank: int, dtype: torch.dtype) -> tuple[LoraModuleWeights, ...]:
    if not all(dtype in _WIDENING.get(t.dtype, ()) for t in tensors.values()):
        return _build_modules(tensors, info, model, max_lora_rank, dtype)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, half, _ = parse_weights_key(key)
        if layer >= model.num_layers:
            raise AdapterError(f"weights key {key!r} is for layer {layer}, but the base model has "
                               f"{model.num_layers} layers")
        pairs.setdefault((layer, module), {})[half] = tensor
    modules = []
    for (layer, module), slot in pairs.items():
        where = llama_module_name(layer, module)
        if len(slot) != 2:
            raise AdapterError(f"{where} has {next(iter(slot))} but not its pair")
        a, b = slot["lora_A"], slot["lora_B"]
        rank = a.shape[0]
        in_features, out_features = model.module_shape(module)
        shapes_ok = list(a.shape) == [rank, in_features] and list(b.shape) == [out_features, rank]
        if a.dim() != 2 or b.dim() != 2 or not shapes_ok:
            raise AdapterError(
                f"{where}: lora_A is {list(a.shape)} and lora_B is {list(b.shape)}, but this base model needs "
                f"lora_A [rank, {in_features}] and lora_B [{out_features}, rank] ({module} maps {in_features} -> "
                f"{out_features}); was the adapter made for a different base model?"
            )
        if rank != info.rank_for(where):
            raise AdapterError(f"{where} has rank {rank} in the weights, but adapter_config.json gives it rank "
                               f"{info.rank_for(where)} (r / rank_pattern)")
        if rank > max_lora_rank:
            raise AdapterError(f"{where} has rank {rank}, above this server's max_lora_rank {max_lora_rank}")
        modules.append(LoraModuleWeights(layer=layer, module=module, rank=rank, scale=info.scale_for(where),
                                         a=a.to(dtype).contiguous(), b=b.to(dtype).contiguous()))
    if not modules:
        raise AdapterError("the stored adapter holds no LoRA weights")
    modules.sort(key=lambda w: (w.layer, MODULE_INDEX[w.module]))
    return tuple(modules)
