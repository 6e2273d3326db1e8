"""Log-spaced latency buckets and the sparse histograms that the latency rollups store.

Bucket scheme (fixed: stored histograms depend on it, so changing it needs a data migration):

- ``RATIO = 1.02``, ``V_MIN_MS = 0.001`` (1 µs), ``V_MAX_MS = 1e9`` (about 11.6 days).
- A value v (milliseconds) goes to bucket
  ``0`` when v < V_MIN_MS (zero, negative, sub-microsecond),
  ``1 + floor(log(v / V_MIN_MS) / log(RATIO))`` otherwise, clamped to ``MAX_BUCKET`` (= 1396, the
  bucket of V_MAX_MS). Bucket i >= 1 covers [V_MIN_MS * RATIO**(i-1), V_MIN_MS * RATIO**i).
- A bucket reads back as its geometric midpoint ``V_MIN_MS * RATIO**(i - 0.5)`` (bucket 0: 0.0).

Error bound: for any value in bucket i >= 1 the midpoint is within ``sqrt(RATIO) - 1`` (0.995%) of it,
relatively, so a percentile read from a histogram is within **1% relative** of the exact percentile of
the raw values (the same rank, read from its bucket), plus 1 µs absolute for values under 1 µs; values
above V_MAX_MS are clamped (reported as about 1e9 ms). Percentiles use the nearest-rank definition:
p-th percentile of n values = the value of rank ceil(p * n / 100) in ascending order (1-based), so the
percentile is always one of the recorded values, never an interpolation between two.

Stored form (``encode``/``decode``/``decode_many``): a sparse histogram is packed little-endian
(bucket: uint16, count: uint32) records, 6 bytes each, sorted by bucket; an empty histogram is ``b""``.
A count above 2**32 - 1 is split over several records of the same bucket (readers add them up), so
counts are unbounded and every record has the same size: a report decodes all its blobs with one
``b"".join`` and one ``np.frombuffer``. One row holds one histogram per metric for a (tenant, adapter,
hour), so a report over a month reads 3 blobs per (adapter, hour) instead of one row per bucket
(measured: 4M bucket rows took 40 s to aggregate on SQLite, 9.6 s on PostgreSQL).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

RATIO = 1.02
V_MIN_MS = 0.001
V_MAX_MS = 1e9
_LOG_RATIO = math.log(RATIO)
MAX_BUCKET = 1 + int(math.floor(math.log(V_MAX_MS / V_MIN_MS) / _LOG_RATIO))
# Every bucket index fits in BUCKET_BITS bits (used to pack (group, bucket) into one int64 key).
BUCKET_BITS = 11
assert MAX_BUCKET < (1 << BUCKET_BITS)
# The relative error bound of a value read back from its bucket (sqrt(RATIO) - 1, just under 1%).
RELATIVE_ERROR = math.sqrt(RATIO) - 1

RECORD = np.dtype([("bucket", "<u2"), ("count", "<u4")])  # packed: 6 bytes, no padding
assert RECORD.itemsize == 6
_MAX_COUNT = (1 << 32) - 1


def bucket_of(value_ms: float) -> int:
    """The bucket of one value (see the module docstring)."""
    if not value_ms >= V_MIN_MS:  # also NaN
        return 0
    return min(MAX_BUCKET, 1 + int(math.log(min(value_ms, V_MAX_MS) / V_MIN_MS) / _LOG_RATIO))


def buckets_of(values_ms: np.ndarray) -> np.ndarray:
    """bucket_of for an array of values, as int64 (shape of values_ms)."""
    v = np.asarray(values_ms, dtype=np.float64)
    out = np.zeros(v.shape, dtype=np.int64)
    ok = v >= V_MIN_MS  # False for NaN too
    out[ok] = 1 + np.floor(np.log(np.minimum(v[ok], V_MAX_MS) / V_MIN_MS) / _LOG_RATIO).astype(np.int64)
    np.minimum(out, MAX_BUCKET, out=out)
    return out


def bucket_values(buckets: np.ndarray) -> np.ndarray:
    """The value a bucket reads back as (its geometric midpoint; bucket 0: 0.0), as float64."""
    b = np.asarray(buckets, dtype=np.float64)
    return np.where(b > 0, V_MIN_MS * np.power(RATIO, b - 0.5), 0.0)


def nearest_rank(n: int, pct: int) -> int:
    """The 1-based rank of the pct-th percentile of n values: ceil(pct * n / 100), at least 1. Integer
    arithmetic, so 0.9 * 10 is exactly 9 (a float product may land just above and round up to 10)."""
    return max(1, (pct * n + 99) // 100)


def exact_percentile(values: Sequence[float], pct: int) -> float | None:
    """The nearest-rank percentile of raw values (what a histogram percentile approximates)."""
    if not values:
        return None
    s = sorted(values)
    return s[nearest_rank(len(s), pct) - 1]


# -- the stored form -----------------------------------------------------------------------------------

def encode(buckets: np.ndarray, counts: np.ndarray) -> bytes:
    """Bytes of a sparse histogram; buckets must be sorted and unique, counts positive."""
    buckets = np.asarray(buckets, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    if len(counts) and int(counts.max()) > _MAX_COUNT:  # split: k full records + the remainder
        pieces = (counts + _MAX_COUNT - 1) // _MAX_COUNT
        buckets = np.repeat(buckets, pieces)
        last = np.cumsum(pieces) - 1
        split = np.full(len(buckets), _MAX_COUNT, dtype=np.int64)
        split[last] = counts - (pieces - 1) * _MAX_COUNT
        counts = split
    records = np.empty(len(buckets), dtype=RECORD)
    records["bucket"] = buckets
    records["count"] = counts
    return records.tobytes()


def decode(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    """(buckets int64, counts int64) of a stored histogram, split records added back together."""
    records = np.frombuffer(blob, dtype=RECORD)
    buckets, counts = records["bucket"].astype(np.int64), records["count"].astype(np.int64)
    if len(buckets) > 1 and not bool(np.all(buckets[1:] > buckets[:-1])):
        starts = np.flatnonzero(np.r_[True, buckets[1:] != buckets[:-1]])
        buckets, counts = buckets[starts], np.add.reduceat(counts, starts)
    return buckets, counts


def decode_many(blobs: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(records per blob, buckets, counts) of many stored histograms, concatenated in blob order
    (split records stay separate: the caller merges equal buckets)."""
    lengths = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs)) // RECORD.itemsize
    records = np.frombuffer(b"".join(blobs), dtype=RECORD)
    return lengths, records["bucket"].astype(np.int64), records["count"].astype(np.int64)


def merge(blob: bytes, buckets: np.ndarray, counts: np.ndarray) -> bytes:
    """A stored histogram plus more (bucket, count) pairs (sorted, unique), as a stored histogram."""
    if not blob:
        return encode(buckets, counts)
    old_b, old_c = decode(blob)
    all_b = np.concatenate([old_b, buckets])
    all_c = np.concatenate([old_c, counts])
    uniq, inverse = np.unique(all_b, return_inverse=True)
    summed = np.zeros(len(uniq), dtype=np.int64)
    np.add.at(summed, inverse, all_c)
    return encode(uniq, summed)


def percentiles(blob: bytes, pcts: Sequence[int]) -> list[float | None]:
    """Nearest-rank percentiles of one stored histogram (None when empty): the same values that
    percentiles.group_percentiles reads for a group holding only this blob."""
    buckets, counts = decode(blob)
    if not len(counts):
        return [None] * len(pcts)
    cum = np.cumsum(counts)
    ranks = np.maximum(1, (int(cum[-1]) * np.asarray(pcts, dtype=np.int64) + 99) // 100)
    return bucket_values(buckets[np.searchsorted(cum, ranks, side="left")]).tolist()
