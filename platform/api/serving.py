"""Between the HTTP routes and the engine: admit a request (adapter, prompt, limits), run it, meter it.

Admission checks everything the engine would refuse (context length, pool capacity, queue bound) so
that a refused request gets its HTTP status before a stream starts. Running fetches the adapter into
the host cache off the event loop and hands the engine thread a closure that installs the decoded
adapter, so the engine step never waits on the object store. Whatever happens (finish, client hang-up,
engine failure), exactly one usage record and one metrics observation are made.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio
from starlette.concurrency import run_in_threadpool

from loraplex.adapter_store.schemas import AdapterPublic, TenantPublic
from loraplex.admission import REQUEST_TOO_LARGE, TenantLimits, Ticket
from loraplex.admission.slo import SLO_MISSED
from loraplex.engine.request import RequestOutput
from loraplex.engine.sampling_params import SamplingParams
from loraplex.errors import AdapterNotFoundError, LoraplexError
from loraplex.metering.records import UsageRecord

from .auth import Principal
from .errors import ApiError, bad_request, forbidden, from_exception, not_found, too_many, unavailable
from .state import ServerState

log = logging.getLogger(__name__)

BASE_LABEL = "base"
_TENANT_TTL_S = 5.0  # a tenant's TTFT target changed by the operator applies within this long


@dataclass(frozen=True)
class Generation:
    """One admitted inference request: what the engine needs and what metering records."""

    request_id: str
    principal: Principal
    tenant: TenantPublic
    ttft_target_ms: float | None
    adapter: AdapterPublic | None  # None: the base model
    model_name: str  # echoed in responses: the adapter's name or the base model's id
    prompt_ids: list[int]
    params: SamplingParams
    received: float  # time.monotonic() when the HTTP request arrived
    ticket: Ticket | None = None  # the rate limiter's lease, released when the request ends

    @property
    def ttft_deadline(self) -> float | None:
        return None if self.ttft_target_ms is None else self.received + self.ttft_target_ms / 1000.0

    @property
    def adapter_label(self) -> str:
        return self.adapter.name if self.adapter is not None else BASE_LABEL


@dataclass
class _Timing:
    received: float
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)  # seconds between successive token arrivals

    def tokens(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        else:
            self.gaps.append(now - self.last_token)
        self.last_token = now


class InferenceService:
    def __init__(self, state: ServerState):
        self.state = state
        self._tenants: dict[str, tuple[float, TenantPublic]] = {}
        self.used_adapters: set[str] = set()  # version ids used since the last last_used_at flush

    # -- admission ---------------------------------------------------------------------------
    async def tenant(self, tenant_id: str) -> TenantPublic:
        now = time.monotonic()
        hit = self._tenants.get(tenant_id)
        if hit is not None and now - hit[0] < _TENANT_TTL_S:
            return hit[1]
        tenant = await run_in_threadpool(self.state.registry.get_tenant, tenant_id)
        self._tenants[tenant_id] = (now, tenant)
        return tenant

    async def admit(self, p: Principal, adapter_name: str | None, model: str | None,
                    make_prompt: Callable[[object], list[int]], make_params: Callable[[], dict],
                    prompt_param: str) -> Generation:
        """Resolve and check a request; refusals after authentication are metered before raising."""
        received = time.monotonic()
        state = self.state
        if p.is_operator:
            raise forbidden("operator keys manage the platform; run inference with a tenant's key")
        tenant = await self.tenant(p.tenant_id)
        rid = f"cmpl-{uuid.uuid4().hex}"
        target = tenant.ttft_target_ms or state.config.default_ttft_target_ms
        adapter: AdapterPublic | None = None
        ticket: Ticket | None = None
        try:
            params = make_params()
            if state.draining:
                raise unavailable("the server is shutting down; retry on another replica", code="draining")
            if state.engine is None or state.model is None:
                raise unavailable("the model is still loading; retry shortly", code="loading")
            if not state.engine.alive:
                raise unavailable("the engine has stopped", code="engine_dead")
            name, model_name = self._adapter_name(adapter_name, model)
            if name is not None:
                try:
                    adapter = await run_in_threadpool(state.store.resolve, p.tenant_id, name)
                except AdapterNotFoundError:
                    param = "adapter_id" if adapter_name is not None else "model"
                    raise not_found(f"adapter {name!r} does not exist", code="model_not_found",
                                    param=param) from None
            ids = make_prompt(state.model.tokenizer)
            self._check_context(ids, params.get("max_tokens"), prompt_param)
            if params.get("max_tokens") is None:  # chat without a limit: up to the context
                params["max_tokens"] = state.model.max_model_len - len(ids)
            sampling = SamplingParams(**params)
            self._check_capacity(ids, sampling, adapter)
            waiting = state.engine.stats.num_waiting
            if waiting >= state.config.max_waiting_requests:
                raise too_many(f"the server is at capacity ({waiting} requests queued); retry later",
                               retry_after_s=2, code="overloaded")
            ticket = await self._acquire(p.tenant_id, rid, len(ids) + sampling.max_tokens)
            if target is not None:
                self._check_slo(len(ids), target / 1000.0 - (time.monotonic() - received), adapter, tenant, rid,
                                sampling.max_tokens)
        except BaseException as e:
            if ticket is not None:
                await self._release(ticket, 0)
            if isinstance(e, Exception):  # every refused request leaves its usage record
                self._record_refusal(p, tenant, rid, adapter, received, from_exception(e), target)
            raise
        return Generation(rid, p, tenant, target, adapter, adapter.name if adapter else model_name, ids, sampling,
                          received, ticket)

    def forget_tenant(self, tenant_id: str) -> None:
        self._tenants.pop(tenant_id, None)

    def limits(self, tenant: TenantPublic) -> TenantLimits:
        """The tenant's own limits where set, else the server's defaults."""
        c = self.state.config

        def pick(own: int | None, default: int | None) -> int | None:
            return own if own is not None else default

        return TenantLimits(pick(tenant.requests_per_minute, c.default_requests_per_minute),
                            pick(tenant.tokens_per_minute, c.default_tokens_per_minute),
                            pick(tenant.max_concurrent, c.default_max_concurrent))

    async def _acquire(self, tenant_id: str, rid: str, tokens: int) -> Ticket:
        tenant = await self.tenant(tenant_id)
        d = await run_in_threadpool(self.state.limiter.acquire, tenant_id, rid, self.limits(tenant), tokens)
        if d.allowed:
            return d.ticket
        if d.reason == REQUEST_TOO_LARGE:  # waiting cannot help: the request is larger than the quota
            raise bad_request(f"the request reserves {tokens} tokens (prompt + max_tokens), more than the "
                              f"tenant's tokens-per-minute limit; lower max_tokens", param="max_tokens",
                              code="quota_exceeded")
        raise too_many(f"rate limit reached ({d.reason}); retry in {math.ceil(d.retry_after_s)} s",
                       retry_after_s=math.ceil(d.retry_after_s), code=d.reason or "rate_limited")

    def _check_slo(self, prompt_tokens: int, budget_s: float, adapter: AdapterPublic | None, tenant: TenantPublic,
                   rid: str, max_tokens: int) -> None:
        slo = self.state.slo
        if slo is None:
            return
        extra = self._adapter_load_estimate_s(adapter)
        # The tenant and its share place the request in the queue policy's order (under VTC a light tenant's
        # request is not predicted to wait behind another tenant's flood).
        d = slo.check(prompt_tokens, budget_s, extra, tenant=tenant.id, share=tenant.share, request_id=rid,
                      max_tokens=max_tokens)
        if not d.allowed:
            raise too_many(f"the first token would come in about {d.predicted_ttft_s * 1000:.0f} ms, past this "
                           f"tenant's TTFT target; retry later", retry_after_s=int(d.retry_after_s), code=SLO_MISSED)

    def _adapter_load_estimate_s(self, adapter: AdapterPublic | None) -> float:
        """Loading time to add when the adapter is not in host RAM: the mean measured load so far."""
        store = self.state.store
        if adapter is None or store is None or adapter.id in store.cache:
            return 0.0
        stats = store.cache_stats()
        return stats.load_seconds / stats.loads if stats.loads else 0.05

    def _adapter_name(self, adapter_id: str | None, model: str | None) -> tuple[str | None, str]:
        base = self.state.model.name
        if adapter_id:
            return adapter_id, adapter_id
        if model and model != base:
            return model, model  # `model` as an alias for clients that cannot send adapter_id
        return None, base

    def _check_context(self, ids: list[int], max_tokens: int | None, param: str) -> None:
        limit = self.state.model.max_model_len
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        if len(ids) >= limit:
            raise bad_request(f"the prompt has {len(ids)} tokens but the model's context is {limit} tokens "
                              f"(at least one must remain for the output)", param=param,
                              code="context_length_exceeded")

    def _check_capacity(self, ids: list[int], params: SamplingParams, adapter: AdapterPublic | None) -> None:
        core = self.state.engine.engine
        geometry = core.pager.geometry
        max_len = min(len(ids) + params.max_tokens, core.max_model_len)
        need = geometry.kv_pages_for_tokens(max_len)
        if not core.pager.can_ever_fit(need):
            raise bad_request(f"prompt + max_tokens ({max_len} tokens) needs {need} KV pages but the pool has "
                              f"{geometry.num_pages}; lower max_tokens", param="max_tokens",
                              code="context_length_exceeded")

    # -- running -----------------------------------------------------------------------------
    async def run(self, gen: Generation) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for this request; closing the iterator early aborts the request."""
        state = self.state
        state.enter()
        timing = _Timing(gen.received)
        status, reason, last = "error", None, None
        agen = None
        try:
            prepare = None
            if gen.adapter is not None:
                decoded = await asyncio.wrap_future(state.store.prefetch(gen.adapter))
                bridge, ref = state.bridge, gen.adapter
                prepare = lambda: bridge.install(ref, decoded)  # noqa: E731 (runs on the engine thread)
                self.used_adapters.add(ref.id)
            agen = state.engine.generate(gen.prompt_ids, gen.params, request_id=gen.request_id, prepare=prepare,
                                         tenant=gen.tenant.id, share=gen.tenant.share,
                                         ttft_deadline=gen.ttft_deadline)
            async for out in agen:
                last = out
                if out.new_token_ids:
                    timing.tokens(time.monotonic())
                if out.finished:
                    status, reason = {"abort": ("cancelled", "aborted"),
                                      SLO_MISSED: ("refused", f"429 {SLO_MISSED} (queued)")}.get(
                        out.finish_reason, ("ok", None))
                yield out
        except (GeneratorExit, asyncio.CancelledError):
            status, reason = "cancelled", "client disconnected"
            raise
        except LoraplexError as e:
            status, reason = "error", f"{type(e).__name__}: {e}"[:255]
            raise
        except Exception as e:
            status, reason = "error", f"{type(e).__name__}: {e}"[:255]
            log.exception("request %s failed", gen.request_id)
            raise
        finally:
            if agen is not None:
                await agen.aclose()  # aborts the request in the engine if it is still there (no suspension)
            state.leave()
            self._record(gen, timing, status, reason, last)
            if gen.ticket is not None:
                used = len(gen.prompt_ids) + (len(last.token_ids) if last is not None else 0)
                await self._release(gen.ticket, used)

    async def _release(self, ticket: Ticket, tokens_used: int) -> None:
        # Shielded: after a client hangs up, Starlette's cancel scope re-cancels every await in it, and the
        # lease must still go back (a Redis call, so off the loop).
        with anyio.CancelScope(shield=True):
            try:
                await run_in_threadpool(self.state.limiter.release, ticket, tokens_used)
            except Exception:  # the lease expires on its own; never fail a finished request
                log.warning("cannot release the rate-limit lease of %s", ticket.request_id, exc_info=True)

    # -- metering ----------------------------------------------------------------------------
    def _record(self, gen: Generation, timing: _Timing, status: str, reason: str | None,
                last: RequestOutput | None) -> None:
        end = time.monotonic()
        ms = 1000.0
        ttft = None if timing.first_token is None else timing.first_token - gen.received
        queue = None
        if last is not None and last.first_scheduled_time is not None:
            queue = max(0.0, last.first_scheduled_time - gen.received)
        completion = len(last.token_ids) if last is not None else 0
        self.state.recorder.record(UsageRecord(
            tenant_id=gen.tenant.id, request_id=gen.request_id, status=status, reason=reason,
            adapter_id=gen.adapter.id if gen.adapter else None, api_key_id=gen.principal.key_id,
            prompt_tokens=len(gen.prompt_ids), completion_tokens=completion,
            queue_ms=None if queue is None else queue * ms, ttft_ms=None if ttft is None else ttft * ms,
            e2e_ms=(end - gen.received) * ms, itl_ms=tuple(g * ms for g in timing.gaps),
            ttft_target_ms=gen.ttft_target_ms,
        ))
        self.state.metrics.observe(gen.tenant.name, gen.adapter_label, status, len(gen.prompt_ids), completion,
                                   ttft, end - gen.received, timing.gaps)

    async def record_invalid(self, api_key: str | None, err: ApiError) -> None:
        """A body that failed validation before any route ran: metered too, when the key is valid."""
        if not api_key:
            return
        key = await run_in_threadpool(self.state.registry.authenticate, api_key)
        if key is None or key.tenant_id is None:
            return
        tenant = await self.tenant(key.tenant_id)
        p = Principal(key.id, key.tenant_id, key.role)
        target = tenant.ttft_target_ms or self.state.config.default_ttft_target_ms
        self._record_refusal(p, tenant, f"cmpl-{uuid.uuid4().hex}", None, time.monotonic(), err, target)

    def _record_refusal(self, p: Principal, tenant: TenantPublic, rid: str, adapter: AdapterPublic | None,
                        received: float, err: ApiError, target: float | None) -> None:
        e2e = time.monotonic() - received
        reason = f"{err.status} {err.code or err.type}"
        self.state.recorder.record(UsageRecord(
            tenant_id=tenant.id, request_id=rid, status="refused", reason=reason[:255],
            adapter_id=adapter.id if adapter else None, api_key_id=p.key_id, e2e_ms=e2e * 1000.0,
            ttft_target_ms=target,
        ))
        label = adapter.name if adapter else BASE_LABEL
        self.state.metrics.observe(tenant.name, label, "refused", 0, 0, None, None, ())
