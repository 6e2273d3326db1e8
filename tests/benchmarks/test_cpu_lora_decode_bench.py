"""benchmarks/cpu_lora_decode_bench.py on a small step: the paths run, the floor is the adapters' bytes, and
--with-gemm reports what the LoRA adds to the GEMMs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from loraplex.kernels import cpu_linear, cpu_sgmv
from native_kernels import require_built

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cpu_lora_decode_bench  # noqa: E402


def test_segments_deal_the_batch_to_the_adapters_in_turn():
    assert cpu_lora_decode_bench.segment_lengths(64, 30) == [3] * 4 + [2] * 26
    assert cpu_lora_decode_bench.segment_lengths(2, 3) == [1, 1, 0]


def test_bench_times_the_step_against_the_read_and_writes_json(tmp_path):
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")
    out = tmp_path / "decode.json"
    result = cpu_lora_decode_bench.main(["--batch", "5", "--adapters", "3", "--ranks", "8", "16", "--layers", "2",
                                         "--reps", "2", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert set(result["ms_q1"]) == {"sgmv", "read"} and all(t > 0 for t in result["ms_q1"].values())
    assert result["added_to_gemm_ms"] == {}  # without --with-gemm no GEMM path is timed
    assert result["segment_lengths"] == [2, 2, 1] and len(result["all_ms"]["sgmv"]) == 2
    # ranks 8, 16, 8 on 7 modules of 2 layers: every A^T [in, r] and B^T [r, out] once, float32
    per_rank = sum(i + o for i, o in cpu_lora_decode_bench.SHAPES.values()) * 2 * 4
    assert result["adapter_mb"] * 1e6 == (8 + 16 + 8) * per_rank
    assert abs(result["floor_ms"] - result["adapter_mb"] * 1e6 / (result["read_gbps"] * 1e9) * 1e3) < 1e-9


def test_lengths_give_each_adapter_its_tokens(tmp_path):
    """--lengths: a step as the engine met it (the scaling runs' uneven popularity), the batch their sum."""
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")
    result = cpu_lora_decode_bench.main(["--lengths", "1", "3", "1", "5", "--ranks", "8", "16", "--layers", "1",
                                         "--reps", "1", "--out", str(tmp_path / "decode.json")])
    assert result["segment_lengths"] == [1, 3, 1, 5] and result["batch"] == 10 and result["adapters"] == 4
    per_rank = sum(i + o for i, o in cpu_lora_decode_bench.SHAPES.values()) * 4
    assert result["adapter_mb"] * 1e6 == (8 + 16 + 8 + 16) * per_rank
    with pytest.raises(SystemExit):
        cpu_lora_decode_bench.main(["--lengths", "2", "0", "--out", str(tmp_path / "bad.json")])


def test_baseline_sources_with_one_file_name_are_refused_before_any_build(tmp_path):
    from loraplex.kernels.cpu_build import baseline_builds

    a, b = tmp_path / "a" / "old.cpp", tmp_path / "b" / "old.cpp"  # never read: refused first
    with pytest.raises(ValueError, match="distinct file names"):
        baseline_builds([a, b], "baseline_cpu_sgmv")
    assert baseline_builds([], "baseline_cpu_sgmv") == {}


def test_with_gemm_times_the_gemms_alone_and_with_the_lora_and_reports_the_difference(tmp_path):
    require_built("cpu_sgmv", cpu_sgmv.available(), "SGMV kernel")
    require_built("cpu_linear", cpu_linear.available(), "packed GEMM")
    result = cpu_lora_decode_bench.main(["--batch", "4", "--adapters", "2", "--ranks", "8", "--layers", "1",
                                         "--reps", "3", "--with-gemm", "--out", str(tmp_path / "decode.json")])
    assert set(result["ms_q1"]) == {"sgmv", "read", "gemm", "gemm+sgmv"}
    both, alone = result["all_ms"]["gemm+sgmv"], result["all_ms"]["gemm"]
    assert len(both) == len(alone) == 3
    diffs = sorted(a - b for a, b in zip(both, alone))
    assert result["added_to_gemm_ms"] == {"gemm+sgmv": pytest.approx(diffs[1])}  # the median of three rounds
