"""The log-bucket scheme: every value reads back within 1%; histogram percentiles match exact ones within
that bound; stored histograms merge exactly. Random values, fresh each run."""

from __future__ import annotations

import numpy as np
import pytest

from loraplex.metering import histogram as h
from loraplex.metering.percentiles import group_percentiles
from metering_data import new_rng


def test_every_value_reads_back_within_the_bound():
    rng = new_rng()
    values = np.array([10 ** rng.uniform(-3, 9) for _ in range(20_000)] + [h.V_MIN_MS, 1.0, 1.02, 1e9])
    buckets = h.buckets_of(values)
    assert [h.bucket_of(v) for v in values.tolist()] == buckets.tolist()
    back = h.bucket_values(buckets)
    assert np.all(np.abs(back - values) <= h.RELATIVE_ERROR * values * (1 + 1e-9))
    assert h.RELATIVE_ERROR < 0.01
    # Below 1 µs (and zero, negative, NaN): bucket 0, read as 0.
    assert h.buckets_of(np.array([0.0, -5.0, 0.0009, np.nan])).tolist() == [0, 0, 0, 0]
    assert h.bucket_of(float("nan")) == 0 and h.bucket_values(np.array([0]))[0] == 0.0
    # Above V_MAX_MS: clamped to the last bucket.
    assert h.bucket_of(1e15) == h.MAX_BUCKET == h.buckets_of(np.array([np.inf]))[0]


def test_nearest_rank_uses_exact_integer_arithmetic():
    assert [h.nearest_rank(10, p) for p in (50, 90, 99)] == [5, 9, 10]
    assert [h.nearest_rank(100, p) for p in (50, 90, 99)] == [50, 90, 99]
    assert h.nearest_rank(1, 50) == 1 and h.nearest_rank(3, 1) == 1
    assert h.exact_percentile([3.0, 1.0, 2.0], 50) == 2.0 and h.exact_percentile([], 50) is None


@pytest.mark.parametrize("merge", ["dense", "sort"])
def test_group_percentiles_match_exact_percentiles_within_the_bound(merge):
    rng = new_rng()
    groups = []
    for _ in range(60):
        scale = 10 ** rng.uniform(-1, 4)
        groups.append([rng.lognormvariate(0, 1) * scale for _ in range(rng.randrange(1, 400))])
    # Each group split into several stored histograms (hours), in shuffled row order: the merge must sort.
    blobs, gids = [], []
    for g, values in enumerate(groups):
        for part in np.array_split(np.array(values), rng.randrange(1, 5)):
            b, c = np.unique(h.buckets_of(part), return_counts=True)
            blobs.append(h.encode(b, c))
            gids.append(g)
    order = list(range(len(blobs)))
    rng.shuffle(order)
    counts, pct = group_percentiles([blobs[i] for i in order], np.array([gids[i] for i in order]),
                                    len(groups) + 1, (50, 90, 99), max_dense_cells=1 << 22 if merge == "dense" else 0)
    assert counts.tolist() == [len(v) for v in groups] + [0]
    assert np.isnan(pct[-1]).all()  # a group without values
    for g, values in enumerate(groups):
        for j, p in enumerate((50, 90, 99)):
            exact = h.exact_percentile(values, p)
            assert abs(pct[g, j] - exact) <= 0.01 * exact, (g, p, pct[g, j], exact)


def test_merging_stored_histograms_adds_counts():
    rng = new_rng()
    a = np.array([rng.uniform(0.5, 50) for _ in range(300)])
    b = np.array([rng.uniform(5, 500) for _ in range(200)])
    stored = b""
    for part in (a, b):
        buckets, counts = np.unique(h.buckets_of(part), return_counts=True)
        stored = h.merge(stored, buckets, counts)
    both_b, both_c = np.unique(h.buckets_of(np.concatenate([a, b])), return_counts=True)
    assert stored == h.encode(both_b, both_c)
    assert [x.tolist() for x in h.decode(stored)] == [both_b.tolist(), both_c.tolist()]
    assert h.decode(b"")[0].size == 0


def test_counts_of_any_size_round_trip_and_decode_together():
    b = np.array([3, 70, 900])
    cases = [np.array([1, 2, 255]), np.array([70_000, 1, (1 << 32) - 1]), np.array([1, (1 << 40) + 5, 1])]
    blobs = [h.encode(b, c) for c in cases]
    # 6 bytes a record; a count over 2**32 - 1 takes 257 records of its bucket here.
    assert [len(blob) for blob in blobs] == [18, 18, 6 * (2 + 257)]
    for blob, c in zip(blobs, cases):
        assert [x.tolist() for x in h.decode(blob)] == [b.tolist(), c.tolist()]
    mixed = [blobs[1], b"", blobs[0], b"", h.encode(np.array([5]), np.array([9]))]
    lengths, buckets, counts = h.decode_many(mixed)
    assert lengths.tolist() == [3, 0, 3, 0, 1]
    assert buckets.tolist() == b.tolist() * 2 + [5]
    assert counts.tolist() == [70_000, 1, (1 << 32) - 1, 1, 2, 255, 9]
    assert h.encode(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == b""
    # Split records merge like any other in reports' percentiles.
    counts, pct = group_percentiles([blobs[2], blobs[0]], np.array([0, 0]), 1, (50,))
    assert counts.tolist() == [(1 << 40) + 5 + 2 + 1 + 2 + 255] and pct[0, 0] == h.bucket_values(np.array([70]))[0]


def test_one_blob_per_group_needs_no_merge_and_handles_empty_and_split_blobs():
    rng = new_rng()
    groups = [[rng.uniform(1, 100) for _ in range(rng.randrange(1, 50))] for _ in range(5)]
    blobs = [h.encode(*np.unique(h.buckets_of(np.array(v)), return_counts=True)) for v in groups]
    huge = h.encode(np.array([3, 70]), np.array([1, (1 << 33) + 1]))  # bucket 70's count spans 3 records
    rows = [b"", blobs[0], blobs[1], b"", huge, blobs[2], blobs[3], blobs[4]]
    counts, pct = group_percentiles(rows, np.arange(len(rows)), len(rows), (50, 99))
    assert counts.tolist() == [0, *map(len, groups[:2]), 0, (1 << 33) + 2, *map(len, groups[2:])]
    assert np.isnan(pct[[0, 3]]).all()
    assert pct[4].tolist() == [h.bucket_values(np.array([70]))[0]] * 2
    for row, values in zip((1, 2, 5, 6, 7), groups):
        for j, p in enumerate((50, 99)):
            exact = h.exact_percentile(values, p)
            assert abs(pct[row, j] - exact) <= 0.01 * exact


def test_stored_percentiles_equal_the_merged_path():
    rng = new_rng()
    for _ in range(20):
        values = np.array([rng.lognormvariate(3, 1) for _ in range(rng.randrange(1, 300))])
        blob = h.encode(*np.unique(h.buckets_of(values), return_counts=True))
        merged = group_percentiles([blob], np.array([0]), 1, (50, 90, 99))[1][0].tolist()
        assert h.percentiles(blob, (50, 90, 99)) == merged
    assert h.percentiles(b"", (50, 99)) == [None, None]
