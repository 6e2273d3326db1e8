"""benchmarks/triton_sass.py compiles the SGMV kernels for sm_90 without a GPU and counts their SASS."""

from __future__ import annotations

import json

import pytest
from script_loader import load_script

pytest.importorskip("triton.backends.nvidia")


def test_counts_and_the_shrinks_per_k_branch(tmp_path):
    """Every variant compiles and is counted; the decode shrink's per-k branch alone is a fraction of the
    kernel holding both branches (the per-element page lookups are the instructions it drops)."""
    bench = load_script("triton_sass.py")
    both = bench.main(["--json", str(tmp_path / "sass.json")])
    fast = bench.main(["--fast-path-only"])
    assert set(both) == {"shrink BLOCK_M=1", "expand BLOCK_M=1", "shrink BLOCK_M=32", "expand BLOCK_M=32"}
    assert all(r["sass_instructions"] > 0 and r["global_loads"] for r in both.values())
    assert fast["shrink BLOCK_M=1"]["sass_instructions"] < 0.5 * both["shrink BLOCK_M=1"]["sass_instructions"]
    assert fast["expand BLOCK_M=1"] == both["expand BLOCK_M=1"]  # the expand has no such branch
    assert json.loads((tmp_path / "sass.json").read_text())["kernels"] == both
