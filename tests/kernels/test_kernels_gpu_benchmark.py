"""benchmarks/kernels_gpu.py runs end to end on the CPU (reduced dry-run shapes), so the GPU session
that times it does not spend its device time on a broken script."""

from __future__ import annotations

import dataclasses
import json

import torch
from script_loader import load_script


def test_benchmark_dry_run_checks_and_reports(tmp_path):
    bench = load_script("kernels_gpu.py")
    shapes = dataclasses.replace(bench.DRY, batches=(3,), rank_sets={"mixed": (8, 16, 64)}, popularity=("zipf",),
                                 sgmv_sweep=(), attention_sweep=())
    report = bench.run(shapes, torch.device("cpu"), tmp_path, budget_s=600, dry_run=True)
    assert report["sgmv"] and report["attention"]
    assert all(r["check_ok"] for r in report["sgmv"] + report["attention"])
    assert json.loads((tmp_path / "kernels_gpu.json").read_text())["dry_run"] is True
    assert "| zipf | mixed | 3 |" in (tmp_path / "kernels_gpu.md").read_text()
    # The grouped calls' halves timed apart, with the bytes each reads: A for the shrink, B for the expand
    # (the same element count in a layer's 7 modules: each A is rank x in, each B rank x out).
    for r in report["sgmv"]:
        assert r["shrink_us"] > 0 and r["expand_us"] > 0
        a_bytes, b_bytes = r["shrink_gbps"] * r["shrink_us"], r["expand_gbps"] * r["expand_us"]
        assert abs(a_bytes + b_bytes - r["adapter_bytes"] / 1e3) < 1e-6 * r["adapter_bytes"]


def test_a_failing_case_is_recorded_and_listed_not_fatal(tmp_path):
    """The GPU run is one call on a lent machine: a case that raises is recorded, printed and listed under
    the tables, the others still run, and the exit status says a check failed."""
    bench = load_script("kernels_gpu.py")

    def broken() -> dict:
        raise RuntimeError("pool too small")

    rec = bench.guarded("attention batch 256", broken)
    assert rec == {"case": "attention batch 256", "error": "RuntimeError: pool too small", "check_ok": False}
    shapes = dataclasses.replace(bench.DRY, batches=(2,), rank_sets={"r8": (8,)}, popularity=("distinct",),
                                 sgmv_sweep=(), attention_sweep=())
    report = bench.run(shapes, torch.device("cpu"), tmp_path, budget_s=600, dry_run=True)
    report["attention"].append(rec)
    md = bench.markdown(report)
    assert "- attention batch 256: RuntimeError: pool too small" in md
    assert md.count("| 2 | 40 |") == 1  # the attention row that ran is still in its table
