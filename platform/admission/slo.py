"""SLO-aware admission: refuse a request now if it cannot get its first token within its tenant's TTFT
target, and abort a queued request once its target has become unreachable (S-LoRA's early abort),
rather than serving either late.

One SloController per engine. The engine thread feeds it every step (after_step: fit the step cost,
publish a queue snapshot) and asks it, before scheduling, which waiting requests cannot make their
deadline any more (unreachable). HTTP handlers call check() from any thread: it reads only the last
published snapshot and cost, never the engine's live lists.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import dataclass

from .cost_model import StepCostModel, StepRecord
from .ttft import QueueSnapshot, RunningSeq, predict_first_token_s

SLO_MISSED = "slo_unreachable"


@dataclass(frozen=True)
class SloDecision:
    allowed: bool
    predicted_ttft_s: float
    retry_after_s: float  # when the queue ahead should have drained enough (0 when allowed)


class SloController:
    def __init__(self, max_num_batched_tokens: int, max_num_seqs: int, model: StepCostModel | None = None):
        self.model = model or StepCostModel()
        self.snapshot = QueueSnapshot.empty(max_num_batched_tokens, max_num_seqs)
        self.cost = self.model.current()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.refused = 0
        self.aborted = 0

    # -- any thread ----------------------------------------------------------------------------
    def check(self, prompt_tokens: int, budget_s: float, extra_s: float = 0.0) -> SloDecision:
        """May a request with this prompt get its first token within budget_s seconds from now?"""
        snap, cost = self.snapshot, self.cost
        predicted = predict_first_token_s(snap, cost, prompt_tokens, extra_s=extra_s)
        if predicted <= budget_s:
            return SloDecision(True, predicted, 0.0)
        self.refused += 1
        # The queue ahead drains at about one full step per step cost: retry once the excess is gone.
        return SloDecision(False, predicted, max(1.0, math.ceil(predicted - budget_s)))

    # -- engine thread -------------------------------------------------------------------------
    def after_step(self, record: StepRecord, running: Iterable, waiting: Iterable) -> None:
        self.model.observe(record)
        self.cost = self.model.current()
        self.publish(running, waiting)

    def publish(self, running: Iterable, waiting: Iterable) -> None:
        """Snapshot the queue (requests in the order the scheduler will consider them)."""
        self.snapshot = QueueSnapshot(
            running=tuple(RunningSeq(r.num_computed_tokens, max(0, r.params.max_tokens - len(r.output_token_ids)))
                          for r in running),
            waiting_prompt_tokens=tuple(max(1, r.num_tokens - r.num_computed_tokens) for r in waiting),
            max_num_batched_tokens=self.max_num_batched_tokens, max_num_seqs=self.max_num_seqs,
            taken_at=time.monotonic())

    def unreachable(self, running: Iterable, waiting_in_order: Iterable, now: float) -> list:
        """Waiting requests (those with a deadline) whose first token cannot come before it any more,
        predicted with the queue ahead of each in scheduling order."""
        cost = self.cost
        snap = QueueSnapshot(tuple(RunningSeq(r.num_computed_tokens,
                                              max(0, r.params.max_tokens - len(r.output_token_ids)))
                                   for r in running), (), self.max_num_batched_tokens, self.max_num_seqs, now)
        late = []
        ahead_tokens = ahead_requests = 0
        for req in waiting_in_order:
            own = max(1, req.num_tokens - req.num_computed_tokens)
            deadline = req.ttft_deadline
            if deadline is not None and req.first_token_time is None:
                eta = now + predict_first_token_s(snap, cost, own, ahead_tokens, ahead_requests)
                if eta > deadline:
                    late.append(req)
                    continue  # it leaves the queue: it is not ahead of the ones behind it
            ahead_tokens += own
            ahead_requests += 1
        self.aborted += len(late)
        return late
