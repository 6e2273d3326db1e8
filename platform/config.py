"""The one engine configuration object, passed explicitly to everything that needs it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from loraplex.errors import ConfigError
from loraplex.models.cpu_gemm import GEMM_CHOICES

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Without a stated budget the pool takes this much on the CPU: enough for ~23k tokens of the
# default model's KV in float32 plus dozens of rank-16 adapters, small beside 24 GiB of RAM.
DEFAULT_CPU_POOL_BYTES = 1 << 30
# On a GPU the pool takes this share of the memory left free after the weights are loaded.
DEFAULT_GPU_POOL_FRACTION = 0.85


def default_cache_dir() -> Path:
    return Path(os.environ.get("LORAPLEX_HOME", Path.home() / ".cache" / "loraplex"))


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"  # "default" (SmolLM2-135M-Instruct, offline) or a checkpoint folder
    dtype: str = "float32"
    device: str = "cpu"
    pool_bytes: int | None = None  # None: DEFAULT_CPU_POOL_BYTES, or a share of free GPU memory
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_lora_rank: int = 256
    block_size: int = 16  # tokens per KV block (one pool page per layer per block)
    # KV a sequence takes beyond its next tokens when it needs new blocks and the pool has the pages free, so
    # that a decoding sequence's next blocks of a layer lie in adjacent pages (UnifiedPager.allocate_kv); such
    # reserved blocks are given back first when the pool runs short. 0: blocks are taken one at a time.
    kv_reserve_tokens: int = 64
    max_model_len: int | None = None  # None: the model's own limit
    kernels: str = "auto"  # "auto" | "torch" | "cpu" | "triton"; LORAPLEX_KERNELS sets it in from_env
    gemm: str = "auto"  # CPU float32 projections: "auto" (the first of packed, onednn, mm that runs) | "packed" | "onednn" | "mm"
    queue_policy: str = "fcfs"  # order of waiting requests: "fcfs" | "lifo" | "vtc" (fair across tenants)
    # CPU engines: keep the host memory steps free inside the process instead of faulting it in again at
    # every step (glibc's mmap and trim thresholds, process-wide; engine/host_memory.py)
    retain_host_memory: bool = True
    cache_dir: Path = field(default_factory=default_cache_dir)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_lora_rank", "block_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if int(self.kv_reserve_tokens) < 0:
            raise ConfigError(f"kv_reserve_tokens must be at least 0, got {self.kv_reserve_tokens}")
        if self.gemm not in GEMM_CHOICES:
            raise ConfigError(f"gemm {self.gemm!r} is not one of {', '.join(GEMM_CHOICES)}")
        if self.queue_policy not in ("fcfs", "lifo", "vtc"):
            raise ConfigError(f"queue_policy {self.queue_policy!r} is not one of fcfs, lifo, vtc")
        if self.pool_bytes is not None and self.pool_bytes <= 0:
            raise ConfigError(f"pool_bytes must be positive, got {self.pool_bytes}")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"device {self.device!r} is not a torch device: {e}") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    def with_env(self) -> "EngineConfig":
        """Apply LORAPLEX_KERNELS, the one setting the environment may override."""
        kernels = os.environ.get("LORAPLEX_KERNELS")
        return replace(self, kernels=kernels) if kernels else self
