"""Usage events through the API: every request leaves one; /v1/usage and /v1/latency agree with the raw
events; /metrics exposes per-tenant series and the engine's gauges."""

from __future__ import annotations

import csv
import io
import math

import pytest
from sqlalchemy import text

from api_server import make_tenant, upload


def _exact_percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]  # nearest rank


@pytest.fixture(scope="module")
def traffic(live, adapter_dirs):
    tenant_id, key = make_tenant(live, "metered")
    assert upload(live, key, "m-ad", adapter_dirs["a8"]).status_code == 201
    with live.client(key) as c:
        for i in range(6):
            body = {"prompt": [4 + i, 8, 15], "max_tokens": 3 + i, "temperature": 0}
            if i % 2:
                body["adapter_id"] = "m-ad"
            if i == 5:
                body["stream"] = True
            assert c.post("/v1/completions", json=body).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "adapter_id": "missing"}).status_code == 404
        assert c.post("/v1/completions", json={"prompt": "x", "n": 3}).status_code == 400
        assert c.post("/v1/completions", json={"prompt": "x", "temperature": 9}).status_code == 400  # schema
    assert live.state.recorder.flush(30)
    return tenant_id, key


def _raw(live, tenant_id: str) -> list[dict]:
    with live.state.registry.engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(
            text("SELECT status, adapter_id, prompt_tokens, completion_tokens, ttft_ms, e2e_ms FROM usage_events "
                 "WHERE tenant_id = :t"), {"t": tenant_id})]


def test_every_request_leaves_one_event(live, traffic):
    tenant_id, _ = traffic
    raw = _raw(live, tenant_id)
    statuses = sorted(r["status"] for r in raw)
    # Refused: the unknown adapter, n=3, and a body that failed schema validation before any route ran.
    assert statuses == ["ok"] * 6 + ["refused"] * 3, statuses


def test_usage_report_equals_raw_events(live, traffic):
    tenant_id, key = traffic
    raw = _raw(live, tenant_id)
    with live.client(key) as c:
        body = c.get("/v1/usage", params={"granularity": "hour", "by_adapter": "false"}).json()
    rows = body["data"]
    assert sum(r["requests"] for r in rows) == len(raw)
    assert sum(r["ok"] for r in rows) == sum(r["status"] == "ok" for r in raw)
    assert sum(r["refused"] for r in rows) == sum(r["status"] == "refused" for r in raw)
    assert sum(r["prompt_tokens"] for r in rows) == sum(r["prompt_tokens"] for r in raw)
    assert sum(r["completion_tokens"] for r in rows) == sum(r["completion_tokens"] for r in raw)
    with live.client(key) as c:
        by_adapter = c.get("/v1/usage", params={"by_adapter": "true"}).json()["data"]
    per = {r["adapter"]: r for r in by_adapter}
    assert per["m-ad"]["ok"] == 3 and per["base"]["ok"] == 3
    assert sum(r["requests"] for r in by_adapter) == len(raw)


def test_latency_report_within_the_histogram_bound(live, traffic):
    tenant_id, key = traffic
    raw = [r for r in _raw(live, tenant_id) if r["ttft_ms"] is not None]
    with live.client(key) as c:
        rows = c.get("/v1/latency", params={"by_adapter": "false"}).json()["data"]
    assert len(rows) == 1  # one day
    want = _exact_percentile([r["ttft_ms"] for r in raw], 50)
    assert rows[0]["ttft_p50"] == pytest.approx(want, rel=0.011)
    ok = [r["e2e_ms"] for r in _raw(live, tenant_id) if r["status"] == "ok"]
    assert rows[0]["e2e_p99"] == pytest.approx(_exact_percentile(ok, 99), rel=0.011)


def test_csv_and_operator_views(live, traffic):
    tenant_id, key = traffic
    with live.client(key) as c:
        r = c.get("/v1/usage", params={"format": "csv"})
        assert r.headers["content-type"].startswith("text/csv")
        table = list(csv.DictReader(io.StringIO(r.text)))
        assert sum(int(row["requests"]) for row in table) == len(_raw(live, tenant_id))
        empty = c.get("/v1/latency", params={"format": "csv", "start": "2020-01-01T00:00:00Z",
                                             "end": "2020-01-02T00:00:00Z"})
        assert empty.text.startswith("bucket_start,") and empty.text.count("\n") == 1
        assert c.get("/v1/usage", params={"start": "yesterday"}).status_code == 400
        assert c.get("/v1/usage", params={"granularity": "week"}).status_code == 400
    with live.client() as c:  # operator: one tenant by name, or all tenants
        one = c.get("/v1/usage", params={"tenant": "metered"}).json()["data"]
        assert {r["tenant_id"] for r in one} == {tenant_id}
        every = c.get("/v1/usage").json()["data"]
        assert tenant_id in {r["tenant_id"] for r in every}


def test_metrics_exposes_tenant_series_and_gauges(live, traffic):
    with live.client(None) as c:
        body = c.get("/metrics").text
    assert 'loraplex_requests_total{adapter="m-ad",status="ok",tenant="metered"} 3.0' in body
    assert 'loraplex_time_to_first_token_seconds_count{adapter="base",tenant="metered"}' in body
    for name in ("loraplex_queue_depth{state=\"waiting\"}", "loraplex_pool_pages{kind=\"kv\"}",
                 "loraplex_host_cache_hits_total", "loraplex_adapter_loads_total", "loraplex_metering_pending",
                 "loraplex_engine_alive 1.0", "loraplex_kv_reserved_pages "):
        assert name in body, name
    engine = {line.split()[0]: float(line.split()[1]) for line in body.splitlines()
              if line.startswith("loraplex_engine_") and not line.startswith("loraplex_engine_alive")}
    # Every step runs at least one token through the model.
    assert engine["loraplex_engine_tokens_total"] >= engine["loraplex_engine_steps_total"] > 0


def test_label_cardinality_is_capped():
    from loraplex.api.metrics import OTHER, LabelCap

    cap = LabelCap(3)
    assert [cap("t", f"a{i}") for i in range(3)] == [("t", "a0"), ("t", "a1"), ("t", "a2")]
    assert cap("t", "a9") == ("t", OTHER) and cap("u", "a0") == (OTHER, OTHER)
    assert cap("t", "a1") == ("t", "a1")  # known pairs keep their labels
