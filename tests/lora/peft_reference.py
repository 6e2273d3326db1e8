"""What PEFT itself computes for an adapter folder: the reference the loader is compared against."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class PeftModuleReference:
    rank: int
    scale: float
    delta: torch.Tensor  # [out_features, in_features], PEFT's get_delta_weight (scale * B @ A)
    base: torch.nn.Linear  # the frozen base projection
    lora_layer: torch.nn.Module  # PEFT's lora.Linear wrapping it: forward = base + LoRA


def peft_modules(model_dir: Path, adapter_dir: Path) -> dict[tuple[int, str], PeftModuleReference]:
    """Load the adapter with PEFT onto a fresh copy of the base model; return PEFT's view of every LoRA layer."""
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        m = re.search(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)$", name)
        assert m is not None, name
        with torch.no_grad():
            delta = module.get_delta_weight("default").clone()
        out[(int(m[1]), m[2])] = PeftModuleReference(
            rank=module.r["default"], scale=module.scaling["default"], delta=delta,
            base=module.get_base_layer(), lora_layer=module,
        )
    return out
