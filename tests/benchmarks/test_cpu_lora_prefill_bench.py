"""benchmarks/cpu_lora_prefill_bench.py on a small batch: every path runs, its JSON is written and sane."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loraplex.kernels import cpu_linear, cpu_sgmv
from native_kernels import require_built

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cpu_lora_prefill_bench  # noqa: E402


def test_bench_times_every_path_and_writes_json(tmp_path):
    require_built("cpu_linear", cpu_linear.available(), "linear kernel")
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")
    out = tmp_path / "prefill.json"
    result = cpu_lora_prefill_bench.main(["--segments", "2", "--tokens", "20", "--rank", "8", "--reps", "2",
                                          "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(result["ms_q1"]) == {"base", "blas", "sgmv", "fused", "shrink"}
    assert all(t > 0 for t in result["ms_q1"].values())
    # The shrink runs without the GEMMs: what it adds is its own time, less than the fused path's whole call.
    assert result["added_ms"]["shrink"] == result["ms_q1"]["shrink"]
    assert result["ms_q1"]["shrink"] < result["ms_q1"]["fused"]
    assert result["lora_gflop"] == 2 * 40 * 8 * (576 * 7 + 192 * 2 + 576 * 2 + 1536 * 3) / 1e9


def test_bench_times_earlier_builds_beside_the_kernels(tmp_path):
    """--baseline-source: another cpu_linear.cpp (here the kernel's own source, built under another name) runs as
    path 'baseline' in the same rounds; --shrink-baseline-source: another cpu_sgmv.cpp's shrink, as
    'shrink:baseline'."""
    require_built("cpu_linear", cpu_linear.available(), "linear kernel")
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")
    src = Path(cpu_linear.__file__).with_suffix(".cpp")
    sgmv_src = Path(cpu_sgmv.__file__).with_suffix(".cpp")
    result = cpu_lora_prefill_bench.main(["--segments", "2", "--tokens", "20", "--rank", "8", "--reps", "2",
                                          "--baseline-source", str(src), "--shrink-baseline-source", str(sgmv_src),
                                          "--out", str(tmp_path / "p.json")])
    assert set(result["ms_q1"]) == {"base", "blas", "sgmv", "fused", "shrink", "baseline", "shrink:baseline"}
    assert result["ms_q1"]["baseline"] > 0 and len(result["all_ms"]["baseline"]) == 2
    # The other build's shrink, like this one's, runs without the GEMMs: what it adds is its own time.
    assert result["added_ms"]["shrink:baseline"] == result["ms_q1"]["shrink:baseline"] > 0


def test_bench_runs_a_step_of_layers_with_given_segments(tmp_path):
    """--layers: each layer its own weights and adapter rows, every path over all of them; --lengths and --ranks:
    the segments of a real step; --paths: only those (and base)."""
    require_built("cpu_linear", cpu_linear.available(), "linear kernel")
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")
    result = cpu_lora_prefill_bench.main(["--layers", "2", "--lengths", "20", "13", "24", "--ranks", "8", "16",
                                          "--paths", "fused", "shrink", "--reps", "2", "--out", str(tmp_path / "s.json")])
    assert set(result["ms_q1"]) == {"base", "fused", "shrink"}
    assert (result["layers"], result["lengths"], result["ranks"], result["total_tokens"]) == (2, [20, 13, 24],
                                                                                             [8, 16, 8], 57)
    # Every layer's LoRA: (20 + 24) tokens at rank 8 and 13 at rank 16, on all 7 modules of both layers.
    assert result["lora_gflop"] == 2 * 2 * (44 * 8 + 13 * 16) * (576 * 7 + 192 * 2 + 576 * 2 + 1536 * 3) / 1e9
    assert result["ms_q1"]["shrink"] < result["ms_q1"]["fused"]


def test_bench_times_each_layer_cold(tmp_path):
    """--cold: each layer's call of each path timed alone after a flush; a step is the per-layer medians summed, and
    what a path adds the per-layer paired medians summed (a shrink's, its own time)."""
    require_built("cpu_linear", cpu_linear.available(), "linear kernel")
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")
    result = cpu_lora_prefill_bench.main(["--layers", "3", "--lengths", "20", "30", "--paths", "fused", "shrink",
                                          "--reps", "3", "--cold", "--out", str(tmp_path / "c.json")])
    assert result["cold"] is True
    assert set(result["cold_step_ms"]) == {"base", "fused", "shrink"} and set(result["cold_added_ms"]) == {"fused",
                                                                                                           "shrink"}
    assert all(t > 0 for t in result["cold_step_ms"].values())
    assert result["cold_added_ms"]["shrink"] == result["cold_step_ms"]["shrink"]
    assert all(len(ts) == 3 for ts in result["all_ms"].values())  # a step's time per round: its layers' calls summed
    assert result["cold_step_ms"]["shrink"] < result["cold_step_ms"]["fused"]


def test_bench_times_the_fused_paths_again_over_one_segment(tmp_path):
    """--one-segment: each fused path (this checkout's and a --baseline-source build) again as '<name>:one', every
    token in one segment of the first adapter, in the same rounds."""
    require_built("cpu_linear", cpu_linear.available(), "linear kernel")
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")
    src = Path(cpu_linear.__file__).with_suffix(".cpp")
    result = cpu_lora_prefill_bench.main(["--lengths", "20", "13", "24", "--ranks", "8", "16", "--paths", "fused",
                                          "--reps", "2", "--one-segment", "--baseline-source", str(src),
                                          "--out", str(tmp_path / "o.json")])
    assert set(result["ms_q1"]) == {"base", "fused", "fused:one", "baseline", "baseline:one"}
    assert all(len(result["all_ms"][p]) == 2 and min(result["all_ms"][p]) > 0 for p in result["ms_q1"])
