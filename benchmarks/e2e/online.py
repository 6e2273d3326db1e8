"""Online mode: the trace's arrival times replayed on the wall clock; latency and SLO attainment."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from .metrics import summarize
from .offline import ModeResult, Systems, check_outputs, serve_all
from .workload import BenchRequest


def at_rate(requests: Sequence[BenchRequest], rate_rps: float) -> list[BenchRequest]:
    """The same arrival process time-scaled to `rate_rps` (the trace's burstiness is kept)."""
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    t_first = min(r.arrival_s for r in requests)
    if span <= 0:
        return list(requests)
    scale = (len(requests) - 1) / rate_rps / span
    return [replace(r, arrival_s=(r.arrival_s - t_first) * scale) for r in requests]


def run_online(systems: Systems, requests: Sequence[BenchRequest], rate_rps: float, ttft_target_s: float,
               base_choice: str, sample: int = 16, prefix_tokens: int = 16, log=print) -> ModeResult:
    """Every system on the same arrivals at `rate_rps`; (c) is the candidate chosen offline."""
    reqs = at_rate(requests, rate_rps)
    chosen = [c for c in systems.base_candidates if c.name == base_choice]
    runs = serve_all(systems, reqs, chosen, log)
    metrics = {name: summarize(run, ttft_target_s) for name, run in runs.items()}
    return ModeResult("online", runs, metrics, check_outputs(systems, runs, [base_choice], sample, prefix_tokens),
                      base_choice)
