"""Simulation mode: replay a request trace through the real scheduler, queue policy, page pool and SLO
controller, with a step-cost model in place of the model (as vLLM scheduling studies do).

    sim = Simulator(model_config, StepCost(...), SimConfig(policy="vtc", admission=True, early_abort=True))
    result = sim.run(trace)                 # trace: objects with TraceRequest's fields (benchmarks/traces.py)
    summarize(result.outcomes)              # sim_metrics.py: SLO attainment, goodput, TTFT, throughput

What is real: Scheduler (chunked prefill under the token budget, preemption, adapter residency), the queue
policy (FCFS, LIFO, VTC), UnifiedPager and AdapterTable sized from the model config (LoraAdapter objects of
the trace's ranks take pages in the pool; KV allocation evicts them), and SloController (check() at arrival
when `admission` is on, as the HTTP layer calls it; unreachable() before each step when `early_abort` is on,
as EngineCore does; after_step() after each step).

What is simulated: time. A virtual clock advances each step by cost.predict(new_tokens, cached_tokens), plus
the copy of any adapter placed in the pool during the step at `adapter_load_bytes_per_s` (the engine does
that copy inside schedule()). No model runs: a request "samples" a token whenever its computed tokens catch
up with its known tokens (the model runner's rule) and generates exactly its trace's output_tokens (EOS is
ignored). Arrivals that come during a step join at the step's end, as with AsyncEngine's thread, and their
admission check sees the queue snapshot published after the step before (as an HTTP handler would).

Deterministic: same trace, cost and config, same outcomes (no wall clock, no randomness). One Simulator runs
one trace. run() uses one torch thread while it runs (its only tensor work is small adapter copies).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from loraplex.config import DEFAULT_CPU_POOL_BYTES, DTYPES
from loraplex.engine.adapters import AdapterKey
from loraplex.engine.queue_policy import make_queue_policy
from loraplex.engine.request import Request, RequestStatus
from loraplex.engine.sampling_params import SamplingParams
from loraplex.engine.scheduler import Scheduler, SchedulerOutput
from loraplex.errors import CapacityError
from loraplex.models.config import ModelConfig
from loraplex.unified_pager import PoolGeometry, PoolStats, UnifiedPager

from .cost_model import StepCost, StepCostModel, StepRecord
from .sim_adapters import DEFAULT_SIM_MODULES, MeteredAdapterTable, SimAdapterFactory
from .slo import SloController

OK = "ok"
REFUSED = "refused_at_admission"
ABORTED = "aborted_in_queue"
STATUSES = (OK, REFUSED, ABORTED)


class TraceItem(Protocol):
    """What the simulation reads of a trace request (benchmarks/traces.py's TraceRequest has these)."""

    @property
    def id(self) -> str: ...
    @property
    def arrival_s(self) -> float: ...
    @property
    def tenant(self) -> str: ...
    @property
    def adapter(self) -> str | None: ...
    @property
    def rank(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def ttft_target_ms(self) -> float: ...


@dataclass(frozen=True)
class SimConfig:
    policy: str = "fcfs"  # queue policy: fcfs | lifo | vtc
    admission: bool = False  # SloController.check() at arrival: refuse what cannot meet its TTFT target
    early_abort: bool = False  # SloController.unreachable() before each step: abort the queued hopeless
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    pool_bytes: int = DEFAULT_CPU_POOL_BYTES
    block_size: int = 16
    dtype: str = "float32"
    max_model_len: int | None = None  # None: the model's
    adapter_modules: tuple[str, ...] = DEFAULT_SIM_MODULES
    # Host -> pool copy rate charged for each adapter placement; None: placements are free.
    adapter_load_bytes_per_s: float | None = 2e9
    shares: Mapping[str, float] = field(default_factory=dict)  # tenant -> VTC weight (default 1.0)


@dataclass(frozen=True)
class SimOutcome:
    id: str
    tenant: str
    arrival_s: float
    ttft_target_s: float
    status: str  # one of STATUSES
    first_token_s: float | None  # virtual time of its first token
    finish_s: float | None  # when it finished, was refused or was aborted
    prompt_tokens: int
    output_tokens: int  # generated
    predicted_ttft_s: float | None = None  # what the admission check predicted on arrival (admission on)
    preemptions: int = 0  # times it was preempted (its KV freed and recomputed)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def attained(self) -> bool:
        ttft = self.ttft_s
        return ttft is not None and ttft <= self.ttft_target_s


@dataclass(frozen=True)
class SimResult:
    outcomes: tuple[SimOutcome, ...]  # in trace order
    end_s: float  # virtual time when the last request finished
    steps: int
    busy_s: float  # virtual time spent in steps
    preemptions: int
    adapter_loads: int
    pool: PoolStats  # at the end
    final_cost: StepCost  # the SLO controller's fitted cost at the end (the given one without SLO)


class Simulator:
    def __init__(self, model_config: ModelConfig, cost: StepCost, config: SimConfig = SimConfig()):
        self.config = config
        self.cost = cost
        geometry = PoolGeometry.for_model(model_config, config.pool_bytes, DTYPES[config.dtype], config.block_size)
        self.pager = UnifiedPager(geometry, "cpu")
        self.adapters = MeteredAdapterTable(self.pager)
        self.scheduler = Scheduler(self.pager, self.adapters, config.max_num_seqs, config.max_num_batched_tokens,
                                   make_queue_policy(config.policy))
        self.slo: SloController | None = None
        if config.admission or config.early_abort:
            # Primed with the given cost: the simulated steps take exactly what it predicts, so the online fit
            # (fed every step, as in the engine) stays on it.
            self.slo = SloController(config.max_num_batched_tokens, config.max_num_seqs,
                                     StepCostModel(prior=cost, min_samples=1))
        self._factory = SimAdapterFactory(model_config, geometry.row_layout, config.adapter_modules)
        self._keys: dict[str, AdapterKey] = {}
        self.max_model_len = min(config.max_model_len or model_config.max_model_len, model_config.max_model_len)
        self.now = 0.0
        self.steps = 0
        self.busy_s = 0.0
        self.preemptions = 0
        self._outcomes: dict[str, SimOutcome] = {}
        self._items: dict[str, TraceItem] = {}
        self._predicted: dict[str, float] = {}
        self._arrivals: list[TraceItem] = []
        self._next = 0  # index of the next arrival

    # -- the loop ------------------------------------------------------------------------------
    def run(self, trace: Iterable[TraceItem]) -> SimResult:
        # The only tensor work here is copying adapters into the pool: small copies, which one thread does
        # several times faster than two fighting over a loaded machine. Restored afterwards.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return self._run(list(trace))
        finally:
            torch.set_num_threads(threads)

    def _run(self, order: list[TraceItem]) -> SimResult:
        if self.steps or self._items:
            raise RuntimeError("a Simulator runs one trace; make a new one")
        if len({r.id for r in order}) != len(order):
            raise ValueError("trace request ids must be unique")
        self._arrivals = sorted(order, key=lambda r: r.arrival_s)  # stable: ties keep trace order
        self._next = 0
        while self._next < len(self._arrivals) or self.scheduler.has_unfinished():
            if not self.scheduler.has_unfinished():  # idle: nothing happens until the next arrival
                self.now = max(self.now, self._arrivals[self._next].arrival_s)
                self._enqueue(self._admit_arrivals())
            if self.scheduler.has_unfinished():
                self._step()
        return SimResult(
            outcomes=tuple(self._outcomes[r.id] for r in order),
            end_s=self.now, steps=self.steps, busy_s=self.busy_s, preemptions=self.preemptions,
            adapter_loads=self.adapters.loads, pool=self.pager.stats(),
            final_cost=self.slo.cost if self.slo is not None else self.cost)

    def _admit_arrivals(self) -> list[tuple[Request, AdapterKey | None]]:
        """Requests that arrived by now, through the admission check: each is checked the moment it comes in,
        as the HTTP layer does, so against the snapshot published after the step before it (call this before
        after_step publishes the step that was running when they came)."""
        admitted = []
        while self._next < len(self._arrivals) and self._arrivals[self._next].arrival_s <= self.now:
            item = self._arrivals[self._next]
            self._next += 1
            req = self._arrive(item)
            if req is not None:
                admitted.append(req)
        return admitted

    def _enqueue(self, admitted: list[tuple[Request, AdapterKey | None]]) -> None:
        for req, key in admitted:
            self.scheduler.add(req, key)

    def _arrive(self, item: TraceItem) -> tuple[Request, AdapterKey | None] | None:
        self._items[item.id] = item
        target_s = item.ttft_target_ms / 1000.0
        if item.prompt_tokens < 1 or item.output_tokens < 1:
            raise ValueError(f"request {item.id}: prompt and output need at least one token")
        if item.prompt_tokens >= self.max_model_len:
            raise ValueError(f"request {item.id}: a {item.prompt_tokens}-token prompt leaves no room in "
                             f"{self.max_model_len} tokens of context")
        key = self._adapter(item)
        adapter_pages = self.pager.geometry.adapter_num_pages(self.adapters.host(key)) if key else 0
        max_len = min(item.prompt_tokens + item.output_tokens, self.max_model_len)
        if not self.pager.can_ever_fit(self.pager.geometry.kv_pages_for_tokens(max_len) + adapter_pages):
            raise CapacityError(f"request {item.id} can never fit in this pool; raise pool_bytes")
        if self.slo is not None and self.config.admission:
            # The whole target is the budget: the check runs the moment the request comes in.
            decision = self.slo.check(item.prompt_tokens, target_s, tenant=item.tenant,
                                      share=float(self.config.shares.get(item.tenant, 1.0)), request_id=item.id,
                                      max_tokens=item.output_tokens, now=item.arrival_s)
            self._predicted[item.id] = decision.predicted_ttft_s
            if not decision.allowed:
                self._record(item, REFUSED, None, item.arrival_s, 0)
                return None
        req = Request(
            request_id=item.id, prompt_token_ids=[0] * item.prompt_tokens,
            params=SamplingParams(max_tokens=item.output_tokens, ignore_eos=True), adapter=item.adapter,
            max_total_tokens=self.max_model_len, tenant=item.tenant,
            share=float(self.config.shares.get(item.tenant, 1.0)),
            ttft_deadline=item.arrival_s + target_s, arrival_time=item.arrival_s)
        return req, key

    def _adapter(self, item: TraceItem) -> AdapterKey | None:
        if item.adapter is None:
            return None
        key = self._keys.get(item.adapter)
        if key is None:
            key = self.adapters.add(item.adapter, self._factory.make(item.adapter, item.rank))
            self._keys[item.adapter] = key
        return key

    def _step(self) -> None:
        """EngineCore.step with the model replaced by the cost model."""
        sched = self.scheduler
        if self.slo is not None and self.config.early_abort:
            waiting = {r.request_id: r for r in sched.waiting}
            for rid in self.slo.unreachable(sched.view(), self.now):
                req = waiting[rid]
                sched.finish(req, RequestStatus.FINISHED_SLO_MISSED)
                self._record(self._items[req.request_id], ABORTED, None, self.now, 0, req.num_preemptions)
            if not sched.has_unfinished():
                return
        loaded_before = self.adapters.loaded_bytes
        out = sched.schedule()
        self.preemptions += len(out.preempted)
        if not out.chunks:
            raise CapacityError("no waiting request fits in the pool even with nothing running")
        cached = sum(c.request.num_computed_tokens for c in out.chunks)  # KV read before this step
        compute_s = self.cost.predict(out.num_tokens, cached)
        load_s = 0.0
        if self.config.adapter_load_bytes_per_s:
            load_s = (self.adapters.loaded_bytes - loaded_before) / self.config.adapter_load_bytes_per_s
        self.now += compute_s + load_s
        self.busy_s += compute_s + load_s
        self.steps += 1
        self._postprocess(out)
        # Requests that came during the step: checked against the snapshot of the step before, then added
        # after this step's snapshot is published (AsyncEngine applies its commands after each step).
        arrived = self._admit_arrivals()
        if self.slo is not None:
            # The engine times only the model's execution (not schedule(), where adapters are placed).
            self.slo.after_step(StepRecord(out.num_tokens, cached, len(out.chunks), compute_s), sched.view(),
                                now=self.now)
        self._enqueue(arrived)

    def _postprocess(self, out: SchedulerOutput) -> None:
        """EngineCore._postprocess without a model: the same token accounting (VTC charges, prompt tokens
        charged once across recomputes), a token whenever a request has caught up, finish at max_tokens.
        The token accounting is Request.advance, shared with the engine; the rest is a mirror rather than a
        shared hook so that the engine's hot path stays as it is."""
        for chunk in out.chunks:
            req = chunk.request
            new_prompt = req.advance(chunk.num_new_tokens)
            sampled = req.num_computed_tokens == req.num_tokens  # the runner samples once a request caught up
            self.scheduler.account(req, new_prompt, 1 if sampled else 0)
            if not sampled:
                continue
            req.output_token_ids.append(0)
            if req.first_token_time is None:
                req.first_token_time = self.now
            if len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= req.max_total_tokens:
                self.scheduler.finish(req, RequestStatus.FINISHED_LENGTH)
                self._record(self._items[req.request_id], OK, req.first_token_time, self.now,
                             len(req.output_token_ids), req.num_preemptions)

    def _record(self, item: TraceItem, status: str, first_token_s: float | None, finish_s: float,
                output_tokens: int, preemptions: int = 0) -> None:
        if item.id in self._outcomes:
            raise AssertionError(f"request {item.id} ended twice")
        self._outcomes[item.id] = SimOutcome(item.id, item.tenant, item.arrival_s, item.ttft_target_ms / 1000.0,
                                             status, first_token_s, finish_s, item.prompt_tokens, output_tokens,
                                             self._predicted.get(item.id), preemptions)


def simulate(trace: Sequence[TraceItem], model_config: ModelConfig, cost: StepCost,
             config: SimConfig = SimConfig()) -> SimResult:
    return Simulator(model_config, cost, config).run(trace)
