"""benchmarks/triton_sass.py compiles the SGMV kernels for sm_90 without a GPU, as a launch would, and counts
their SASS and the width of their global loads."""

from __future__ import annotations

import json

import pytest
from script_loader import load_script

pytest.importorskip("triton.backends.nvidia")


def test_counts_branches_and_load_widths(tmp_path):
    """Every variant the engine's plan launches compiles and is counted. Specialised as a GPU launch is (the
    pointers' 16-byte alignment known), the adapter rows load 16 bytes at a time where the kernel allows it:
    the expand's B rows, and the shrink's A rows on its wide branch (rank 8 and the multiples of 16), not
    on the per-k branch, whose masked runs of a run-time rank load one element each."""
    bench = load_script("triton_sass.py")
    every = bench.main(["--json", str(tmp_path / "sass.json")])
    wide = bench.main(["--shrink-branch", "wide"])
    per_k = bench.main(["--shrink-branch", "per-k"])
    per_element = bench.main(["--shrink-branch", "per-element"])
    assert set(every) == {"shrink BLOCK_M=1", "expand BLOCK_M=1", "shrink BLOCK_M=32", "expand BLOCK_M=32"}
    assert all(r["sass_instructions"] > 0 and r["global_loads"] for r in every.values())
    for rows in (every, wide, per_k):
        assert rows["expand BLOCK_M=1"]["global_loads"].get("LDG.E.128", 0) >= 1
        assert rows["expand BLOCK_M=1"] == every["expand BLOCK_M=1"]  # the expand has no such branches
    for name in ("shrink BLOCK_M=1", "shrink BLOCK_M=32"):
        assert wide[name]["global_loads"].get("LDG.E.128", 0) >= 1
        assert "LDG.E.128" not in per_k[name]["global_loads"]
        assert per_k[name]["sass_instructions"] < per_element[name]["sass_instructions"] < every[name]["sass_instructions"]
    # The decode shrink's wide branch: its A tile in two 16-byte loads per thread (the one 2-byte load is x).
    assert wide["shrink BLOCK_M=1"]["global_loads"].get("LDG.E.U16", 0) <= 1
    saved = json.loads((tmp_path / "sass.json").read_text())
    assert saved["kernels"] == every and saved["shrink_branch"] is None
