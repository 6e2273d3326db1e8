"""Predict when queued requests get their first token: play the scheduler's steps forward from a frozen view
of its queues (loraplex.engine.queue_view) with the fitted step cost, without running them.

Each simulated step follows the scheduler's rules as the view's plan gives them: running requests first
(decoding ones one token each, then prompt chunks of the `first` group in order), then waiting requests in the
policy's order while the token budget and the sequence slots last (a prompt longer than what is left of the
budget is cut into chunks over several steps), then the deferred prompt chunks (`later`, VTC). Under VTC also:
the tenants in plan.yields add nothing to a step that carries another tenant's prompt, and their prompt chunks
go after the waiting requests; a waiting request of a tenant at its sequence cap (plan.seq_caps) is not
started; one in plan.preempts takes a slot even when none is free. A step costs cost.predict(new tokens,
cached tokens read). A request samples a token when its prompt is done; it then decodes one token a step
until its max_tokens and leaves, freeing its slot.

What it leaves out: requests that will arrive later (under VTC and LIFO they may go ahead), preemption (a
request the plan says may preempt for a slot takes one; its victim stays in the playout), adapter
loads (callers add them), EOS before max_tokens (finishing later than that only errs late, the safe side for a
refusal), and, when decodes alone exceed the budget, which of them wait.

Step 0 is the step in progress when the snapshot was taken (the engine runs the next step right after it
publishes): a request arriving now joins after it, and only the part of it not yet elapsed counts.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from loraplex.engine.queue_view import OrderedView, Queued, QueueView, StepPlan, vtc_seq_cap

from .cost_model import StepCost

MAX_STEPS = 100_000  # a bound on one playout, whatever the horizon


@dataclass(frozen=True)
class QueueSnapshot:
    """What the engine thread publishes after each step (read by admission on the HTTP side)."""

    view: QueueView
    max_num_batched_tokens: int
    max_num_seqs: int
    taken_at: float  # when the step after it started (time.monotonic(), or the simulation's clock)

    @staticmethod
    def empty(max_num_batched_tokens: int, max_num_seqs: int) -> "QueueSnapshot":
        return QueueSnapshot(OrderedView((), ()), max_num_batched_tokens, max_num_seqs, 0.0)


@dataclass(frozen=True)
class Playout:
    first_token_s: Mapping[str, float]  # watched id -> seconds from the start of step 0 to its first token
    late: frozenset  # watched ids dropped at their deadline before being admitted, or past the horizon
    step0_s: float  # the duration of step 0
    end_s: float  # where the playout stopped
    steps: int


class _Seq:
    __slots__ = ("id", "tenant", "todo", "context", "remaining", "join", "deadline", "n")

    def __init__(self, q: Queued, join: int = 0, deadline: float | None = None):
        self.id, self.tenant, self.todo, self.context = q.id, q.tenant, q.todo, q.context
        self.remaining, self.join, self.deadline, self.n = max(1, q.remaining), join, deadline, 0


class _Decoders:
    """Decoding sequences, aggregated: one token each per step they run in. Their own clock counts those steps
    (a held group does not advance); a sequence's context = c0 + (clock - clock0)."""

    def __init__(self):
        self.n = self.offset = self.clock = 0
        self.ends: list = []  # heap of (the clock of its last decode, c0 - clock0, tenant)

    def add(self, s: _Seq) -> None:
        self.n += 1
        self.offset += s.context - self.clock
        heapq.heappush(self.ends, (self.clock + s.remaining - 1, s.context - self.clock, s.tenant))

    def cached(self) -> int:
        return self.offset + self.n * self.clock

    def advance(self, held: dict) -> None:
        """After a step they ran in: the ones that reached max_tokens leave."""
        while self.ends and self.ends[0][0] <= self.clock:
            _, c, tenant = heapq.heappop(self.ends)
            self.n -= 1
            self.offset -= c
            held[tenant] -= 1
        self.clock += 1


def play_out(plan: StepPlan, cost: StepCost, max_num_batched_tokens: int, max_num_seqs: int,
             watch: Collection[str], joins_at: Mapping[str, int] | None = None,
             deadlines: Mapping[str, float] | None = None, horizon_s: float = float("inf")) -> Playout:
    """Play the steps of `plan` until every watched request has its first token (or is late) or the horizon.

    joins_at: id -> the step from which a waiting request may be admitted (1: it arrives during step 0).
    deadlines: id -> seconds from the start of step 0; a waiting request not admitted by its deadline is
    dropped (it would be aborted: it then takes no budget from those behind it)."""
    joins_at, deadlines = joins_at or {}, deadlines or {}
    todo_watch = set(watch)
    first: dict[str, float] = {}
    late: set[str] = set()
    yields = plan.yields
    caps = {t: vtc_seq_cap(max_num_seqs, share, total) for t, (share, total) in plan.seq_caps.items()}
    held: dict = {}  # tenant -> running sequences
    decoding = {False: _Decoders(), True: _Decoders()}  # by whether the tenant yields (plan.yields)
    prefill: list[_Seq] = []  # running prompt chunks served before the waiting requests, in order
    for q in plan.first:
        s = _Seq(q)
        (prefill.append(s) if q.prefilling else decoding[s.tenant in yields].add(s))
    later = [_Seq(q) for q in plan.later]
    for q in plan.first + plan.later:
        held[q.tenant] = held.get(q.tenant, 0) + 1
    waiting = [_Seq(q, joins_at.get(q.id, 0), deadlines.get(q.id)) for q in plan.waiting]
    head = 0  # waiting[:head] are admitted or dropped
    t = step0 = 0.0
    k = 0
    while todo_watch and k < MAX_STEPS:
        if t > horizon_s:
            late |= todo_watch
            break
        # Running decodes take their tokens first (those held back in this step too: the scheduler plans them
        # before it sees the prompt that holds them back).
        budget = max_num_batched_tokens - min(max_num_batched_tokens, decoding[False].n + decoding[True].n)
        scheduled: list[_Seq] = []
        prompt_in_step = False  # a prompt chunk of a tenant not in yields is in this step: yields wait
        deferred = [s for s in prefill if s.tenant in yields] + later  # after the waiting requests (vtc_split)
        for s in prefill:
            if budget <= 0:
                break
            if s.tenant in yields:
                continue
            prompt_in_step = True
            s.n = min(s.todo, budget)
            budget -= s.n
            scheduled.append(s)
        # Admit waiting requests in order while budget and slots last.
        nseq = sum(held.values())
        i = head
        unjoined = False
        while i < len(waiting) and budget > 0:
            s = waiting[i]
            if s is None:
                i += 1
                continue
            if s.join > k:
                unjoined = True
                i += 1
                continue
            if nseq >= max_num_seqs and s.id not in plan.preempts:
                break  # no slot: it waits for one to free (a preempting one takes a slot; its victim not modelled)
            if prompt_in_step and s.tenant in yields or held.get(s.tenant, 0) >= caps.get(s.tenant, max_num_seqs):
                i += 1
                continue
            waiting[i] = None
            i += 1
            if s.deadline is not None and t >= s.deadline:
                late.add(s.id)
                todo_watch.discard(s.id)
                continue
            prompt_in_step = prompt_in_step or s.tenant not in yields
            s.n = min(s.todo, budget)
            budget -= s.n
            nseq += 1
            held[s.tenant] = held.get(s.tenant, 0) + 1
            prefill.append(s)
            scheduled.append(s)
        while head < len(waiting) and waiting[head] is None:
            head += 1
        for s in deferred:
            if budget <= 0:
                break
            if prompt_in_step and s.tenant in yields:
                continue
            s.n = min(s.todo, budget)
            budget -= s.n
            scheduled.append(s)
        if prompt_in_step:  # what yields waits, decodes included (the scheduler's final filter)
            scheduled = [s for s in scheduled if s.tenant not in yields]
        groups = [d for y, d in decoding.items() if d.n and not (prompt_in_step and y)]
        tokens = sum(s.n for s in scheduled) + sum(d.n for d in groups)
        cached = sum(s.context for s in scheduled) + sum(d.cached() for d in groups)
        if tokens == 0:
            if not unjoined and not any(w is not None for w in waiting[head:]):
                late |= todo_watch  # nothing left that could produce their tokens
                break
            k += 1  # idle until an arrival joins: no time passes
            continue
        t += cost.predict(tokens, cached)
        if k == 0:
            step0 = t
        # After the step: decoders move on; prompt chunks progress, finished prompts sample their first token.
        for d in groups:
            d.advance(held)
        done = set()
        for s in scheduled:
            s.todo -= s.n
            s.context += s.n
            if s.todo > 0:
                continue
            done.add(s)
            if s.id in todo_watch:
                first[s.id] = t
                todo_watch.discard(s.id)
            s.remaining -= 1
            if s.remaining > 0:
                s.todo = 1
                decoding[s.tenant in yields].add(s)
            else:
                held[s.tenant] -= 1
        if done:
            prefill = [s for s in prefill if s not in done]
            later = [s for s in later if s not in done]
        k += 1
    return Playout(first, frozenset(late), step0, t, k)


NEW_ID = "\0new"  # the id a request being checked takes in the playout


def predict_first_token_s(snap: QueueSnapshot, cost: StepCost, prompt_tokens: int, now: float | None = None,
                          tenant: str | None = None, share: float = 1.0, arrivals: Sequence[Queued] = (),
                          extra_s: float = 0.0, horizon_s: float = 3600.0) -> float:
    """Seconds from `now` until a request with this prompt, arriving now, gets its first token; `arrivals`
    are requests accepted since the snapshot (they arrived earlier, in this order). extra_s adds what must
    happen first (e.g. loading its adapter). At most the horizon (a lower bound when it is reached)."""
    new = Queued(NEW_ID, tenant, share, 0, max(1, prompt_tokens), 1)
    arrivals = tuple(arrivals) + (new,)
    plan = snap.view.plan(arrivals)
    out = play_out(plan, cost, snap.max_num_batched_tokens, snap.max_num_seqs, (NEW_ID,),
                   joins_at={a.id: 1 for a in arrivals}, horizon_s=horizon_s)
    elapsed = 0.0 if now is None else max(0.0, now - snap.taken_at)
    rest_of_step0 = max(0.0, out.step0_s - elapsed)
    at = out.first_token_s.get(NEW_ID, max(out.end_s, horizon_s))
    return rest_of_step0 + (at - out.step0_s) + extra_s
