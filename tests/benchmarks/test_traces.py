"""The trace generator (benchmarks/traces.py): seeded, saved and loaded losslessly, shaped as specified."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import traces as T  # noqa: E402

SPEC = T.TraceSpec(rate=20.0, duration_s=100.0, seed=3)


def test_same_seed_same_trace_and_jsonl_round_trip(tmp_path):
    trace = T.generate(SPEC)
    assert trace == T.generate(SPEC)
    assert trace != T.generate(dataclasses.replace(SPEC, seed=4))
    path = tmp_path / "t.jsonl"
    T.save_jsonl(trace, path)
    assert T.load_jsonl(path) == trace
    assert len(path.read_text().splitlines()) == len(trace)
    assert all(isinstance(r, T.TraceRequest) for r in trace)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    assert len({r.id for r in trace}) == len(trace)


def test_shape_of_a_chat_trace():
    trace = T.generate(SPEC)
    assert abs(len(trace) / (SPEC.rate * SPEC.duration_s) - 1) < 0.1
    p = np.array([r.prompt_tokens for r in trace])
    o = np.array([r.output_tokens for r in trace])
    assert p.min() >= SPEC.prompt_min and p.max() <= SPEC.prompt_max
    assert o.min() >= SPEC.output_min and o.max() <= SPEC.output_max
    assert p.mean() > np.median(p) * 1.3  # a heavy right tail
    counts = np.bincount([int(r.adapter.split("-")[1]) for r in trace], minlength=SPEC.num_adapters)
    assert counts[0] == counts.max() and counts[0] > 5 * np.median(counts)  # power law: adapter 0 most popular
    ranks = {r.adapter: r.rank for r in trace}
    assert set(ranks.values()) <= set(SPEC.ranks) and len(set(ranks.values())) > 1
    targets = {t.name: t.ttft_target_ms for t in SPEC.tenants}
    assert all(r.ttft_target_ms == targets[r.tenant] for r in trace)


def test_uniform_lengths_gamma_burstiness_and_no_adapters():
    spec = dataclasses.replace(SPEC, lengths="uniform", arrivals="gamma", cv=3.0, num_adapters=0, duration_s=400)
    trace = T.generate(spec)
    assert all(8 <= r.prompt_tokens <= 512 and 8 <= r.output_tokens <= 512 for r in trace)
    assert all(r.adapter is None and r.rank == 0 for r in trace)
    # One tenant's own stream has gaps with the requested CV (merging tenants smooths it).
    gaps = np.diff([r.arrival_s for r in trace if r.tenant == "standard"])
    assert 2.0 < gaps.std() / gaps.mean() < 4.0
    poisson = np.diff([r.arrival_s for r in T.generate(dataclasses.replace(SPEC, duration_s=400))
                       if r.tenant == "standard"])
    assert 0.85 < poisson.std() / poisson.mean() < 1.15


def test_a_flood_changes_only_the_flooding_tenant():
    base = T.generate(SPEC)
    flood = T.generate(SPEC.with_load("batch", 10.0))

    def strip(trace, tenant):  # ids are positions in the merged trace: compare everything else
        return [dataclasses.replace(r, id="") for r in trace if r.tenant == tenant]

    for tenant in ("interactive", "standard"):
        assert strip(base, tenant) == strip(flood, tenant)
    ratio = len(strip(flood, "batch")) / len(strip(base, "batch"))
    assert 8 < ratio < 12
    with pytest.raises(ValueError):
        SPEC.with_load("nobody", 2.0)


def test_offline_puts_every_arrival_at_zero():
    assert {r.arrival_s for r in T.offline(T.generate(SPEC))} == {0.0}
