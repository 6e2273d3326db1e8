"""Errors of the adapter store, on top of loraplex.errors (AdapterError, AdapterNotFoundError)."""

from __future__ import annotations

from loraplex.errors import LoraplexError


class StoreError(LoraplexError):
    """The registry or the object store failed in a way the caller cannot fix by changing input."""


class BlobMissingError(StoreError):
    """A blob the registry points at is not in the object store."""


class BlobCorruptError(StoreError):
    """A blob's bytes do not hash to its content address."""


class AdapterUnavailableError(StoreError):
    """The adapter exists but cannot be served: its blob is missing or corrupt (it is marked unhealthy)."""


class ConflictError(LoraplexError, ValueError):
    """A name that must be unique is taken (a tenant name, say)."""


class NotFoundError(LoraplexError, KeyError):
    """A tenant, key or adapter id that the registry does not hold."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "not found"
