"""Percentiles of many groups of stored histograms at once (vectorised: a report merges ~10^5 blobs).

Input: one stored histogram (histogram.encode bytes) per row, and the output group each row belongs to
(e.g. (tenant, adapter, day)). Output: per group, the number of values and the nearest-rank
percentiles read from the merged histogram (NaN where a group has no values).

How: all (bucket, count) pairs go into one array with a key (group << BUCKET_BITS | bucket). Rows given
in group order with one row per group (hourly reports by adapter) are sorted already; otherwise equal
keys are merged by a dense bincount over (group, bucket span) when that table is small, else by a sort.
Then one cumulative sum and a binary search per percentile give every group's answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .histogram import BUCKET_BITS, bucket_values, decode_many

_BUCKET_MASK = (1 << BUCKET_BITS) - 1
# Largest (groups x bucket span) table merged densely (float64: 32 MiB); beyond it, a sort.
MAX_DENSE_CELLS = 1 << 22


def group_percentiles(blobs: Sequence[bytes], group_ids: np.ndarray, n_groups: int, pcts: Sequence[int],
                      max_dense_cells: int = MAX_DENSE_CELLS) -> tuple[np.ndarray, np.ndarray]:
    """(counts: int64 [n_groups], values: float64 [n_groups, len(pcts)]) for blobs[i] in group group_ids[i]."""
    counts_out = np.zeros(n_groups, dtype=np.int64)
    values_out = np.full((n_groups, len(pcts)), np.nan)
    lengths, bucket, count = decode_many(blobs)
    if not len(bucket):
        return counts_out, values_out
    group_ids = np.asarray(group_ids, dtype=np.int64)
    nonempty = lengths > 0
    if bool(np.all(np.diff(group_ids[nonempty]) > 0)):
        # At most one blob per group, in group order: each group's records are one sorted run already
        # (a count split over records of one bucket stays adjacent: the cumulative sum handles it).
        gstart = (np.cumsum(lengths) - lengths)[nonempty]
        present = group_ids[nonempty]
    else:
        group = np.repeat(group_ids, lengths)
        key, count = _merge((group << BUCKET_BITS) | bucket, group, bucket, count, n_groups, max_dense_cells)
        group, bucket = key >> BUCKET_BITS, key & _BUCKET_MASK
        gstart = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
        present = group[gstart]
    cum = np.cumsum(count)
    total = np.add.reduceat(count, gstart)
    before = cum[gstart] - count[gstart]  # values in earlier groups
    counts_out[present] = total
    for j, pct in enumerate(pcts):
        rank = np.maximum(1, (total * pct + 99) // 100)  # nearest rank, integer arithmetic
        idx = np.searchsorted(cum, before + rank, side="left")
        values_out[present, j] = bucket_values(bucket[idx])
    return counts_out, values_out


def _merge(key: np.ndarray, group: np.ndarray, bucket: np.ndarray, count: np.ndarray, n_groups: int,
           max_dense_cells: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique keys and their summed counts."""
    low, span = int(bucket.min()), int(bucket.max() - bucket.min()) + 1
    if n_groups * span <= max_dense_cells:
        # float64 sums are exact below 2**53 values per cell.
        dense = np.bincount(group * span + (bucket - low), weights=count, minlength=n_groups * span)
        cells = np.flatnonzero(dense)
        return ((cells // span) << BUCKET_BITS) | (cells % span + low), dense[cells].astype(np.int64)
    order = np.argsort(key, kind="stable")
    key, count = key[order], count[order]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    return key[starts], np.add.reduceat(count, starts)
