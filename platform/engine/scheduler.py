"""The scheduler: which requests run this step, and how many of their tokens.

One rule, as in vLLM V1: each request's num_computed_tokens catches up with its num_tokens.
There is no prefill or decode phase: a step mixes prompt chunks and single decode tokens under
one token budget. Running requests go first, in the order they started; then waiting ones in the
order of the queue policy (FCFS, LIFO, or VTC fairness across tenants: queue_policy.py), skipping any
whose adapter cannot be placed yet. A request is scheduled
only when its adapter is resident in the pool. When pages
run out, the pager first evicts idle adapters; if that is not enough, the newest running request
is preempted (its KV freed, recomputed later).

Under VTC the policy changes (queue_policy.Vtc): the order of the running requests (least-served tenants
first); which running prompt chunks wait until the waiting requests are placed (those of tenants ahead of a
waiting tenant: `later`); which prompt chunks wait a step because a less-served tenant's prompt is in it
(holds); whether a waiting request may preempt a running one to get a slot or pages (make_room: one of a
tenant ahead of it); and which request is preempted when pages run out (the newest of a tenant ahead of the others).
FCFS and LIFO keep the rules above.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from loraplex.unified_pager import UnifiedPager

from .adapters import AdapterKey, AdapterTable
from .queue_policy import Fcfs, QueuePolicy
from .queue_view import QueueView
from .request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int
    adapter: AdapterKey | None


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, pager: UnifiedPager, adapters: AdapterTable, max_num_seqs: int, max_num_batched_tokens: int,
                 policy: QueuePolicy | None = None, kv_reserve_tokens: int = 0):
        self.pager = pager
        self.kv_reserve_tokens = kv_reserve_tokens  # EngineConfig.kv_reserve_tokens
        self.policy = policy if policy is not None else Fcfs()
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.adapter_keys: dict[str, AdapterKey | None] = {}  # request id -> the version it uses

    # -- queue ---------------------------------------------------------------------------------
    def add(self, req: Request, adapter: AdapterKey | None) -> None:
        self.adapter_keys[req.request_id] = adapter
        if adapter is not None:
            self.adapters.acquire(adapter)
        self.waiting.append(req)
        self.policy.on_add(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take a request out of the queues and give back everything it holds."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self._release_pages(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        req.finish_time = time.monotonic()
        key = self.adapter_keys.pop(req.request_id, None)
        if key is not None:
            self.adapters.release(key)
        self.policy.on_finish(req)

    def account(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        """The engine computed this many prompt tokens and generated this many tokens for req."""
        self.policy.on_tokens(req, prompt_tokens, output_tokens)

    def _release_pages(self, req: Request) -> None:
        self.pager.free_kv(req.request_id)
        key = self.adapter_keys.get(req.request_id)
        if key is not None:
            self.pager.unpin(key)

    def _preempt(self, req: Request) -> None:
        self._release_pages(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def view(self) -> QueueView:
        """A frozen picture of the queues in the policy's terms, for readers on other threads (SLO checks)."""
        return self.policy.view(self.running, self.waiting)

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        prompt_tenants: set = set()  # tenants with a prompt chunk in this step (the policy may hold others back)
        first, later = self.policy.split_running(self.running, self.waiting)
        budget = self._schedule_running(first, budget, chunks, preempted, prompt_tenants)

        # Waiting requests in the policy's order. One whose adapter cannot be placed yet is skipped, not
        # waited on: it must not hold back base-model requests or requests for resident adapters
        # (head-of-line blocking). When no sequence slot or no pages are left, the policy may preempt a
        # running request to make room (VTC: one of a more-served tenant; FCFS and LIFO never do); otherwise
        # the scan ends there.
        # After a preemption in this step (the pool is full) vLLM admits nothing; here too, except requests for
        # which the policy would make room (under VTC: those of tenants behind a running tenant).
        admitted: list[Request] = []
        started = len(self.running)  # running[:started] ran before this scan: the only candidates to make room
        held: dict = {}  # tenant -> its running sequences (the policy may cap them)
        for r in self.running:
            held[r.tenant] = held.get(r.tenant, 0) + 1
        for req in self.policy.order(self.waiting):
            if budget <= 0:
                break
            if preempted and self.policy.make_room(req, self.running[:started]) is None:
                break
            if self.policy.holds(req, prompt_tenants):
                continue
            cap = self.policy.seq_cap(req, self.max_num_seqs)
            if cap is not None and held.get(req.tenant, 0) >= cap:
                continue
            while len(self.running) >= self.max_num_seqs and self._make_room(req, started, chunks, preempted, held):
                started -= 1
            if len(self.running) >= self.max_num_seqs:
                break
            key = self.adapter_keys[req.request_id]
            if key is not None:
                if self.adapters.ensure_resident(key) is None:
                    continue
                self.pager.pin(key)  # before KV allocation, which may evict idle adapters
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            fits = self._allocate(req, n)
            while not fits and self._make_room(req, started, chunks, preempted, held):
                started -= 1
                fits = self._allocate(req, n)
            if not fits:
                if key is not None:
                    self.pager.unpin(key)
                break
            admitted.append(req)
            held[req.tenant] = held.get(req.tenant, 0) + 1
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            chunks.append(ScheduledChunk(req, n, key))
            budget -= n
            prompt_tenants.add(req.tenant)
        for req in admitted:
            self.waiting.remove(req)
        if later:  # running prompt chunks the policy put behind the waiting requests
            self._schedule_running(later, budget, chunks, preempted, prompt_tenants)
        # Requests the policy holds back because of a prompt placed after them in this step (their KV stays
        # allocated for the tokens: allocation never shrinks, and they run in a later step).
        chunks = [c for c in chunks if not self.policy.holds(c.request, prompt_tenants)]
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _schedule_running(self, reqs: list[Request], budget: int, chunks: list[ScheduledChunk],
                          preempted: list[str], prompt_tenants: set) -> int:
        """Schedule these running requests in order under the budget; when pages run out, preempt the policy's
        victim until the request fits (or is itself the victim). Returns the budget left."""
        for req in reqs:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            prompt = req.num_tokens - req.num_computed_tokens > 1
            if self.policy.holds(req, prompt_tenants):
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._allocate(req, n):
                victim = self.policy.victim(self.running)
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim.request_id)
                budget += self._unschedule(victim, chunks)
                if victim is req:
                    break
            else:
                chunks.append(ScheduledChunk(req, n, self.adapter_keys[req.request_id]))
                budget -= n
                if prompt:
                    prompt_tenants.add(req.tenant)
        return budget

    def _allocate(self, req: Request, n: int) -> bool:
        """KV for req's next n tokens, with up to kv_reserve_tokens more reserved where the pool has them free
        (never past the last token whose KV the request can write: its prompt and max_tokens outputs, less the
        last output, which is sampled, not fed back)."""
        upto = req.num_computed_tokens + n
        last = min(len(req.prompt_token_ids) + req.params.max_tokens, req.max_total_tokens) - 1
        return self.pager.allocate_kv(req.request_id, upto, max(0, min(self.kv_reserve_tokens, last - upto)))

    def _make_room(self, req: Request, started: int, chunks: list[ScheduledChunk], preempted: list[str],
                   held: dict) -> bool:
        """Preempt the running request the policy names to make room for the waiting req; False: none."""
        victim = self.policy.make_room(req, self.running[:started])
        if victim is None:
            return False
        held[victim.tenant] -= 1
        self.running.remove(victim)
        self._preempt(victim)
        preempted.append(victim.request_id)
        self._unschedule(victim, chunks)  # its budget is not reused in this scan: the step is already planned
        return True

    @staticmethod
    def _unschedule(req: Request, chunks: list[ScheduledChunk]) -> int:
        """Take back a chunk scheduled earlier in this step for a request since preempted; its tokens."""
        for i, c in enumerate(chunks):
            if c.request is req:
                del chunks[i]
                return c.num_new_tokens
        return 0
