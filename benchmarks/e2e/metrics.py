"""Metrics of one run, and how far two systems' greedy outputs agree."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from .systems import RunResult


@dataclass(frozen=True)
class Metrics:
    requests: int
    output_tokens: int  # tokens credited to requests (each request's own output_tokens)
    wall_s: float
    throughput_rps: float
    throughput_tok_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p99_s: float  # inter-token latency: gaps between a request's consecutive tokens, pooled
    slo_ttft_s: float | None  # the TTFT target attainment is measured against (None: each request's own)
    slo_attainment: float  # share of requests whose first token came within the target

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(run: RunResult, ttft_target_s: float | None = None,
              own_targets: Sequence[float] | None = None) -> Metrics:
    """Throughput over the run's wall time; TTFT and inter-token percentiles over its requests.
    SLO attainment is against `ttft_target_s` if given, else each request's own target (`own_targets`)."""
    recs = run.records
    missing = [r.id for r in recs if len(r.token_times) != r.output_tokens]
    if missing:
        raise ValueError(f"{run.system}: {len(missing)} requests lack tokens (first: {missing[:3]})")
    ttft = np.array([r.token_times[0] - r.arrival_s for r in recs])
    gaps = np.concatenate([np.diff(r.token_times) for r in recs] + [np.zeros(0)])
    targets = (np.full(len(recs), ttft_target_s) if ttft_target_s is not None
               else np.array(own_targets if own_targets is not None else [np.inf] * len(recs)))
    tokens = sum(r.output_tokens for r in recs)
    wall = max(run.wall_s, 1e-9)
    return Metrics(
        requests=len(recs), output_tokens=tokens, wall_s=run.wall_s,
        throughput_rps=len(recs) / wall, throughput_tok_s=tokens / wall,
        ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p99_s=float(np.percentile(ttft, 99)),
        itl_p99_s=float(np.percentile(gaps, 99)) if gaps.size else 0.0,
        slo_ttft_s=ttft_target_s, slo_attainment=float(np.mean(ttft <= targets)),
    )


@dataclass(frozen=True)
class OutputMatch:
    """Greedy agreement of two systems over a sample of requests, compared on a prefix of each output.

    fp32 rounding differs between ragged and padded batches, so a near-tie can flip after some tokens and
    the continuations then differ legitimately: the share of whole prefixes that match and the mean share
    of leading tokens that agree are reported, not asserted equal."""

    a: str
    b: str
    sampled: int
    prefix_tokens: int
    exact_prefix_share: float  # requests whose first `prefix_tokens` tokens are identical
    leading_agreement: float  # mean over requests of (tokens before the first difference) / prefix length

    def as_dict(self) -> dict:
        return asdict(self)


def compare_outputs(a: RunResult, b: RunResult, sample: int = 16, prefix_tokens: int = 16) -> OutputMatch:
    by_id = {r.id: r for r in b.records}
    picked = a.records[:: max(1, len(a.records) // sample)][:sample]
    exact, lead = 0, 0.0
    for ra in picked:
        rb = by_id[ra.id]
        n = min(prefix_tokens, len(ra.token_ids), len(rb.token_ids))
        if n == 0:
            raise ValueError(f"request {ra.id} has no tokens in {a.system} or {b.system}")
        x, y = ra.token_ids[:n], rb.token_ids[:n]
        first_diff = next((k for k in range(n) if x[k] != y[k]), n)
        exact += first_diff == n
        lead += first_diff / n
    return OutputMatch(a.system, b.system, len(picked), prefix_tokens, exact / len(picked), lead / len(picked))
