"""In which order the scheduler considers waiting requests: FCFS, LIFO, or fair across tenants (VTC).

VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): every tenant has a virtual
token counter that grows with the service it receives, here input tokens + 2 x output tokens divided by
the tenant's share; the waiting request of the tenant with the smallest counter goes first. A tenant
that becomes active again (nothing waiting or running) is lifted to the smallest counter among the
active tenants, so that idling does not bank credit to flood the others later.

Counters grow when tokens are computed (prompt chunks) and generated, as the engine reports them; while
one scheduling pass admits several requests, each admission provisionally charges its prompt so that one
tenant with the lowest counter cannot take the whole batch in a single pass.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Protocol

from loraplex.errors import ConfigError

from .request import Request

QUEUE_POLICIES = ("fcfs", "lifo", "vtc")
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class QueuePolicy(Protocol):
    def on_add(self, req: Request) -> None: ...

    def on_finish(self, req: Request) -> None: ...

    def on_tokens(self, req: Request, prompt_tokens: int, output_tokens: int) -> None: ...

    def order(self, waiting: Sequence[Request]) -> Iterable[Request]: ...


class Fcfs:
    """Arrival order (a preempted request goes back to the head: it arrived earlier)."""

    def on_add(self, req: Request) -> None:
        pass

    def on_finish(self, req: Request) -> None:
        pass

    def on_tokens(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        pass

    def order(self, waiting: Sequence[Request]) -> Iterable[Request]:
        return list(waiting)


class Lifo(Fcfs):
    """Newest first: a baseline for overload studies (it serves fresh requests that can still meet a
    latency target, at the price of starving old ones)."""

    def order(self, waiting: Sequence[Request]) -> Iterable[Request]:
        return list(reversed(waiting))


class Vtc:
    def __init__(self, input_weight: float = INPUT_WEIGHT, output_weight: float = OUTPUT_WEIGHT):
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.counters: dict[str | None, float] = {}
        self._active: dict[str | None, int] = {}  # tenant -> requests waiting or running

    def on_add(self, req: Request) -> None:
        t = req.tenant
        if not self._active.get(t):
            active = [self.counters[u] for u, n in self._active.items() if n and u != t]
            floor = min(active) if active else self.counters.get(t, 0.0)
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
        self._active[t] = self._active.get(t, 0) + 1

    def on_finish(self, req: Request) -> None:
        n = self._active.get(req.tenant, 0) - 1
        if n > 0:
            self._active[req.tenant] = n
        else:
            self._active.pop(req.tenant, None)

    def on_tokens(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        cost = self.input_weight * prompt_tokens + self.output_weight * output_tokens
        self.counters[req.tenant] = self.counters.get(req.tenant, 0.0) + cost / req.share

    def order(self, waiting: Sequence[Request]) -> Iterable[Request]:
        """Lowest counter first; each pick provisionally charges its remaining prompt to its tenant."""
        queues: dict[str | None, list[Request]] = {}
        for req in waiting:  # per tenant, in arrival order
            queues.setdefault(req.tenant, []).append(req)
        heap = [(self.counters.get(t, 0.0), i, t) for i, t in enumerate(queues)]
        heapq.heapify(heap)
        heads = {t: 0 for t in queues}
        while heap:
            counter, i, t = heapq.heappop(heap)
            req = queues[t][heads[t]]
            heads[t] += 1
            yield req
            if heads[t] < len(queues[t]):
                charge = self.input_weight * (req.num_tokens - req.num_computed_tokens) / req.share
                heapq.heappush(heap, (counter + charge, i, t))


def make_queue_policy(name: str) -> QueuePolicy:
    if name == "fcfs":
        return Fcfs()
    if name == "lifo":
        return Lifo()
    if name == "vtc":
        return Vtc()
    raise ConfigError(f"queue policy {name!r} is not one of {', '.join(QUEUE_POLICIES)}")
