"""Metering takes either the adapter store's Registry (as the server holds it) or a SQLAlchemy Engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Union

from sqlalchemy import Engine

if TYPE_CHECKING:
    from loraplex.adapter_store.registry import Registry

RegistryOrEngine = Union["Registry", Engine]


def engine_of(source: RegistryOrEngine) -> Engine:
    if isinstance(source, Engine):
        return source
    engine = getattr(source, "engine", None)
    if not isinstance(engine, Engine):
        raise TypeError(f"expected a Registry or a SQLAlchemy Engine, got {type(source).__name__}")
    return engine
