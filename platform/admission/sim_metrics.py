"""SLO metrics of a set of request outcomes (from the simulation, or a real run recorded the same way).

- attainment: share of ALL arrivals (refused and aborted included) whose first token came within target;
- goodput: requests within target per second; throughput: requests served (and output tokens) per second;
  both over the run's span, from the first arrival to the last finish (a backlog drained after the
  arrivals stop counts: FCFS under overload serves everything, late);
- TTFT mean, p50 and p99 over the requests that got a first token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .simulate import ABORTED, OK, REFUSED, SimOutcome


@dataclass(frozen=True)
class SloMetrics:
    arrivals: int
    served: int
    refused: int
    aborted: int
    attained: int
    attainment: float
    goodput_rps: float
    throughput_rps: float
    output_tokens_per_s: float
    mean_ttft_s: float | None
    p50_ttft_s: float | None
    p99_ttft_s: float | None
    span_s: float

    def as_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def summarize(outcomes: Sequence[SimOutcome], span_s: float | None = None) -> SloMetrics:
    """Metrics of these outcomes; span_s overrides the measured span (e.g. to rate one tenant's requests
    over the whole run's span)."""
    n = len(outcomes)
    if span_s is None:
        span_s = run_span(outcomes)
    ttfts = np.array([o.ttft_s for o in outcomes if o.ttft_s is not None], dtype=np.float64)
    served = [o for o in outcomes if o.status == OK]
    attained = sum(o.attained for o in outcomes)
    per_s = (lambda x: x / span_s) if span_s > 0 else (lambda x: 0.0)
    return SloMetrics(
        arrivals=n,
        served=len(served),
        refused=sum(o.status == REFUSED for o in outcomes),
        aborted=sum(o.status == ABORTED for o in outcomes),
        attained=attained,
        attainment=attained / n if n else 0.0,
        goodput_rps=per_s(attained),
        throughput_rps=per_s(len(served)),
        output_tokens_per_s=per_s(sum(o.output_tokens for o in served)),
        mean_ttft_s=float(ttfts.mean()) if len(ttfts) else None,
        p50_ttft_s=float(np.percentile(ttfts, 50)) if len(ttfts) else None,
        p99_ttft_s=float(np.percentile(ttfts, 99)) if len(ttfts) else None,
        span_s=span_s,
    )


def run_span(outcomes: Sequence[SimOutcome]) -> float:
    if not outcomes:
        return 0.0
    start = min(o.arrival_s for o in outcomes)
    end = max(o.finish_s if o.finish_s is not None else o.arrival_s for o in outcomes)
    return end - start


def by_tenant(outcomes: Sequence[SimOutcome]) -> dict[str, SloMetrics]:
    """Per-tenant metrics, rates over the whole run's span."""
    span = run_span(outcomes)
    tenants = sorted({o.tenant for o in outcomes})
    return {t: summarize([o for o in outcomes if o.tenant == t], span) for t in tenants}
