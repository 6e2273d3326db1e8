"""benchmarks/cpu_attention_bench.py's block-table layouts: every layout holds each page once, the two runs
lay a sequence's pages out as they say, and --layouts times the kernel over each."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from loraplex.kernels import cpu_attention
from native_kernels import require_built

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cpu_attention_bench as bench  # noqa: E402


@pytest.mark.parametrize("layout", bench.LAYOUTS)
def test_each_layout_holds_every_page_once(layout):
    rng = random.Random()
    nbs = [rng.randint(1, 9) for _ in range(rng.randint(1, 6))]
    layers = rng.randint(1, 5)
    tables = bench.layout_tables(nbs, layers, layout, torch.Generator().manual_seed(rng.randrange(1 << 30)))
    assert tables.shape == (layers, len(nbs), max(nbs))
    used = [int(p) for s, nb in enumerate(nbs) for layer in range(layers) for p in tables[layer, s, :nb]]
    assert sorted(used) == list(range(sum(nbs) * layers))
    if layout == "scattered":
        return
    at = 0
    for s, nb in enumerate(nbs):  # a sequence's pages are one run, in the order the layout names
        seq = tables[:, s, :nb]  # [layers, nb]
        order = seq.T.flatten() if layout == "block-major" else seq.flatten()
        assert order.tolist() == list(range(at, at + nb * layers))
        at += nb * layers


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        bench.layout_tables([2], 1, "diagonal", torch.Generator())


def test_layout_case_times_the_kernel_over_each_layout(monkeypatch):
    require_built(cpu_attention.STEM, cpu_attention.extension() is not None, "paged attention")
    monkeypatch.setattr(bench, "POOL_TARGET_BYTES", 1 << 20)  # a few layers, not 600 MiB
    res = bench.layout_case("decode B=3 ctx=40", [(39, 1)] * 3, 2, torch.Generator().manual_seed(0))
    assert set(res["layouts"]) == set(bench.LAYOUTS)
    assert res["layers_cycled"] > 1
    for r in res["layouts"].values():
        assert r["median_ms"] > 0 and r["kv_gbps"] > 0
