"""Random usage for the metering tests (fresh each run; the seed is printed so a failure can be replayed),
and the recomputation of what reports must say straight from the raw usage_events rows."""

from __future__ import annotations

import math
import random
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import select

from loraplex.adapter_store import AdapterCreate, AdapterPublic, Registry, TenantCreate, TenantPublic
from loraplex.adapter_store.models import UsageEvent
from loraplex.metering import UsageRecord

STATUSES = ("ok", "ok", "ok", "cancelled", "refused", "error")


def adapter_create(tenant_id: str, name: str) -> AdapterCreate:
    digest = uuid.uuid4().hex * 2
    return AdapterCreate(tenant_id=tenant_id, name=name, base_model_fingerprint="f" * 64, rank=4, alpha=8.0,
                         target_modules=("q_proj", "v_proj"), dtype="float32", size_bytes=123, sha256=digest,
                         storage_key=f"sha256/{digest[:2]}/{digest}")


@dataclass
class Fleet:
    tenants: list[TenantPublic]
    # per tenant id: the adapter versions requests may use (None = the base model)
    adapters: dict[str, list[AdapterPublic | None]] = field(default_factory=dict)


def make_fleet(registry: Registry) -> Fleet:
    """Tenant 0 (target 300 ms): support v1, support v2, a deleted adapter. Tenant 1 (no target): an adapter
    also named support. Tenant 2 (target 120 ms): base model only."""
    t0, t1, t2 = (registry.create_tenant(TenantCreate(name=f"m-{uuid.uuid4().hex[:10]}", ttft_target_ms=target))
                  for target in (300, None, 120))
    s1 = registry.add_adapter(adapter_create(t0.id, "support"))
    s2 = registry.add_adapter(adapter_create(t0.id, "support"))
    gone = registry.add_adapter(adapter_create(t0.id, "old-bot"))
    registry.delete_adapter(t0.id, "old-bot")
    other = registry.add_adapter(adapter_create(t1.id, "support"))
    return Fleet(tenants=[t0, t1, t2], adapters={t0.id: [None, s1, s2, gone], t1.id: [None, other], t2.id: [None]})


def new_rng() -> random.Random:
    seed = random.randrange(2**32)
    print(f"metering test data seed: {seed}")
    return random.Random(seed)


def random_records(rng: random.Random, fleet: Fleet, n: int, start: datetime, hours: int) -> list[UsageRecord]:
    """n requests spread over [start, start + hours), every status, some without measurements."""
    out = []
    for i in range(n):
        tenant = rng.choice(fleet.tenants)
        adapter = rng.choice(fleet.adapters[tenant.id])
        status = rng.choice(STATUSES)
        served = status != "refused"
        completion = rng.randrange(0, 40) if served else 0
        scale = rng.choice((5.0, 20.0, 80.0))  # latency regimes far apart: percentiles are not trivial
        out.append(UsageRecord(
            tenant_id=tenant.id, request_id=f"req-{uuid.uuid4().hex}", status=status,
            reason="429 slo" if status == "refused" else ("engine failed" if status == "error" else None),
            adapter_id=adapter.id if adapter else None,
            prompt_tokens=rng.randrange(1, 500), completion_tokens=completion,
            queue_ms=rng.uniform(0, 50) if served else None,
            ttft_ms=rng.lognormvariate(math.log(10 * scale), 0.8) if served and completion else None,
            e2e_ms=rng.lognormvariate(math.log(100 * scale), 0.5),
            itl_ms=tuple(rng.lognormvariate(math.log(scale), 0.6) for _ in range(max(0, completion - 1))),
            ttft_target_ms=None if tenant.ttft_target_ms is None else float(tenant.ttft_target_ms),
            created_at=start + timedelta(seconds=rng.uniform(0, hours * 3600)),
        ))
    return out


def raw_events(registry: Registry, tenant_ids: list[str]) -> list[dict]:
    with registry.engine.connect() as conn:
        rows = conn.execute(select(UsageEvent).where(UsageEvent.tenant_id.in_(tenant_ids))).mappings().all()
    out = []
    for r in rows:
        r = dict(r)
        r["created_at"] = r["created_at"].replace(tzinfo=UTC) if r["created_at"].tzinfo is None else r["created_at"]
        out.append(r)
    return out


def aligned_hours(start: datetime, end: datetime, granularity: str) -> tuple[int, int]:
    """The epoch hours [start, end) a report covers: widened to whole hours, or whole UTC days."""
    size = 1 if granularity == "hour" else 24
    return (math.floor(start.timestamp() / 3600 / size) * size, math.ceil(end.timestamp() / 3600 / size) * size)


def group_key(event: dict, hours: tuple[int, int], granularity: str, by_adapter: bool) -> tuple | None:
    """(tenant_id, adapter_id or "" (base) or None (not by adapter), bucket start hour); None: outside."""
    hour = math.floor(event["created_at"].timestamp() / 3600)
    if not hours[0] <= hour < hours[1]:
        return None
    bucket = hour if granularity == "hour" else hour - hour % 24
    return event["tenant_id"], (event["adapter_id"] or "") if by_adapter else None, bucket


def expected_usage(events: list[dict], hours: tuple[int, int], granularity: str, by_adapter: bool) -> dict[tuple, dict]:
    out: dict[tuple, dict] = defaultdict(lambda: dict.fromkeys(
        ("requests", "ok", "cancelled", "refused", "errors", "prompt_tokens", "completion_tokens"), 0))
    for e in events:
        key = group_key(e, hours, granularity, by_adapter)
        if key is None:
            continue
        c = out[key]
        c["requests"] += 1
        c["errors" if e["status"] == "error" else e["status"]] += 1
        c["prompt_tokens"] += e["prompt_tokens"]
        c["completion_tokens"] += e["completion_tokens"]
    return dict(out)


def hour_of(t: datetime) -> int:
    return math.floor(t.astimezone(UTC).timestamp() / 3600)


def row_key(row) -> tuple:
    return row.tenant_id, row.adapter_id or ("" if row.adapter == "base" else None), hour_of(row.bucket_start)
