"""The scheduler: which requests run this step, and how many of their tokens.

One rule, as in vLLM V1: each request's num_computed_tokens catches up with its num_tokens.
There is no prefill or decode phase: a step mixes prompt chunks and single decode tokens under
one token budget. Running requests go first, in the order they started; then waiting ones in the
order of the queue policy (FCFS, LIFO, or VTC fairness across tenants: queue_policy.py), skipping any
whose adapter cannot be placed yet. A request is scheduled
only when its adapter is resident in the pool. When pages
run out, the pager first evicts idle adapters; if that is not enough, the newest running request
is preempted (its KV freed, recomputed later).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from loraplex.unified_pager import UnifiedPager

from .adapters import AdapterKey, AdapterTable
from .queue_policy import Fcfs, QueuePolicy
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
                 policy: QueuePolicy | None = None):
        self.pager = pager
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

    # -- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.pager.allocate_kv(req.request_id, req.num_computed_tokens + n):
                victim = self.running.pop()  # newest first
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                chunks.append(ScheduledChunk(req, n, self.adapter_keys[req.request_id]))
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing more fits

        # Waiting requests in the policy's order. One whose adapter cannot be placed yet is skipped, not
        # waited on: it must not hold back base-model requests or requests for resident adapters
        # (head-of-line blocking). A KV allocation that fails ends the scan: the pool is full.
        admitted: list[Request] = []
        for req in (self.policy.order(self.waiting) if not preempted else ()):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            key = self.adapter_keys[req.request_id]
            if key is not None:
                if self.adapters.ensure_resident(key) is None:
                    continue
                self.pager.pin(key)  # before KV allocation, which may evict idle adapters
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.pager.allocate_kv(req.request_id, req.num_computed_tokens + n):
                if key is not None:
                    self.pager.unpin(key)
                break
            admitted.append(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            chunks.append(ScheduledChunk(req, n, key))
            budget -= n
        for req in admitted:
            self.waiting.remove(req)
        return SchedulerOutput(tuple(chunks), tuple(preempted))
