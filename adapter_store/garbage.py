"""Garbage collection and scrubbing: keep blobs and rows consistent after crashes and corruption.

collect_garbage removes blobs no live row points at (orphans of uploads that crashed between blob
and row, and blobs of deleted adapters), but only once they are older than min_age: a young blob may
belong to an upload whose row is about to commit. scrub re-reads every live row's blob, marking
rows with missing or corrupt blobs unhealthy (and healthy again once their blob is back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from itertools import islice

from .blobs import PREFIX, BlobStore, digest_of
from .errors import BlobCorruptError, BlobMissingError
from .registry import Registry
from .timeutil import utcnow

_BATCH = 500


@dataclass(frozen=True)
class GcReport:
    scanned: int
    deleted: list[str] = field(default_factory=list)  # keys removed
    freed_bytes: int = 0
    kept_young: int = 0  # unreferenced, but too recent to remove
    partial_writes_removed: int = 0
    foreign: int = 0  # objects under the prefix that are not blobs (left alone)


@dataclass(frozen=True)
class ScrubReport:
    checked: int
    marked_unhealthy: list[str] = field(default_factory=list)  # adapter ids
    marked_ready: list[str] = field(default_factory=list)


def collect_garbage(registry: Registry, blobs: BlobStore, min_age_s: float, dry_run: bool = False) -> GcReport:
    objects = blobs.objects
    cutoff = utcnow() - timedelta(seconds=min_age_s)
    scanned = kept_young = foreign = freed = 0
    deleted: list[str] = []
    listing = objects.list(PREFIX)
    while batch := list(islice(listing, _BATCH)):
        scanned += len(batch)
        digests = {}
        for info in batch:
            digest = digest_of(info.key)
            if digest is None:
                foreign += 1
            else:
                digests[digest] = info
        live = registry.referenced_digests(list(digests))
        for digest, info in digests.items():
            if digest in live:
                continue
            # Look again just before deleting: an upload may have re-written it since the listing.
            now_info = objects.stat(info.key)
            if now_info is None:
                continue
            if now_info.modified > cutoff:
                kept_young += 1
                continue
            if not dry_run:
                objects.delete(info.key)
            deleted.append(info.key)
            freed += now_info.size
    partial = 0 if dry_run else objects.remove_partial_writes(min_age_s)
    return GcReport(scanned=scanned, deleted=deleted, freed_bytes=freed, kept_young=kept_young,
                    partial_writes_removed=partial, foreign=foreign)


def scrub(registry: Registry, blobs: BlobStore) -> ScrubReport:
    checked = 0
    bad: list[str] = []
    good: list[str] = []
    for ref in registry.iter_live_adapters():
        checked += 1
        try:
            blobs.get(ref.storage_key, ref.sha256)
        except (BlobMissingError, BlobCorruptError) as e:
            if ref.status != "unhealthy":
                registry.mark_unhealthy(ref.id, str(e))
                bad.append(ref.id)
            continue
        if ref.status == "unhealthy":
            registry.mark_ready(ref.id)
            good.append(ref.id)
    return ScrubReport(checked=checked, marked_unhealthy=bad, marked_ready=good)
