"""The server's one configuration object: engine and store settings plus what only the server needs.

Precedence: command-line flags, then LORAPLEX_* environment variables, then the embedded defaults
(the default model, SQLite and a local object folder under one data directory).
"""

from __future__ import annotations

import os
from pathlib import Path
from dataclasses import dataclass, field, replace

from loraplex.adapter_store.config import StoreConfig
from loraplex.config import EngineConfig
from loraplex.errors import ConfigError

# Environment variable -> (section, field, parser). Flags of `loraplex serve` use the same names.
ENV_VARS: dict[str, tuple[str, str, type]] = {
    "LORAPLEX_MODEL": ("engine", "model", str),
    "LORAPLEX_DTYPE": ("engine", "dtype", str),
    "LORAPLEX_DEVICE": ("engine", "device", str),
    "LORAPLEX_POOL_BYTES": ("engine", "pool_bytes", int),
    "LORAPLEX_MAX_NUM_SEQS": ("engine", "max_num_seqs", int),
    "LORAPLEX_MAX_NUM_BATCHED_TOKENS": ("engine", "max_num_batched_tokens", int),
    "LORAPLEX_MAX_LORA_RANK": ("engine", "max_lora_rank", int),
    "LORAPLEX_MAX_MODEL_LEN": ("engine", "max_model_len", int),
    "LORAPLEX_KERNELS": ("engine", "kernels", str),
    "LORAPLEX_GEMM": ("engine", "gemm", str),
    "LORAPLEX_QUEUE_POLICY": ("engine", "queue_policy", str),
    "LORAPLEX_DATA_DIR": ("store", "data_dir", Path),
    "LORAPLEX_DATABASE_URL": ("store", "database_url", str),
    "LORAPLEX_OBJECT_STORE_URL": ("store", "object_store_url", str),
    "LORAPLEX_S3_ENDPOINT_URL": ("store", "s3_endpoint_url", str),
    "LORAPLEX_HOST_CACHE_BYTES": ("store", "host_cache_bytes", int),
    "LORAPLEX_MAX_UPLOAD_BYTES": ("store", "max_upload_bytes", int),
    "LORAPLEX_HOST": ("server", "host", str),
    "LORAPLEX_PORT": ("server", "port", int),
    "LORAPLEX_REDIS_URL": ("server", "redis_url", str),
    "LORAPLEX_OPERATOR_KEY": ("server", "operator_key", str),
    "LORAPLEX_SERVED_MODEL_NAME": ("server", "served_model_name", str),
    "LORAPLEX_DEFAULT_TTFT_TARGET_MS": ("server", "default_ttft_target_ms", int),
    "LORAPLEX_MAX_WAITING_REQUESTS": ("server", "max_waiting_requests", int),
    "LORAPLEX_DRAIN_TIMEOUT_S": ("server", "drain_timeout_s", float),
    "LORAPLEX_TORCH_THREADS": ("server", "torch_threads", int),
    "LORAPLEX_DEFAULT_REQUESTS_PER_MINUTE": ("server", "default_requests_per_minute", int),
    "LORAPLEX_DEFAULT_TOKENS_PER_MINUTE": ("server", "default_tokens_per_minute", int),
    "LORAPLEX_DEFAULT_MAX_CONCURRENT": ("server", "default_max_concurrent", int),
}


@dataclass(frozen=True)
class ServerConfig:
    # The server orders waiting requests fairly across tenants (VTC) unless told otherwise.
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(queue_policy="vtc"))
    store: StoreConfig = field(default_factory=StoreConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str | None = None  # shared rate limits across replicas (admission); None: in-process
    operator_key: str | None = None  # sets the operator key instead of generating one on first start
    served_model_name: str | None = None  # the base model's id in /v1/models; None: the folder's name
    default_ttft_target_ms: int | None = None  # for tenants without their own target
    max_waiting_requests: int = 1024  # queued beyond this, new requests get 429 (bounded queue)
    drain_timeout_s: float = 30.0  # SIGTERM: how long requests in flight may take to finish
    metering_flush_s: float = 0.5
    metrics_max_series: int = 500  # distinct (tenant, adapter) label pairs before folding into "other"
    # CPU serving: torch's intra-op threads. None: one fewer than the cores (at least 1), because the
    # HTTP loop and metering need a core too; OpenMP workers that must wait for a descheduled peer at
    # every op made decode steps several times slower when torch took every core here.
    torch_threads: int | None = None
    # Per-tenant limits for tenants without their own (None: unlimited). Kept in Redis when redis_url
    # is set, so that replicas share one budget; in-process otherwise (loraplex.admission).
    default_requests_per_minute: int | None = None
    default_tokens_per_minute: int | None = None
    default_max_concurrent: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError(f"torch_threads must be at least 1, got {self.torch_threads}")
        for name in ("max_waiting_requests", "metrics_max_series"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.drain_timeout_s < 0 or self.metering_flush_s <= 0:
            raise ConfigError("drain_timeout_s must be >= 0 and metering_flush_s > 0")
        if self.store.dtype != self.engine.dtype or self.store.max_lora_rank != self.engine.max_lora_rank:
            # One serving dtype and rank limit: the store decodes adapters for this engine.
            object.__setattr__(self, "store", replace(self.store, dtype=self.engine.dtype,
                                                      max_lora_rank=self.engine.max_lora_rank))

    def resolved_torch_threads(self) -> int:
        return self.torch_threads or max(1, (os.cpu_count() or 1) - 1)

    @staticmethod
    def from_env(overrides: dict[str, object] | None = None,
                 environ: dict[str, str] | None = None) -> "ServerConfig":
        """Build from LORAPLEX_* variables; `overrides` (same names as ENV_VARS, lower-case without the
        prefix, e.g. {"port": 9000}) win over the environment. None values are ignored."""
        environ = dict(os.environ if environ is None else environ)
        sections: dict[str, dict[str, object]] = {"engine": {}, "store": {}, "server": {}}
        for var, (section, name, parse) in ENV_VARS.items():
            raw = environ.get(var)
            if raw:
                try:
                    sections[section][name] = parse(raw)
                except ValueError:
                    raise ConfigError(f"{var}={raw!r} is not a valid {parse.__name__}") from None
        by_name = {name: section for section, name, _ in ENV_VARS.values()}
        for name, value in (overrides or {}).items():
            if value is None:
                continue
            if name not in by_name:
                raise ConfigError(f"unknown server setting {name!r}")
            sections[by_name[name]][name] = value
        sections["engine"].setdefault("queue_policy", "vtc")
        engine = EngineConfig(**sections["engine"])
        store = StoreConfig(**sections["store"])
        return ServerConfig(engine=engine, store=store, **sections["server"])
