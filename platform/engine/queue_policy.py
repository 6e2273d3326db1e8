"""In which order the scheduler considers waiting requests: FCFS, LIFO, or fair across tenants (VTC).

VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): every tenant has a virtual
token counter that grows with the service it receives, here input tokens + 2 x output tokens divided by
the tenant's share; the waiting request of the tenant with the smallest counter goes first. A tenant
that becomes active again (nothing waiting or running) is lifted to the smallest counter among the
active tenants, so that idling does not bank credit to flood the others later.

Counters grow when tokens are computed (prompt chunks) and generated, as the engine reports them; while
one scheduling pass admits several requests, each admission provisionally charges its prompt so that one
tenant with the lowest counter cannot take the whole batch in a single pass.

Ordering the waiting queue is not enough to keep a flood from slowing the other tenants' first tokens: the
flood still fills the running batch, the pages and every step's budget. So VTC also decides, beyond the
waiting queue's order, what the scheduler does with running requests (FCFS and LIFO keep vLLM's rules):
- split_running: running requests of the least-served tenants are served first, and the prompt chunks of
  tenants ahead of a waiting tenant go after the waiting requests are placed (a flood's long prompts do not
  hold the step's budget while a light tenant waits);
- make_room: a waiting request that finds no sequence slot or no pages preempts the newest running request
  of a tenant ahead of it (vLLM V0's priority preemption, with VTC's fairness as the priority);
- holds: a step that carries a prompt chunk of a tenant carries nothing of the tenants ahead of it (neither
  prompt chunks nor decodes: they wait a step), so that its first token is not slowed by them;
- seq_cap: a tenant ahead of another active tenant starts no request while it holds its share of the
  sequence slots (fewer of its sequences make every step shorter, the one in progress when a request comes
  too);
- victim: when pages run out for a running request, the request preempted is the newest of a tenant ahead of
  the others, not the newest of all (the light request admitted last is not the one that pays for the
  flood's pages); with no tenant ahead, the newest (vLLM's rule). "Ahead" (queue_view.vtc_ahead) is about recent service, not the
lifetime counters (recent_service.py): the tenant has requests waiting and has lately taken clearly more of the
engine than the other. Lifetime counters of two tenants that are always active are never re-levelled (VTC
lifts only a returning tenant): a gap from a burst long ago would hold back the same tenant for ever.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Protocol

from loraplex.errors import ConfigError

from .queue_view import (OrderedView, Queued, QueueView, VtcView, vtc_ahead, vtc_merge, vtc_seq_cap,
                         vtc_split)
from .recent_service import RecentService
from .request import Request

QUEUE_POLICIES = ("fcfs", "lifo", "vtc")
INPUT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class QueuePolicy(Protocol):
    def on_add(self, req: Request) -> None: ...

    def on_finish(self, req: Request) -> None: ...

    def on_tokens(self, req: Request, prompt_tokens: int, output_tokens: int) -> None: ...

    def order(self, waiting: Sequence[Request]) -> Iterable[Request]: ...

    def split_running(self, running: Sequence[Request],
                      waiting: Sequence[Request]) -> tuple[Sequence[Request], Sequence[Request]]:
        """Running requests to serve before the waiting ones (in this order), and those whose prompt chunks
        go after them."""
        ...

    def victim(self, running: Sequence[Request]) -> Request:
        """The running request to preempt when pages run out."""
        ...

    def make_room(self, req: Request, running: Sequence[Request]) -> Request | None:
        """A running request to preempt so that the waiting `req` can be admitted when no sequence slot or no
        pages are left; None: req waits."""
        ...

    def holds(self, req: Request, prompt_tenants: Collection) -> bool:
        """Whether req (a prompt chunk or a decode) waits this step because these tenants have prompt chunks
        in it."""
        ...

    def seq_cap(self, req: Request, max_num_seqs: int) -> int | None:
        """The most running sequences req's tenant may hold for req to be admitted; None: no cap."""
        ...


    def view(self, running: Sequence[Request], waiting: Sequence[Request]) -> QueueView:
        """A frozen picture of the queues and of this policy's order (engine thread)."""
        ...


def queued(req: Request) -> Queued:
    done = req.first_token_time is not None
    return Queued(req.request_id, req.tenant, req.share, req.num_computed_tokens,
                  max(1, req.num_tokens - req.num_computed_tokens),
                  max(0, req.params.max_tokens - len(req.output_token_ids)), None if done else req.ttft_deadline)


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

    def split_running(self, running, waiting):
        """vLLM's rule: every running request first, in the order they started."""
        return list(running), []

    def victim(self, running: Sequence[Request]) -> Request:
        """vLLM's rule: the newest."""
        return running[-1]

    def make_room(self, req: Request, running: Sequence[Request]) -> Request | None:
        """vLLM's rule: a waiting request never preempts a running one."""
        return None

    def holds(self, req: Request, prompt_tenants: Collection) -> bool:
        return False

    def seq_cap(self, req: Request, max_num_seqs: int) -> int | None:
        return None

    def view(self, running: Sequence[Request], waiting: Sequence[Request]) -> QueueView:
        return OrderedView(tuple(map(queued, running)), tuple(map(queued, waiting)), newest_first=False)


class Lifo(Fcfs):
    """Newest first: a baseline for overload studies (it serves fresh requests that can still meet a
    latency target, at the price of starving old ones)."""

    def order(self, waiting: Sequence[Request]) -> Iterable[Request]:
        return list(reversed(waiting))

    def view(self, running: Sequence[Request], waiting: Sequence[Request]) -> QueueView:
        return OrderedView(tuple(map(queued, running)), tuple(map(queued, waiting)), newest_first=True)


class Vtc:
    def __init__(self, input_weight: float = INPUT_WEIGHT, output_weight: float = OUTPUT_WEIGHT,
                 recent: RecentService | None = None):
        self.input_weight = input_weight
        self.output_weight = output_weight
        self.recent = recent if recent is not None else RecentService()
        self._backlogged: frozenset = frozenset()  # tenants with requests waiting when the step was planned
        self.counters: dict[str | None, float] = {}
        self._active: dict[str | None, int] = {}  # tenant -> requests waiting or running
        self._shares: dict[str | None, float] = {}  # tenant -> its share (as its last request gave it)

    def on_add(self, req: Request) -> None:
        t = req.tenant
        if not self._active.get(t):
            active = [self.counters[u] for u, n in self._active.items() if n and u != t]
            floor = min(active) if active else self.counters.get(t, 0.0)
            self.counters[t] = max(self.counters.get(t, 0.0), floor)
        self._active[t] = self._active.get(t, 0) + 1
        self._shares[t] = req.share

    def on_finish(self, req: Request) -> None:
        n = self._active.get(req.tenant, 0) - 1
        if n > 0:
            self._active[req.tenant] = n
        else:
            self._active.pop(req.tenant, None)

    def on_tokens(self, req: Request, prompt_tokens: int, output_tokens: int) -> None:
        cost = self.input_weight * prompt_tokens + self.output_weight * output_tokens
        self.counters[req.tenant] = self.counters.get(req.tenant, 0.0) + cost / req.share
        self.recent.add(req.tenant, cost, req.share)

    def order(self, waiting: Sequence[Request]) -> Iterable[Request]:
        """Lowest counter first; each pick provisionally charges its remaining prompt to its tenant."""
        return vtc_merge(waiting, lambda r: r.tenant, self.counters,
                         lambda r: self.input_weight * (r.num_tokens - r.num_computed_tokens) / r.share)

    def split_running(self, running, waiting):
        """Called as the scheduler starts planning a step: also notes which tenants have requests waiting."""
        self._backlogged = frozenset(r.tenant for r in waiting)
        recent = self.recent.snapshot()
        return vtc_split(running, self._backlogged, self.counters, recent, lambda r: r.tenant,
                         lambda r: r.num_tokens - r.num_computed_tokens > 1, self.recent.margin(recent))

    def victim(self, running: Sequence[Request]) -> Request:
        """The newest running request of a tenant ahead of another running tenant (the most served lately of
        them); the newest of all (vLLM's rule) when no tenant is ahead."""
        ahead = self._ahead_of(running, {r.tenant for r in running})
        return next((r for r in reversed(running) if r.tenant in ahead), running[-1])

    def make_room(self, req: Request, running: Sequence[Request]) -> Request | None:
        """The newest running request of a tenant ahead of req's tenant."""
        ahead = self._ahead_of(running, (req.tenant,))
        return next((r for r in reversed(running) if r.tenant in ahead), None)

    def holds(self, req: Request, prompt_tenants: Collection) -> bool:
        """A tenant ahead (by more than the margin) of a tenant whose prompt is in this step adds nothing to the
        step, neither prompt tokens nor decodes: they would make the step, and so the other's first token,
        slower. It goes on in the next step without such a prompt."""
        return bool(prompt_tenants) and req.tenant in self._ahead_of((req,), prompt_tenants)

    def seq_cap(self, req: Request, max_num_seqs: int) -> int | None:
        """A tenant ahead of another active tenant holds at most its share of the sequence slots (its share /
        the active tenants' shares) before it may start another request: fewer of its sequences in every step
        make the steps, and so the others' first tokens, shorter."""
        active = {t: self._shares.get(t, 1.0) for t, n in self._active.items() if n}
        if req.tenant not in self._ahead_of((req,), active):
            return None
        return vtc_seq_cap(max_num_seqs, active.get(req.tenant, req.share), sum(active.values()))

    def view(self, running: Sequence[Request], waiting: Sequence[Request]) -> QueueView:
        recent = self.recent.snapshot()
        return VtcView(tuple(map(queued, running)), tuple(map(queued, waiting)), dict(self.counters),
                       frozenset(t for t, n in self._active.items() if n), self.input_weight, recent,
                       self.recent.margin(recent))

    def _ahead_of(self, reqs: Iterable[Request], others: Iterable) -> set:
        """The tenants of these requests that are ahead of one of the `others` tenants (queue_view.vtc_ahead)."""
        recent = self.recent.snapshot()
        margin = self.recent.margin(recent)
        others = set(others)
        return {t for t in {r.tenant for r in reqs}
                if any(vtc_ahead(recent, self._backlogged, t, u, margin) for u in others)}


def make_queue_policy(name: str) -> QueuePolicy:
    if name == "fcfs":
        return Fcfs()
    if name == "lifo":
        return Lifo()
    if name == "vtc":
        return Vtc()
    raise ConfigError(f"queue policy {name!r} is not one of {', '.join(QUEUE_POLICIES)}")
