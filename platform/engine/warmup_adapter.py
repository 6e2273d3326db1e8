"""A throwaway adapter for the engine's warm-up: the LoRA kernels' variants are built before the first
request that names a real adapter (EngineCore.warmup)."""

from __future__ import annotations

import torch

from loraplex.lora.types import TARGET_MODULES, LoraAdapter, LoraModuleWeights
from loraplex.models.config import ModelConfig


def warmup_adapter(name: str, cfg: ModelConfig, rank: int, dtype: torch.dtype) -> LoraAdapter:
    """Rank `rank` on every projection of every layer, small random weights (its outputs are thrown away;
    random rather than zero so that no kernel sees a special value). Host bytes: rank x the model's
    projection widths, e.g. ~40 MB at rank 16 for a Llama-3-8B in bf16, held only during the warm-up."""
    g = torch.Generator().manual_seed(0)
    modules = []
    for layer in range(cfg.num_layers):
        for module in TARGET_MODULES:
            fin, fout = cfg.module_shape(module)
            a = (torch.randn(rank, fin, generator=g) * 0.01).to(dtype)  # [rank, in]
            b = (torch.randn(fout, rank, generator=g) * 0.01).to(dtype)  # [out, rank]
            modules.append(LoraModuleWeights(layer, module, rank, 1.0, a, b))
    return LoraAdapter(name, tuple(modules), rank, source="engine warm-up")
