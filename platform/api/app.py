"""The FastAPI application: start-up (database, operator key, metering, the model in the background),
routes, and an orderly shutdown (engine stopped, usage flushed, connections closed).

    app = create_app(ServerConfig.from_env())    # run under uvicorn; `loraplex serve` does this
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Iterable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from loraplex.adapter_store import migrate
from loraplex.adapter_store.blobs import BlobStore
from loraplex.adapter_store.engine_bridge import EngineAdapterBridge
from loraplex.adapter_store.object_store import open_object_store
from loraplex.adapter_store.registry import Registry
from loraplex.adapter_store.schemas import ApiKeyCreate
from loraplex.adapter_store.store import AdapterStore
from loraplex.admission import FailoverLimiter, LocalLimiter, RedisLimiter
from loraplex.admission.slo import SloController
from loraplex.admin_ui import UPLOAD_PATH as ADMIN_UPLOAD_PATH
from loraplex.admin_ui import mount_admin
from loraplex.metering.recorder import UsageRecorder

from . import routes_adapters, routes_inference, routes_ops, routes_reports, routes_tenants
from .body_limit import BodyLimit
from .errors import install_handlers
from .metrics import ApiMetrics, counter, gauge, gauge_by
from .serving import InferenceService
from .settings import ServerConfig
from .state import ModelInfo, ServerState

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_TOUCH_EVERY_S = 5.0
MAX_JSON_BODY = 32 << 20  # bytes of any non-upload request body (prompts, messages)
UPLOAD_FORM_OVERHEAD = 1 << 20  # multipart framing allowed on top of the store's upload cap  # adapters' last_used_at is written in batches this often


def ensure_operator_key(registry: Registry, secret: str | None) -> str | None:
    """Make sure an operator key exists. Returns a newly generated secret (to print once), else None."""
    if secret:
        if registry.authenticate(secret) is None:
            registry.create_api_key(ApiKeyCreate(tenant_id=None, role="operator", label="LORAPLEX_OPERATOR_KEY"),
                                    secret=secret)
        return None
    if any(k.revoked_at is None for k in registry.list_api_keys(None)):
        return None
    created = registry.create_api_key(ApiKeyCreate(tenant_id=None, role="operator", label="generated at first start"))
    return created.secret


def open_state(config: ServerConfig) -> ServerState:
    url = config.store.resolved_database_url
    config.store.data_dir.mkdir(parents=True, exist_ok=True)
    migrate.upgrade(url)
    registry = Registry.open(url)
    secret = ensure_operator_key(registry, config.operator_key)
    if secret is not None:
        # Shown once: only its hash is stored. stdout, so that a launcher can capture it.
        print(f"loraplex: operator API key (shown once, store it now): {secret}", flush=True)
    recorder = UsageRecorder(registry, flush_interval_s=config.metering_flush_s)
    redis = RedisLimiter(config.redis_url) if config.redis_url else None
    state = ServerState(config=config, registry=registry, recorder=recorder,
                        metrics=ApiMetrics(config.metrics_max_series),
                        limiter=FailoverLimiter(redis, LocalLimiter()))
    state.metrics.add_snapshot(lambda: _snapshot(state))
    return state


def load_model(state: ServerState) -> None:
    """Build the engine and the adapter store (runs on a background thread at start-up)."""
    from loraplex.engine.async_engine import AsyncEngine

    config = state.config
    try:
        t0 = time.perf_counter()
        if config.engine.torch_device.type == "cpu":
            import torch

            torch.set_num_threads(config.resolved_torch_threads())
        # Built on the engine's own thread, which steps it (AsyncEngine: one OpenMP team on the CPU).
        engine = AsyncEngine(config.engine)
        core = engine.engine
        try:
            store = AdapterStore(config.store, core.model_config, state.registry,
                                 BlobStore(open_object_store(config.store)))
            bridge = EngineAdapterBridge(core, store)
        except BaseException:
            engine.shutdown()
            raise
        core.slo = state.slo = SloController(config.engine.max_num_batched_tokens, config.engine.max_num_seqs)
        name = config.served_model_name or (DEFAULT_MODEL_NAME if config.engine.model == "default"
                                            else Path(config.engine.model).name)
        state.model = ModelInfo(name=name, max_model_len=core.max_model_len, tokenizer=core.tokenizer,
                                created=int(time.time()))
        state.store, state.bridge = store, bridge
        state.engine = engine  # last: its presence makes the server ready
        log.info("model %s loaded in %.1f s", name, time.perf_counter() - t0)
    except BaseException as e:
        log.exception("cannot load the model")
        state.load_error = e


def close_state(state: ServerState, timeout: float = 30.0) -> None:
    if state.engine is not None:
        state.engine.shutdown()
    state.recorder.close(timeout)  # every usage event recorded so far reaches the database
    if state.store is not None:
        state.store.cache.close()
    state.registry.close()


def _snapshot(state: ServerState) -> Iterable:
    yield gauge("loraplex_ready", "1 when the server accepts inference requests", float(state.ready))
    yield gauge("loraplex_draining", "1 while shutting down", float(state.draining))
    yield gauge("loraplex_in_flight_requests", "Inference requests being served", float(state.in_flight))
    engine = state.engine
    if engine is not None:
        s = engine.stats
        yield gauge("loraplex_engine_alive", "1 while the engine step loop runs", float(engine.alive))
        yield gauge_by("loraplex_queue_depth", "Requests in the engine", "state",
                       {"waiting": s.num_waiting, "running": s.num_running})
        yield gauge_by("loraplex_pool_pages", "Device page pool by use", "kind",
                       {"kv": s.kv_pages, "adapter": s.adapter_pages, "free": s.free_pages})
        yield gauge("loraplex_kv_reserved_pages", "Pages of KV blocks reserved ahead of their tokens (of kind kv), "
                    "given back first when the pool runs short", s.kv_reserved_pages)
        yield gauge("loraplex_resident_adapters", "Adapters placed in the page pool", s.resident_adapters)
        yield counter("loraplex_preemptions", "Requests preempted for pages", s.num_preemptions)
        yield counter("loraplex_engine_steps", "Engine steps run", s.num_steps)
        yield counter("loraplex_engine_tokens", "Tokens run through the model (prompt chunks and decode)",
                      s.num_tokens)
    if state.store is not None:
        c = state.store.cache_stats()
        yield counter("loraplex_host_cache_hits", "Host-cache hits", c.hits)
        yield counter("loraplex_host_cache_misses", "Host-cache misses (loads started)", c.misses)
        yield counter("loraplex_host_cache_evictions", "Host-cache evictions", c.evictions)
        yield counter("loraplex_adapter_loads", "Adapters loaded from object storage", c.loads)
        yield counter("loraplex_adapter_load_failures", "Adapter loads that failed verification", c.load_failures)
        yield gauge("loraplex_host_cache_bytes", "Bytes of decoded adapters in host RAM", c.bytes)
    lim = state.limiter.status()
    yield gauge("loraplex_limiter_redis", "1 while rate limits are kept in Redis (0: in-process)",
                float(lim.backend == "redis"))
    yield gauge("loraplex_limiter_redis_ok", "1 while the configured Redis answers", float(lim.redis_ok))
    if state.slo is not None:
        yield counter("loraplex_slo_refused", "Requests refused at admission: TTFT target unreachable",
                      state.slo.refused)
        yield counter("loraplex_slo_aborted", "Queued requests aborted: TTFT target became unreachable",
                      state.slo.aborted)
        cost = state.slo.cost
        yield gauge_by("loraplex_step_cost_seconds", "Fitted engine step cost", "term",
                       {"fixed": cost.fixed_s, "per_new_token": cost.per_new_token_s,
                        "per_cached_token": cost.per_cached_token_s})
    r = state.recorder.stats()
    yield gauge("loraplex_metering_pending", "Usage events not yet written", r.pending)
    yield counter("loraplex_metering_dropped", "Usage events dropped (buffer full)", r.dropped)


async def _touch_loop(state: ServerState, service: InferenceService) -> None:
    while True:
        await asyncio.sleep(_TOUCH_EVERY_S)
        await _touch(state, service)


async def _touch(state: ServerState, service: InferenceService) -> None:
    ids, service.used_adapters = service.used_adapters, set()
    if ids:
        try:
            await run_in_threadpool(state.registry.touch_last_used, ids)
        except Exception:
            log.warning("cannot update adapters' last_used_at", exc_info=True)


def create_app(config: ServerConfig, load_in_background: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = open_state(config)
        service = InferenceService(state)
        app.state.loraplex = state
        app.state.inference = service

        async def on_invalid_inference(request, err) -> None:
            if request.url.path in routes_inference.INFERENCE_PATHS:
                auth = request.headers.get("authorization", "")
                scheme, _, key = auth.partition(" ")
                await service.record_invalid(key.strip() if scheme.lower() == "bearer" else None, err)

        app.state.on_invalid_inference = on_invalid_inference
        if load_in_background:
            threading.Thread(target=load_model, args=(state,), name="loraplex-load", daemon=True).start()
        else:
            load_model(state)
        touch = asyncio.create_task(_touch_loop(state, service))
        try:
            yield
        finally:
            touch.cancel()
            await _touch(state, service)
            await run_in_threadpool(close_state, state)

    app = FastAPI(title="loraplex", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible multi-LoRA serving: name the adapter with `adapter_id`.")
    install_handlers(app)
    upload_cap = config.store.max_upload_bytes + UPLOAD_FORM_OVERHEAD
    # The dashboard's upload posts the same multipart form as POST /v1/adapters: the same cap.
    app.add_middleware(BodyLimit, limit_for=lambda path: upload_cap if path.startswith(("/v1/adapters",
                                                                                         ADMIN_UPLOAD_PATH))
                       else MAX_JSON_BODY)
    for module in (routes_inference, routes_adapters, routes_tenants, routes_reports, routes_ops):
        app.include_router(module.router)
    mount_admin(app)  # the tenant dashboard at /admin (loraplex.admin_ui)
    return app


if __name__ == "__main__":  # pragma: no cover - `loraplex serve` is the entry point
    sys.exit("run `loraplex serve`")
