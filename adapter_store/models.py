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
    """One served (or refused) request, written in batches by the API layer; reports read these."""

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
