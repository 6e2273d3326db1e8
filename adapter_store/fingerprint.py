"""A base model's fingerprint: what an adapter must match to run on it.

It hashes the architecture and every shape an adapter touches (layers, hidden, MLP, heads), not the
weights: hashing hundreds of MB at every start would be slow, and any model with these shapes runs
the adapter without error. The upload also checks every tensor's shape against the model itself.
"""

from __future__ import annotations

import hashlib
import json

from loraplex.lora.types import TARGET_MODULES
from loraplex.models.config import ModelConfig


def model_fingerprint(model: ModelConfig) -> str:
    shape = {
        "architecture": model.architecture,
        "num_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "intermediate_size": model.intermediate_size,
        "num_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "modules": {m: list(model.module_shape(m)) for m in TARGET_MODULES},
    }
    return hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()
