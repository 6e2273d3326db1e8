"""Check a staged PEFT folder with the engine's own loader, and keep the tensors as uploaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from loraplex.errors import AdapterError
from loraplex.lora.peft_loader import WEIGHTS_FILE, load_peft_adapter
from loraplex.lora.types import LoraAdapter
from loraplex.models.config import ModelConfig
from safetensors.torch import load_file


@dataclass(frozen=True)
class ValidatedAdapter:
    config: dict  # adapter_config.json as sent
    tensors: dict[str, torch.Tensor]  # the weights as sent (their own dtype)
    adapter: LoraAdapter  # what the engine would serve (cast to the serving dtype)
    dtype: str  # of the sent tensors: "float16", ..., or "mixed"


def validate_folder(name: str, folder: Path, model: ModelConfig, max_lora_rank: int,
                    dtype: torch.dtype) -> ValidatedAdapter:
    """Everything the engine checks (config features, keys, shapes against model, rank, finiteness,
    safetensors only), with the engine's messages; AdapterError("adapter 'name': ...") on refusal."""
    try:
        adapter = load_peft_adapter(name, folder, model, max_lora_rank, dtype)
    except AdapterError as e:
        # The loader names the folder it read; here that is a private staging folder, so say only the name.
        raise AdapterError(f"adapter {name!r}: {e.__cause__ or e}") from None
    tensors = load_file(str(folder / WEIGHTS_FILE))  # already checked to be plain safetensors
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    return ValidatedAdapter(config=adapter.config, tensors=tensors, adapter=adapter,
                            dtype=dtypes[0] if len(dtypes) == 1 else "mixed")
