"""SLO-aware admission: refuse a request now if it cannot get its first token within its tenant's TTFT
target, and abort a queued request once its target has become unreachable (S-LoRA's early abort),
rather than serving either late.

One SloController per engine. The engine thread feeds it every step (after_step: fit the step cost,
publish a frozen view of the queues, Scheduler.view()) and asks it, before scheduling, which waiting requests
cannot make their deadline any more (unreachable). HTTP handlers call check() from any thread: it reads only
the last published snapshot and cost, never the engine's live lists.

Both predict by playing the scheduler's steps forward (ttft.play_out) in the order the queue policy serves
requests: under FCFS a new request waits behind every waiting one; under LIFO behind none; under VTC behind the
requests of tenants with smaller virtual counters, not behind a flood of a tenant that has had more than its
share. Requests accepted by check() since the last snapshot (not yet in it: the engine adds them after the
step in progress) count as queued ahead of a new one.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from loraplex.engine.queue_view import Queued, QueueView

from .cost_model import StepCostModel, StepRecord
from .ttft import QueueSnapshot, play_out, predict_first_token_s

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
        self._lock = threading.Lock()
        self._generation = 0  # snapshots published so far
        self._accepted: list[tuple[int, Queued]] = []  # accepted by check(), with the generation they saw
        self._ids = 0

    # -- any thread ----------------------------------------------------------------------------
    def check(self, prompt_tokens: int, budget_s: float, extra_s: float = 0.0, tenant: str | None = None,
              share: float = 1.0, request_id: str | None = None, max_tokens: int = 1,
              now: float | None = None) -> SloDecision:
        """May a request with this prompt get its first token within budget_s seconds from now? tenant and
        share place it in the queue policy's order (VTC); request_id and max_tokens describe it to the checks
        of requests that arrive before the engine has added it."""
        now = time.monotonic() if now is None else now
        with self._lock:
            snap, cost = self.snapshot, self.cost
            ahead = tuple(q for _, q in self._accepted)
        predicted = predict_first_token_s(snap, cost, prompt_tokens, now, tenant, share, ahead, extra_s,
                                          horizon_s=4 * budget_s + 1.0)
        if predicted <= budget_s:
            with self._lock:
                self._ids += 1
                rid = request_id if request_id is not None else f"\0accepted{self._ids}"
                self._accepted.append((self._generation,
                                       Queued(rid, tenant, share, 0, max(1, prompt_tokens), max(1, max_tokens))))
            return SloDecision(True, predicted, 0.0)
        self.refused += 1
        # The queue ahead drains at about one full step per step cost: retry once the excess is gone.
        return SloDecision(False, predicted, max(1.0, math.ceil(predicted - budget_s)))

    # -- engine thread -------------------------------------------------------------------------
    def after_step(self, record: StepRecord, view: QueueView, now: float | None = None) -> None:
        self.model.observe(record)
        self.cost = self.model.current()
        self.publish(view, now)

    def publish(self, view: QueueView, now: float | None = None) -> None:
        """Publish the queues as they are after a step (Scheduler.view()). Requests accepted before the last
        publish are in this view (the engine adds accepted requests after each step); those accepted since
        are not yet, unless the view shows them by id."""
        ids = {q.id for q in view.running} | {q.id for q in view.waiting}
        snap = QueueSnapshot(view, self.max_num_batched_tokens, self.max_num_seqs,
                             time.monotonic() if now is None else now)
        with self._lock:
            self._accepted = [(g, q) for g, q in self._accepted if g == self._generation and q.id not in ids]
            self._generation += 1
            self.snapshot = snap

    def unreachable(self, view: QueueView, now: float) -> list[str]:
        """Ids of waiting requests (those with a deadline and no first token yet) whose first token cannot come
        before it any more, predicted in the policy's serving order; a request found late leaves the queue
        (it takes no budget from those behind it in the prediction)."""
        deadlines = {q.id: q.deadline - now for q in view.waiting if q.deadline is not None}
        if not deadlines:
            return []
        out = play_out(view.plan(), self.cost, self.max_num_batched_tokens, self.max_num_seqs, deadlines,
                       deadlines=deadlines, horizon_s=max(deadlines.values()))
        late = [q.id for q in view.waiting if q.id in deadlines
                and (q.id in out.late or out.first_token_s.get(q.id, math.inf) > deadlines[q.id])]
        self.aborted += len(late)
        return late
