"""Concrete benchmark requests from a trace, and random PEFT adapters written straight to disk.

Every system gets the same `BenchRequest`s: the same prompt token ids (random ids, seeded per request id),
the same adapter names and the same number of output tokens (EOS ignored). Adapters are written as PEFT
folders (adapter_config.json + adapter_model.safetensors) with random A and B, without building a PEFT
model per adapter: 1,000 adapters cost seconds of randn and disk writes, not 1,000 get_peft_model calls.
"""

from __future__ import annotations

import json
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from loraplex.lora.types import TARGET_MODULES
from loraplex.models.config import ModelConfig

import traces as T

# Ids below this are left out of random prompts: the small ids are special tokens in SmolLM2 and the
# tests' tiny models (EOS 2, BOS 1, pad 0).
FIRST_PROMPT_ID = 3


@dataclass(frozen=True)
class BenchRequest:
    id: str
    arrival_s: float  # seconds after the start of the run (0 for every request in offline mode)
    prompt: tuple[int, ...]  # token ids
    adapter: str | None  # engine/PEFT adapter name; None: the base model
    output_tokens: int  # generated exactly this many (EOS ignored)
    ttft_target_s: float


def _seed(label: str, seed: int) -> int:
    # crc32, unlike hash(), is the same in every process
    return zlib.crc32(f"{seed}:{label}".encode())


def requests_from_trace(trace: Sequence[T.TraceRequest], vocab_size: int, seed: int = 0,
                        use_adapters: bool = True, max_len: int | None = None) -> list[BenchRequest]:
    """One BenchRequest per trace request; prompts are clipped so prompt + output fits max_len."""
    out = []
    for r in trace:
        rng = random.Random(_seed(r.id, seed))
        n_prompt = r.prompt_tokens
        if max_len is not None:
            n_prompt = max(1, min(n_prompt, max_len - r.output_tokens - 1))
        prompt = tuple(rng.randrange(FIRST_PROMPT_ID, vocab_size) for _ in range(n_prompt))
        out.append(BenchRequest(r.id, r.arrival_s, prompt, adapter_dir_name(r.adapter, r.rank) if
                                (use_adapters and r.adapter is not None) else None,
                                r.output_tokens, r.ttft_target_ms / 1e3))
    return out


def without_adapters(requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    return [BenchRequest(r.id, r.arrival_s, r.prompt, None, r.output_tokens, r.ttft_target_s) for r in requests]


def all_at_once(requests: Sequence[BenchRequest]) -> list[BenchRequest]:
    return [BenchRequest(r.id, 0.0, r.prompt, r.adapter, r.output_tokens, r.ttft_target_s) for r in requests]


def adapter_dir_name(trace_name: str, rank: int) -> str:
    """The adapter's name everywhere: the trace name plus its rank (content is seeded by this name)."""
    return f"{trace_name}-r{rank}"


def adapter_rank(name: str) -> int:
    """The rank of a benchmark adapter, from its name ("<trace name>-r<rank>", adapter_name)."""
    return int(name.rsplit("-r", 1)[1])


def adapter_elements(cfg: ModelConfig, rank: int, modules: Sequence[str] = TARGET_MODULES) -> int:
    """Weights of one adapter: rank x (in + out) per module per layer."""
    return cfg.num_layers * sum(rank * sum(cfg.module_shape(m)) for m in modules)


def write_random_adapter(folder: Path, cfg: ModelConfig, rank: int, seed: int,
                         modules: Sequence[str] = TARGET_MODULES, dtype: torch.dtype = torch.float32) -> Path:
    """A PEFT LoRA folder with random A and B (B non-zero, so the adapter changes outputs).

    Scales keep the delta small beside the base projection: A ~ N(0, 1/in), B ~ N(0, 0.02^2), alpha = 2r,
    so greedy outputs differ from the base model's without turning into noise.
    """
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg.num_layers):
        for m in modules:
            block = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            fan_in, fan_out = cfg.module_shape(m)
            prefix = f"base_model.model.model.layers.{layer}.{block}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) / fan_in**0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.02).to(dtype)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(modules), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "modules_to_save": None, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": None, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return folder


def ensure_adapters(root: Path, cfg: ModelConfig, names: Sequence[str], seed: int = 0) -> dict[str, Path]:
    """Folders for the named adapters ("<trace name>-r<rank>"), written once and reused across runs."""
    paths = {}
    for name in sorted(set(names)):
        rank = int(name.rsplit("-r", 1)[1])
        folder = root / name
        if not (folder / "adapter_model.safetensors").exists():
            write_random_adapter(folder, cfg, rank, _seed(name, seed))
        paths[name] = folder
    return paths


def used_adapters(requests: Sequence[BenchRequest]) -> list[str]:
    return sorted({r.adapter for r in requests if r.adapter is not None})
