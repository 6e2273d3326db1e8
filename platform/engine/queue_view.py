"""A frozen picture of the scheduler's queues, taken by the queue policy on the engine thread, and the order in
which the scheduler would serve them: what the SLO controller predicts first-token times from (on any thread,
without touching the live lists or the policy's live counters).

    view = scheduler.view()                    # engine thread, after a step
    plan = view.plan(arrivals=(new,))          # any thread: where requests arriving now would go
    plan.first, plan.waiting, plan.later       # the scheduler's order: running, waiting (policy order),
                                               # running prompt chunks it serves after the waiting ones

FCFS and LIFO serve running requests first in start order, then waiting ones oldest-first (FCFS: an arrival
goes last) or newest-first (LIFO: an arrival goes first). VTC orders the waiting queue by virtual token counter
(queue_policy.Vtc), serves the running requests of the least-served tenants first, defers the prompt chunks
of running requests of tenants that are ahead of a waiting tenant until the waiting ones are placed, and lets a
waiting request take a sequence slot from a tenant ahead of it. The functions that decide the VTC order are
shared by the live policy and its view (vtc_merge, vtc_split, vtc_ahead).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Queued:
    """One request as the view sees it."""

    id: str
    tenant: str | None
    share: float
    context: int  # tokens whose KV it holds now (0 while waiting: a preempted request recomputes)
    todo: int  # tokens to compute before its next token is sampled: its prompt (or the rest of it), 1 decoding
    remaining: int  # output tokens it may still generate
    deadline: float | None = None  # first-token deadline (time.monotonic()); None: none, or it has its token

    @property
    def prefilling(self) -> bool:
        return self.todo > 1


@dataclass(frozen=True)
class StepPlan:
    """The order in which the scheduler serves requests in a step: `first` (running) takes budget first, then
    `waiting` are admitted in this order while budget and sequence slots last, then `later` (running prompt
    chunks deferred behind the waiting ones). Under VTC also: `preempts`, ids of waiting requests that, when no
    sequence slot is free, take one by preempting a running request of a tenant ahead of theirs; `yields`,
    tenants whose requests (prompt chunks and decodes) wait in any step where a tenant not in `yields` has a
    prompt chunk; `seq_caps`, tenant -> (its share, the active tenants' shares), from which vtc_seq_cap gives
    the most running sequences it may hold and still start a waiting request."""

    first: tuple[Queued, ...]
    waiting: tuple[Queued, ...]
    later: tuple[Queued, ...] = ()
    preempts: frozenset = frozenset()
    yields: frozenset = frozenset()
    seq_caps: Mapping = field(default_factory=dict)


class QueueView(Protocol):
    running: tuple[Queued, ...]  # in start order
    waiting: tuple[Queued, ...]  # in queue (arrival) order

    def plan(self, arrivals: Sequence[Queued] = ()) -> StepPlan:
        """The serving order, with `arrivals` (in arrival order) added to the waiting queue now."""
        ...


@dataclass(frozen=True)
class OrderedView:
    """FCFS (oldest waiting first) or LIFO (newest first)."""

    running: tuple[Queued, ...]
    waiting: tuple[Queued, ...]
    newest_first: bool = False

    def plan(self, arrivals: Sequence[Queued] = ()) -> StepPlan:
        queue = self.waiting + tuple(arrivals)
        return StepPlan(self.running, tuple(reversed(queue)) if self.newest_first else queue)


# -- VTC -----------------------------------------------------------------------------------------------


def vtc_merge(items: Iterable[T], tenant: Callable[[T], object], counters: Mapping,
              charge: Callable[[T], float]) -> Iterator[T]:
    """Items (in arrival order) by virtual counter: the head of the tenant with the smallest counter first,
    each pick provisionally charging charge(item) to its tenant; ties go to the tenant seen first."""
    queues: dict = {}
    for item in items:  # per tenant, in arrival order
        queues.setdefault(tenant(item), []).append(item)
    heap = [(counters.get(t, 0.0), i, t) for i, t in enumerate(queues)]
    heapq.heapify(heap)
    heads = {t: 0 for t in queues}
    while heap:
        counter, i, t = heapq.heappop(heap)
        item = queues[t][heads[t]]
        heads[t] += 1
        yield item
        if heads[t] < len(queues[t]):
            heapq.heappush(heap, (counter + charge(item), i, t))


def vtc_ahead(recent: Mapping, backlogged: Collection, tenant, other, margin: float) -> bool:
    """Whether `tenant` is over-served next to `other` (recent_service.py): it has requests waiting (it asks
    for more than it gets) and its recent service exceeds the other's by more than the margin. Tenants within
    the margin of each other count as even: neither defers, holds back nor preempts the other's requests."""
    return tenant in backlogged and recent.get(tenant, 0.0) - recent.get(other, 0.0) > margin


def vtc_split(running: Sequence[T], waiting_tenants: Collection, counters: Mapping, recent: Mapping,
              tenant: Callable[[T], object], prefilling: Callable[[T], bool],
              margin: float) -> tuple[list[T], list[T]]:
    """Running requests in VTC's serving order: least-served tenants first (start order within a tenant and
    among equals); the prompt chunks of a tenant ahead of a waiting tenant (vtc_ahead) are split off to go
    after the waiting requests are placed."""
    floor = min(waiting_tenants, key=lambda t: recent.get(t, 0.0), default=None)
    first, later = [], []
    for r in sorted(running, key=lambda r: counters.get(tenant(r), 0.0)):  # stable: start order among equals
        defer = (floor is not None and prefilling(r)
                 and vtc_ahead(recent, waiting_tenants, tenant(r), floor, margin))
        (later if defer else first).append(r)
    return first, later


def vtc_seq_cap(max_num_seqs: int, share: float, active_shares: float) -> int:
    return max(1, int(max_num_seqs * share / max(share, active_shares)))


@dataclass(frozen=True)
class VtcView:
    running: tuple[Queued, ...]
    waiting: tuple[Queued, ...]
    counters: Mapping  # tenant -> virtual counter (a copy)
    active: frozenset  # tenants with requests waiting or running
    input_weight: float
    recent: Mapping  # tenant -> recent service (a copy; recent_service.py)
    margin: float  # how far ahead in recent service counts as ahead (RecentService.margin)

    def counter_on_arrival(self, tenant) -> float:
        """A tenant that becomes active is lifted to the smallest counter of the active ones (Vtc.on_add)."""
        own = self.counters.get(tenant, 0.0)
        if tenant in self.active:
            return own
        others = [self.counters.get(t, 0.0) for t in self.active if t != tenant]
        return max(own, min(others)) if others else own

    def plan(self, arrivals: Sequence[Queued] = ()) -> StepPlan:
        counters = dict(self.counters)
        for q in arrivals:
            if q.tenant not in self.active:
                counters[q.tenant] = self.counter_on_arrival(q.tenant)
        queue = self.waiting + tuple(arrivals)
        order = tuple(vtc_merge(queue, lambda q: q.tenant, counters,
                                lambda q: self.input_weight * q.todo / q.share))
        backlogged = {q.tenant for q in queue}
        recent = self.recent
        first, later = vtc_split(self.running, backlogged, counters, recent, lambda q: q.tenant,
                                 lambda q: q.prefilling, self.margin)
        running_tenants = {q.tenant for q in self.running}
        preempts = frozenset(q.id for q in queue
                             if any(vtc_ahead(recent, backlogged, t, q.tenant, self.margin)
                                    for t in running_tenants))
        # Prompts of tenants ahead of the least-served tenant with a prompt to compute yield to it (Vtc.holds).
        prompts = [q for q in self.running + queue if q.prefilling]
        floor = min((q.tenant for q in prompts), key=lambda t: recent.get(t, 0.0), default=None)
        yields = frozenset(t for t in {q.tenant for q in self.running + queue}
                           if vtc_ahead(recent, backlogged, t, floor, self.margin))
        shares = {q.tenant: q.share for q in self.running + queue}  # the active tenants (Vtc.seq_cap)
        total = sum(shares.values())
        seq_caps = {t: (share, total) for t, share in shares.items()
                    if any(vtc_ahead(recent, backlogged, t, u, self.margin) for u in shares)}
        return StepPlan(tuple(first), order, tuple(later), preempts, yields, seq_caps)
