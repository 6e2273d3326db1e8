"""Content-addressed blobs: the key is the sha256 of the bytes, checked after every write and every read."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from .errors import BlobCorruptError, BlobMissingError
from .object_store import ObjectStore

PREFIX = "sha256/"


@dataclass(frozen=True)
class BlobRef:
    sha256: str
    key: str
    size: int


def blob_key(sha256: str) -> str:
    # Two levels of fan-out keep directories (and S3 listing pages) small at millions of blobs.
    return f"{PREFIX}{sha256[:2]}/{sha256}"


def digest_of(key: str) -> str | None:
    """The sha256 a key addresses, or None if it is not a blob key."""
    if not key.startswith(PREFIX):
        return None
    tail = key.rsplit("/", 1)[-1]
    return tail if len(tail) == 64 and all(c in "0123456789abcdef" for c in tail) else None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BlobStore:
    def __init__(self, objects: ObjectStore):
        self.objects = objects

    def put(self, data: bytes) -> BlobRef:
        """Write the blob, then read it back and check it: only a verified blob may get a registry row.

        An existing blob of the same digest is written again, which refreshes its age, so a garbage
        collection running now sees it as young and leaves it for the row about to point at it.
        """
        digest = sha256_hex(data)
        key = blob_key(digest)
        self.objects.put(key, data)
        self.verify(self.objects.get(key), digest, key)
        return BlobRef(digest, key, len(data))

    def fetch(self, key: str) -> bytes:
        """The blob's bytes, unverified (callers time fetch and verify apart); BlobMissingError if absent."""
        return self.objects.get(key)

    @staticmethod
    def verify(data: bytes, sha256: str, key: str) -> None:
        actual = sha256_hex(data)
        if actual != sha256:
            raise BlobCorruptError(
                f"blob {key} is corrupt: its {len(data)} bytes hash to sha256 {actual}, not {sha256}"
            )

    def get(self, key: str, sha256: str) -> bytes:
        data = self.fetch(key)
        self.verify(data, sha256, key)
        return data

    def exists(self, key: str) -> bool:
        return self.objects.stat(key) is not None


__all__ = ["BlobCorruptError", "BlobMissingError", "BlobRef", "BlobStore", "blob_key", "digest_of", "sha256_hex"]
