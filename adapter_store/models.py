"""The registry's tables (SQLAlchemy 2 declarative). Migrations in migrations/versions must match these.

Ids are uuid strings (portable across SQLite and PostgreSQL); times are UTC. Rows are never updated
in place except status/last-used columns: an adapter version, once registered, is immutable.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# Deterministic constraint names: migrations can drop them by name on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite only auto-increments an INTEGER PRIMARY KEY; PostgreSQL gets a real 64-bit key.
BigIntId = BigInteger().with_variant(Integer(), "sqlite")

UUID_LEN = 36
SHA256_LEN = 64


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(UUID_LEN), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    # The tenant's time-to-first-token target (the API's admission SLO); None: the server default.
    ttft_target_ms: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    disabled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Admission limits (revision 0003); None: the server's default for tenants.
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    share: Mapped[float] = mapped_column(Float, server_default="1.0")  # weight under VTC fair queueing


class ApiKey(Base):
    """An API key, stored only as the sha256 of the secret; `prefix` lets a person tell keys apart."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(UUID_LEN), primary_key=True)
    # None only for operator keys, which belong to no tenant.
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    role: Mapped[str] = mapped_column(String(16))  # user | admin | operator
    key_hash: Mapped[str] = mapped_column(String(SHA256_LEN), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    label: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Adapter(Base):
    """One immutable version of a tenant's adapter. (tenant, name, version) is unique; id is its uuid."""

    __tablename__ = "adapters"
    __table_args__ = (
        UniqueConstraint("tenant_id", "name", "version"),
        # The unique index on (tenant_id, name, version) also serves "newest ready version of a name" and
        # keyset pagination; sha256 is looked up by garbage collection ("is this blob referenced?").
        Index("ix_adapters_sha256", "sha256"),
    )

    id: Mapped[str] = mapped_column(String(UUID_LEN), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    base_model_fingerprint: Mapped[str] = mapped_column(String(SHA256_LEN))
    rank: Mapped[int] = mapped_column(Integer)  # the largest rank of any module
    alpha: Mapped[float] = mapped_column(Float)  # lora_alpha
    target_modules: Mapped[str] = mapped_column(String(128))  # comma-separated, in TARGET_MODULES order
    dtype: Mapped[str] = mapped_column(String(16))  # of the stored tensors
    size_bytes: Mapped[int] = mapped_column(BigInteger)  # of the blob
    sha256: Mapped[str] = mapped_column(String(SHA256_LEN))
    storage_key: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(16))  # ready | unhealthy | deleted
    status_detail: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class UsageEvent(Base):
    """One served (or refused) request, written in batches by loraplex.metering together with the rollups
    below (one transaction); reports read the rollups, these raw rows are the record they are checked
    against."""

    __tablename__ = "usage_events"
    __table_args__ = (Index("ix_usage_events_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigIntId, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    adapter_id: Mapped[str | None] = mapped_column(ForeignKey("adapters.id", ondelete="SET NULL"))
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    request_id: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    status: Mapped[str] = mapped_column(String(16))  # ok | cancelled | refused | error
    reason: Mapped[str | None] = mapped_column(String(255))  # why refused or failed
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    queue_ms: Mapped[float | None] = mapped_column(Float)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    itl_mean_ms: Mapped[float | None] = mapped_column(Float)
    itl_p50_ms: Mapped[float | None] = mapped_column(Float)
    itl_p99_ms: Mapped[float | None] = mapped_column(Float)
    itl_max_ms: Mapped[float | None] = mapped_column(Float)
    e2e_ms: Mapped[float | None] = mapped_column(Float)
    # The tenant's TTFT target when the request ran (revision 0002); None: no target.
    ttft_target_ms: Mapped[float | None] = mapped_column(Float)


# -- rollups (revision 0002): what usage and latency reports read ---------------------------------------
# Keyed by (tenant, hour or day, adapter key). epoch_hour = whole hours since 1970-01-01T00:00Z and
# epoch_day = whole UTC days since then (epoch_hour // 24): integers, so bucketing is plain arithmetic on
# every backend (no time-zone-dependent date functions). adapter_key is the adapter version's uuid, ''
# for the base model: a non-null key, so that INSERT .. ON CONFLICT upserts work on SQLite and
# PostgreSQL. Adapter rows are never deleted (status "deleted"), so names stay resolvable; rollups go
# with their tenant (CASCADE), like usage_events.


class UsageHourly(Base):
    """Counters per (tenant, hour, adapter version): upserted by adding a batch's counts."""

    __tablename__ = "usage_hourly"
    __table_args__ = (Index("ix_usage_hourly_epoch_hour", "epoch_hour"),)  # all-tenant reports

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    epoch_hour: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    adapter_key: Mapped[str] = mapped_column(String(UUID_LEN), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    ok: Mapped[int] = mapped_column(BigInteger)
    cancelled: Mapped[int] = mapped_column(BigInteger)
    refused: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    ttft_count: Mapped[int] = mapped_column(BigInteger)  # requests with a TTFT
    ttft_targeted: Mapped[int] = mapped_column(BigInteger)  # ... and a TTFT target
    ttft_within: Mapped[int] = mapped_column(BigInteger)  # ... and ttft_ms <= ttft_target_ms


class _LatencyValues:
    """Columns shared by the latency rollups: per metric, the sparse log-bucket histogram (a
    loraplex.metering.histogram blob of (bucket uint16, count uint32) records) and the p50/p90/p99 read
    from it (milliseconds; None without values), kept with it so that a report by adapter reads them
    directly. itl counts every inter-token gap; ttft and e2e one value per request."""

    ttft_hist: Mapped[bytes] = mapped_column(LargeBinary)
    itl_hist: Mapped[bytes] = mapped_column(LargeBinary)
    e2e_hist: Mapped[bytes] = mapped_column(LargeBinary)
    ttft_p50: Mapped[float | None] = mapped_column(Float)
    ttft_p90: Mapped[float | None] = mapped_column(Float)
    ttft_p99: Mapped[float | None] = mapped_column(Float)
    itl_p50: Mapped[float | None] = mapped_column(Float)
    itl_p90: Mapped[float | None] = mapped_column(Float)
    itl_p99: Mapped[float | None] = mapped_column(Float)
    e2e_p50: Mapped[float | None] = mapped_column(Float)
    e2e_p90: Mapped[float | None] = mapped_column(Float)
    e2e_p99: Mapped[float | None] = mapped_column(Float)


class LatencyHourly(_LatencyValues, Base):
    """Latency per (tenant, hour, adapter version). The writer merges histograms under a lock (read, add,
    write back) and recomputes the percentiles in the same statement."""

    __tablename__ = "latency_hourly"
    __table_args__ = (Index("ix_latency_hourly_epoch_hour", "epoch_hour"),)

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    epoch_hour: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    adapter_key: Mapped[str] = mapped_column(String(UUID_LEN), primary_key=True)


class LatencyDaily(_LatencyValues, Base):
    """The same per UTC day (written with the hourly rows, in the same transaction), so that a daily
    report reads one row per (adapter, day) instead of 24."""

    __tablename__ = "latency_daily"
    __table_args__ = (Index("ix_latency_daily_epoch_day", "epoch_day"),)

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    epoch_day: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    adapter_key: Mapped[str] = mapped_column(String(UUID_LEN), primary_key=True)
