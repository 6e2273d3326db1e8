"""Prometheus metrics, in a registry of the app's own (no process-wide globals).

Per-request series are labelled by tenant and adapter name; label cardinality is capped: after
`max_series` distinct (tenant, adapter) pairs, new pairs are counted under adapter="__other__" (and a
new tenant under tenant="__other__"), so thousands of adapters cannot blow up the scrape.
Gauges (queue depth, pool pages, host cache, metering) are read from snapshots at scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

OTHER = "__other__"
# Seconds; CPU serving of small models sits at the low end, large batches and long prompts at the top.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class LabelCap:
    """Maps (tenant, adapter) to itself while under the cap, else to a folded pair."""

    def __init__(self, max_series: int):
        self.max_series = max_series
        self._pairs: set[tuple[str, str]] = set()
        self._tenants: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, tenant: str, adapter: str) -> tuple[str, str]:
        pair = (tenant, adapter)
        with self._lock:
            if pair in self._pairs:
                return pair
            if len(self._pairs) < self.max_series:
                self._pairs.add(pair)
                self._tenants.add(tenant)
                return pair
            return (tenant if tenant in self._tenants else OTHER, OTHER)


class ApiMetrics:
    def __init__(self, max_series: int):
        self.registry = CollectorRegistry(auto_describe=True)
        self.cap = LabelCap(max_series)
        labels = ("tenant", "adapter")
        r = self.registry
        self.requests = Counter("loraplex_requests", "Inference requests by outcome", labels + ("status",),
                                registry=r)
        self.prompt_tokens = Counter("loraplex_prompt_tokens", "Prompt tokens of finished requests", labels,
                                     registry=r)
        self.completion_tokens = Counter("loraplex_completion_tokens", "Generated tokens", labels, registry=r)
        self.ttft = Histogram("loraplex_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("loraplex_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("loraplex_inter_token_latency_seconds", "Time between streamed tokens", labels,
                             buckets=_ITL_BUCKETS, registry=r)

    def observe(self, tenant: str, adapter: str, status: str, prompt_tokens: int, completion_tokens: int,
                ttft_s: float | None, e2e_s: float | None, itl_s: Sequence[float]) -> None:
        t, a = self.cap(tenant, adapter)
        self.requests.labels(t, a, status).inc()
        self.prompt_tokens.labels(t, a).inc(prompt_tokens)
        self.completion_tokens.labels(t, a).inc(completion_tokens)
        if ttft_s is not None:
            self.ttft.labels(t, a).observe(ttft_s)
        if e2e_s is not None:
            self.e2e.labels(t, a).observe(e2e_s)
        hist = self.itl.labels(t, a)
        for gap in itl_s:
            hist.observe(gap)

    def add_snapshot(self, read: Callable[[], Iterable]) -> None:
        """Register a function giving gauge/counter families at scrape time."""
        self.registry.register(_SnapshotCollector(read))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector(Collector):
    def __init__(self, read: Callable[[], Iterable]):
        self._read = read

    def collect(self):
        yield from self._read()

    def describe(self):
        return []  # families vary with what is loaded; scrape-time only


def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=list(labels) if labels else None)
    fam.add_metric(list(labels.values()) if labels else [], value)
    return fam


def gauge_by(name: str, doc: str, label: str, values: dict[str, float]) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=[label])
    for k, v in values.items():
        fam.add_metric([k], v)
    return fam


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
