"""What the running server holds: built at start-up, read by every route through `get_state`.

The registry and the metering recorder exist from the first moment; the engine, the adapter store and
the bridge between them appear when the model has loaded (a background thread), and until then the
inference routes answer 503 and /ready says why.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from fastapi import Request

from loraplex.admission.failover import FailoverLimiter
from loraplex.admission.slo import SloController
from loraplex.adapter_store.engine_bridge import EngineAdapterBridge
from loraplex.adapter_store.registry import Registry
from loraplex.adapter_store.store import AdapterStore
from loraplex.engine.async_engine import AsyncEngine
from loraplex.metering.recorder import UsageRecorder

from .metrics import ApiMetrics
from .settings import ServerConfig


@dataclass
class ModelInfo:
    """The loaded base model as the API describes it."""

    name: str  # the id in /v1/models and in responses for base-model requests
    max_model_len: int
    tokenizer: object  # a transformers tokenizer (None: the model has no tokenizer files)
    created: int  # unix time the server loaded it


@dataclass
class ServerState:
    config: ServerConfig
    registry: Registry
    recorder: UsageRecorder
    metrics: ApiMetrics
    limiter: FailoverLimiter
    started_at: float = field(default_factory=time.time)
    engine: AsyncEngine | None = None
    store: AdapterStore | None = None
    bridge: EngineAdapterBridge | None = None
    slo: SloController | None = None  # set with the engine: TTFT predictions and early abort
    model: ModelInfo | None = None
    load_error: BaseException | None = None
    draining: bool = False
    # Inference requests between admission and their usage record; SIGTERM waits for this to reach 0.
    in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.alive and not self.draining

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self._lock:
            self.in_flight -= 1


def get_state(request: Request) -> ServerState:
    return request.app.state.loraplex
